"""What the demo server is started with: its flags, each falling back to a GEMMA4_* environment
variable (Spaces' GRADIO_SERVER_NAME/PORT too), checked before anything loads.

    python app.py --model bundled --port 7860
    python app.py --model google/gemma-4-E2B-it --host 0.0.0.0 --max-users 8

Every flag has an environment variable (GEMMA4_MODEL, GEMMA4_HOST, GEMMA4_PORT, GEMMA4_SHARE,
GEMMA4_MAX_USERS, GEMMA4_MAX_NEW_TOKENS, GEMMA4_CONTEXT, GEMMA4_MESH; access: GEMMA4_AUTH,
GEMMA4_AUTH_FILE, GEMMA4_API_KEY, GEMMA4_RATE_IN_FLIGHT, GEMMA4_RATE_PER_MINUTE,
GEMMA4_MAX_BODY_BYTES, GEMMA4_MAX_MESSAGES, GEMMA4_MAX_INPUT_TOKENS; multi-host:
`gemma4.serve.distributed_flags`), declared with its default in `gemma4.env` (docs/settings.md).
A GEMMA4_* variable that no setting declares is logged as a warning here, before anything loads.

This is the app's start-up read of the environment: `parse_settings` builds the one
`gemma4.env.Settings` the server runs with (every setting, from the environment, the flags given
on top), kept as `Settings.env`: the engine is built with it and the Hardware panel prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gemma4.env import EnvError, declared, default_of, env_int, flags_given, warn_unknown
from gemma4.env import Settings as EnvSettings
from gemma4.serve import distributed_flags
from gemma4.web import access as access_flags
from gemma4.web.access import Access, access_from_args, add_access_flags

@dataclasses.dataclass(frozen=True)
class Settings:
    """What the app is started with (flags override environment variables)."""

    model: str = default_of("GEMMA4_MODEL")
    host: str = "127.0.0.1"  # (GEMMA4_HOST and GEMMA4_PORT fall back to Spaces' variables, then these)
    port: int = 7860
    share: bool = default_of("GEMMA4_SHARE")
    max_users: int = default_of("GEMMA4_MAX_USERS")  # requests decoded together; also Gradio's concurrency limit
    max_new_tokens_cap: int = default_of("GEMMA4_MAX_NEW_TOKENS")
    context: int = default_of("GEMMA4_CONTEXT")
    queue_size: int = 64  # requests waiting in Gradio's queue before "queue is full"
    # UI login, /v1 keys, per-client rate limits (gemma4.web.server); secrets stay out of repr()
    access: Access = dataclasses.field(default_factory=Access)
    mesh: str = default_of("GEMMA4_MESH")  # devices the model spreads over (gemma4.plan.preflight / gemma4.plan.sharding)
    distributed: Any = None  # gemma4.serve.distributed_flags.Settings: more than one process (None: one)
    speculate: str = default_of("GEMMA4_SPECULATE")  # speculative decoding (engine/speculation.py)
    drafter: str | None = default_of("GEMMA4_DRAFTER")  # its drafter (None: prompt lookup)
    # every GEMMA4_* setting in force and where it came from (the engine's, the Hardware panel's)
    env: EnvSettings = dataclasses.field(default_factory=EnvSettings.defaults, repr=False)


# Each app flag's destination → the setting it overrides (a given flag is that setting's source).
FLAG_SETTINGS = {"model": "GEMMA4_MODEL", "host": "GEMMA4_HOST", "port": "GEMMA4_PORT", "share": "GEMMA4_SHARE",
                 "max_users": "GEMMA4_MAX_USERS", "max_new_tokens_cap": "GEMMA4_MAX_NEW_TOKENS",
                 "context": "GEMMA4_CONTEXT", "mesh": "GEMMA4_MESH", "speculate": "GEMMA4_SPECULATE",
                 "drafter": "GEMMA4_DRAFTER", **access_flags.FLAG_SETTINGS, **distributed_flags.FLAG_SETTINGS}


def _parser(settings: EnvSettings, env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The app's flags, each defaulting to its setting in `settings` (EnvError for a bad
    GRADIO_SERVER_PORT in `env`)."""
    # Spaces set GRADIO_SERVER_NAME/PORT; honour them when our own variables are unset.
    host = settings.get("GEMMA4_HOST") or env.get("GRADIO_SERVER_NAME") or Settings.host
    port = settings.get("GEMMA4_PORT") or env_int(env, "GRADIO_SERVER_PORT", Settings.port)
    p = argparse.ArgumentParser(description="Gemma 4 / Gemma 3 chat demo (pure JAX).")
    p.add_argument("--model", default=settings.get("GEMMA4_MODEL"),
                   help="'bundled' (Gemma 3 270M base, offline), a Hub repo id, a local folder, "
                        "or 'random:<preset>' (env GEMMA4_MODEL)")
    p.add_argument("--host", default=host, help="interface to listen on (env GEMMA4_HOST)")
    p.add_argument("--port", type=int, default=port, help="port (env GEMMA4_PORT)")
    p.add_argument("--share", action=argparse.BooleanOptionalAction,
                   default=settings.get("GEMMA4_SHARE"),
                   help="open a public Gradio share link (env GEMMA4_SHARE)")
    p.add_argument("--max-users", type=int,
                   default=settings.get("GEMMA4_MAX_USERS"),
                   help="requests decoded together (env GEMMA4_MAX_USERS)")
    p.add_argument("--max-new-tokens-cap", type=int,
                   default=settings.get("GEMMA4_MAX_NEW_TOKENS"),
                   help="upper bound of the max-new-tokens control (env GEMMA4_MAX_NEW_TOKENS)")
    p.add_argument("--context", type=int, default=settings.get("GEMMA4_CONTEXT"),
                   help="context window in tokens (env GEMMA4_CONTEXT)")
    p.add_argument("--queue-size", type=int, default=Settings.queue_size,
                   help="requests that may wait in the queue before new ones are refused")
    p.add_argument("--mesh", default=settings.get("GEMMA4_MESH"),
                   help="auto (the smallest mesh that fits) | none | e.g. tensor=4,data=2 (env GEMMA4_MESH)")
    p.add_argument("--speculate", choices=declared("GEMMA4_SPECULATE").choices, default=settings.get("GEMMA4_SPECULATE"),
                   help="speculative decoding: lookup drafts a reply's next tokens from its prompt and text, off "
                        "decodes one token a step (env GEMMA4_SPECULATE)")
    p.add_argument("--drafter", default=settings.get("GEMMA4_DRAFTER"),
                   help="the model's drafter (a Hub-layout folder, a Hub id, random, off; env GEMMA4_DRAFTER)")
    add_access_flags(p, settings, env)
    distributed_flags.add_arguments(p, settings)
    return p


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None):
    """Settings from command-line flags, falling back to GEMMA4_* environment variables (`environ`,
    default os.environ: read here, once); a bad value in either stops start-up with a message
    (SystemExit). `Settings.env` holds every setting in force, the flags given counted as such."""
    env = os.environ if environ is None else environ
    argv = list(argv) if argv is not None else None
    warn_unknown(env)
    try:
        from_env = EnvSettings.from_env(env)
        p = _parser(from_env, env)
    except EnvError as e:
        raise SystemExit(str(e)) from None
    a = p.parse_args(argv)
    for name in ("port", "max_users", "max_new_tokens_cap", "context", "queue_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    try:
        access = access_from_args(a)
        multi = distributed_flags.from_args(a, from_env)
        if a.mesh.strip().lower() != "auto":
            from gemma4.plan import sharding  # deferred: jax, +1.2 s on `import app` (measured)

            sharding.parse_mesh(a.mesh)  # a bad spec is a usage error, before anything loads
    except (ValueError, distributed_flags.DistributedError) as e:  # (MeshError is a ValueError)
        p.error(str(e))
    return Settings(model=a.model, host=a.host, port=a.port, share=a.share,
                    max_users=a.max_users, max_new_tokens_cap=a.max_new_tokens_cap,
                    context=a.context, queue_size=a.queue_size, access=access, mesh=a.mesh,
                    speculate=a.speculate, drafter=a.drafter,
                    distributed=multi if multi.enabled else None, env=from_env.with_flags(
                        {FLAG_SETTINGS[dest]: getattr(a, dest) for dest in flags_given(p, argv, FLAG_SETTINGS)}))
