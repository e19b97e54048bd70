"""Who may use the server, and what the owner is warned about: an optional UI login (Gradio's
own, from `GEMMA4_AUTH=user:pw[,...]`, `GEMMA4_AUTH_FILE` or the flags), optional bearer keys for
/v1 (`GEMMA4_API_KEY=key[,key2]`), and per-client limits (`gemma4.web.ratelimit.Limits`).

The policy, in one place (`api_closed_reason`, `exposure_warnings`): a UI login with no API key
closes /v1 (an open API beside a login would let anyone spend the machine the login protects); a
public share link or a non-local address without a login is warned about loudly.

Plain Python, no web framework: the app parses its flags before gradio is imported (3–4 s), so
the engine starts loading first (`app.main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from collections.abc import Mapping

from gemma4.env import Settings as EnvSettings
from gemma4.web.ratelimit import Limits

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class Access:
    """Logins for the UI, keys for /v1, per-client limits. Secrets never appear in repr()."""

    logins: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    limits: Limits = Limits()
    trust_proxy: bool = False  # read the client address from X-Forwarded-For (Spaces' proxy)

    def __repr__(self) -> str:
        return (f"Access(logins={len(self.logins)}, api_keys={len(self.api_keys)}, "
                f"limits={self.limits}, trust_proxy={self.trust_proxy})")


def parse_logins(text: str, where: str = "GEMMA4_AUTH") -> tuple[tuple[str, str], ...]:
    """'user:password[,user2:password2]' → pairs (a password may hold ':' but not ',')."""
    return tuple(_pair(p.strip(), where) for p in text.split(",") if p.strip())


def read_login_file(path: str) -> tuple[tuple[str, str], ...]:
    """One 'user:password' per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the login file {path}: {e.strerror or e}") from None
    return tuple(_pair(line.strip(), f"{path} line {i}") for i, line in enumerate(lines, 1)
                 if line.strip() and not line.lstrip().startswith("#"))


def _pair(item: str, where: str) -> tuple[str, str]:
    user, sep, password = item.partition(":")
    if not sep or not user.strip() or not password:
        raise ValueError(f"{where}: expected 'user:password', got {item.split(':')[0]!r}:…")
    return user.strip(), password


# Each flag's destination → the setting it overrides (a given flag is that setting's source).
FLAG_SETTINGS = {"auth": "GEMMA4_AUTH", "auth_file": "GEMMA4_AUTH_FILE", "api_key": "GEMMA4_API_KEY",
                 "rate_in_flight": "GEMMA4_RATE_IN_FLIGHT", "rate_per_minute": "GEMMA4_RATE_PER_MINUTE",
                 "max_body_bytes": "GEMMA4_MAX_BODY_BYTES", "max_messages": "GEMMA4_MAX_MESSAGES",
                 "max_input_tokens": "GEMMA4_MAX_INPUT_TOKENS", "trust_proxy": "GEMMA4_TRUST_PROXY"}


def add_access_flags(p: argparse.ArgumentParser, settings: EnvSettings, env: Mapping[str, str]) -> None:
    """The access flags of `python app.py`, each defaulting to its GEMMA4_* setting in `settings`
    (the app's `gemma4.env.Settings`); `env`: the environment, for Spaces' SPACE_ID."""
    d = Limits()
    g = p.add_argument_group("access (UI login, API keys, rate limits)")
    g.add_argument("--auth", default=settings.get("GEMMA4_AUTH"), metavar="USER:PW[,...]",
                   help="require a login for the UI (env GEMMA4_AUTH; prefer the variable or "
                        "--auth-file: flags show in the process list)")
    g.add_argument("--auth-file", default=settings.get("GEMMA4_AUTH_FILE"), metavar="PATH",
                   help="file with one user:password per line (env GEMMA4_AUTH_FILE)")
    g.add_argument("--api-key", default=settings.get("GEMMA4_API_KEY"), metavar="KEY[,...]",
                   help="bearer key(s) required by /v1 (env GEMMA4_API_KEY)")
    g.add_argument("--rate-in-flight", type=int, metavar="N", default=settings.get("GEMMA4_RATE_IN_FLIGHT"),
                   help=f"generation requests in flight per API client, 0 = no limit "
                        f"(env GEMMA4_RATE_IN_FLIGHT, default {d.in_flight})")
    g.add_argument("--rate-per-minute", type=int, metavar="N", default=settings.get("GEMMA4_RATE_PER_MINUTE"),
                   help=f"API requests (and UI messages) per minute per client, 0 = no limit "
                        f"(env GEMMA4_RATE_PER_MINUTE, default {d.per_minute})")
    g.add_argument("--max-body-bytes", type=int, metavar="BYTES", default=settings.get("GEMMA4_MAX_BODY_BYTES"),
                   help=f"largest API request body (env GEMMA4_MAX_BODY_BYTES, default "
                        f"{d.max_body_bytes})")
    g.add_argument("--max-messages", type=int, metavar="N", default=settings.get("GEMMA4_MAX_MESSAGES"),
                   help="messages per API chat request, refused (400) above it; 0 = no cap "
                        "(env GEMMA4_MAX_MESSAGES, default half the context window)")
    g.add_argument("--max-input-tokens", type=int, metavar="N", default=settings.get("GEMMA4_MAX_INPUT_TOKENS"),
                   help="tokens in an API chat request's messages before old turns are dropped, "
                        "refused (400) above it; 0 = no cap (env GEMMA4_MAX_INPUT_TOKENS, default "
                        "4 context windows)")
    trust_proxy = settings.get("GEMMA4_TRUST_PROXY")
    g.add_argument("--trust-proxy", action=argparse.BooleanOptionalAction,
                   default=bool(env.get("SPACE_ID")) if trust_proxy is None else trust_proxy,
                   help="key rate limits by X-Forwarded-For (env GEMMA4_TRUST_PROXY; on by "
                        "default on Hugging Face Spaces, whose proxy sets it)")


def access_from_args(a: argparse.Namespace) -> Access:
    """The parsed access flags as an Access; ValueError with the reason for bad values."""
    logins = parse_logins(a.auth, "--auth / GEMMA4_AUTH") if a.auth else ()
    if a.auth_file:
        logins += read_login_file(a.auth_file)
    keys = tuple(k.strip() for k in (a.api_key or "").split(",") if k.strip())
    limits = Limits(in_flight=a.rate_in_flight, per_minute=a.rate_per_minute,
                    max_body_bytes=a.max_body_bytes, max_messages=a.max_messages,
                    max_input_tokens=a.max_input_tokens).validated()
    return Access(logins=logins, api_keys=keys, limits=limits, trust_proxy=a.trust_proxy)


# --------------------------------------------------------------------------- the policy


def api_closed_reason(access: Access) -> str | None:
    """Why /v1 refuses everyone, or None: a UI login without an API key closes the API."""
    if access.logins and not access.api_keys:
        return ("This server's UI requires a login and no API key is set, so /v1 is closed. "
                "The owner opens it by setting GEMMA4_API_KEY (clients then send it as a "
                "bearer key).")
    return None


def exposure_warnings(*, share: bool, host: str, access: Access) -> list[str]:
    """What an owner must know before the server is reachable by others."""
    out = []
    api_open = not access.api_keys and not access.logins
    if share and not access.logins:
        out.append("THE SHARE LINK IS PUBLIC: anyone who has the URL can chat with this model on "
                   "this machine" + (" and call its /v1 API" if api_open else "") + ". Set "
                   "GEMMA4_AUTH=user:password (or --auth / --auth-file) to require a login"
                   + (", and GEMMA4_API_KEY for /v1." if api_open else "."))
    elif host not in LOCAL_HOSTS and not access.logins:
        out.append(f"Listening on {host} without a login: anyone who can reach this address can "
                   "use the UI" + (" and /v1" if api_open else "") + ". Set GEMMA4_AUTH "
                   "(and GEMMA4_API_KEY) to restrict it.")
    return out
