"""The media of an API request: image_url / video_url / audio_url → `MediaItem` (gemma4.media.files),
and input_audio's base64 data (`from_base64`).

A `data:` URI is decoded in place. An http(s) URL is fetched by the server, with a byte limit
(the media kind's, `MediaLimits`: the body is read no further than it) and a time limit for the
whole fetch; a server that cannot
reach it (offline, DNS, refused, timed out) is refused with a message that says to send the file
as a data: URI. Other schemes (file:, ftp:) are refused: a client must never make the server
read its own disk. Fetching can be turned off (GEMMA4_FETCH_URLS=off: data: URIs only), e.g. for
a server on a network whose hosts its clients must not reach through it.

Every refusal is an `ApiError` 400 naming the part's field ("messages.0.content.1.image_url.url").
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from gemma4.env import Settings, default_of
from gemma4.media.files import (MediaError, MediaItem, MediaLimits, media_from_base64, media_from_bytes,
                                media_from_data_uri)
from gemma4.web.api_schema import ApiError

FETCH_ENV = "GEMMA4_FETCH_URLS"
FETCH_TIMEOUT_ENV = "GEMMA4_FETCH_TIMEOUT_S"


@dataclasses.dataclass(frozen=True)
class FetchPolicy:
    """enabled: fetch http(s) URLs at all (GEMMA4_FETCH_URLS); timeout_s: the whole fetch,
    connection and body (10 s, GEMMA4_FETCH_TIMEOUT_S); limits: the byte limit per media kind."""

    enabled: bool = default_of(FETCH_ENV)
    timeout_s: float = default_of(FETCH_TIMEOUT_ENV)
    limits: MediaLimits = dataclasses.field(default_factory=MediaLimits)

    @classmethod
    def from_settings(cls, settings: Settings) -> "FetchPolicy":
        """The policy of the app's settings (`gemma4.env.Settings`, read from the environment and
        the flags once, at start: a bad value stopped it there)."""
        return cls(enabled=settings.get(FETCH_ENV), timeout_s=settings.get(FETCH_TIMEOUT_ENV),
                   limits=MediaLimits.from_settings(settings))


def resolve(url: str, kind: str, param: str, policy: FetchPolicy) -> MediaItem:
    """The MediaItem a part's URL names (blocking: run it off the event loop)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    try:
        if scheme == "data":
            item = media_from_data_uri(url, kind=kind, limits=policy.limits)
        elif scheme in ("http", "https"):
            item = media_from_bytes(_fetch(url, kind, param, policy), name=_name_of(url), kind=kind,
                                    limits=policy.limits)
        else:
            raise ApiError(400, f"{param}: URLs of scheme {scheme or '(none)'!r} are not accepted; send a data: URI "
                                "(base64) or an http(s) URL.", param=param)
    except MediaError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return item


def from_base64(data: str, kind: str, param: str, policy: FetchPolicy) -> MediaItem:
    """The MediaItem of base64 bytes sent in the request (OpenAI's input_audio.data), within the
    kind's byte limit; the kind is sniffed from the bytes (a declared format is not trusted)."""
    try:
        return media_from_base64(data, kind=kind, limits=policy.limits)
    except MediaError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None


def _name_of(url: str) -> str:
    return os.path.basename(urllib.parse.urlsplit(url).path) or urllib.parse.urlsplit(url).netloc


def _fetch(url: str, kind: str, param: str, policy: FetchPolicy) -> bytes:
    if not policy.enabled:
        raise ApiError(400, f"{param}: this server does not fetch URLs ({FETCH_ENV}=off); send the file as a data: "
                            "URI (data:image/png;base64,...).", param=param)
    end = time.monotonic() + policy.timeout_s
    max_bytes, variable = policy.limits.bytes_for(kind), MediaLimits.bytes_variable(kind)
    offline = (f"{param}: could not fetch {url!r}: {{why}}. This server may be offline or unable to reach that "
               "host; send the file as a data: URI (data:image/png;base64,...) instead.")
    try:
        req = urllib.request.Request(url, headers={"User-Agent": "gemma4-jax"})
        with urllib.request.urlopen(req, timeout=policy.timeout_s) as resp:
            declared = resp.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise ApiError(400, f"{param}: {url!r} is {int(declared)} bytes; an {kind} may be at most "
                                    f"{max_bytes} bytes ({variable}).", param=param)
            chunks, size = [], 0
            while True:
                if time.monotonic() > end:
                    raise ApiError(400, offline.format(why=f"it took longer than {policy.timeout_s:g} s"), param=param)
                chunk = resp.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(400, f"{param}: {url!r} is over the limit of {max_bytes} bytes for an {kind} "
                                        f"({variable}).", param=param)
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as e:
        raise ApiError(400, f"{param}: fetching {url!r} failed: HTTP {e.code} {e.reason}.", param=param) from None
    except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as e:
        why = getattr(e, "reason", None) or e
        raise ApiError(400, offline.format(why=why), param=param) from None
