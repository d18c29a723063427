"""The client's HTTP transport: one request, its answer read whole within a deadline and a size
cap, and the service's "no" (4xx) and "not now" (408/429/503) told apart (`Client` asks through it)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from autotuner.errors import AutotunerError

MAX_ANSWER_BYTES = 32 * 2**20   # a lookup's or evidence's answer: BATCH answers are well under 1 MiB
MAX_RETRY_AFTER = 3600.0        # the longest Retry-After (408/429/503) honoured, in seconds
TRANSIENT = (408, 429, 503)     # a proxy's or a busy service's "not now": asked again after Retry-After


class ClientError(AutotunerError, RuntimeError):
    """A failed request to the service, or an unusable snapshot file."""


class ServiceURLError(AutotunerError, ValueError):
    """A service URL that is no http(s)://HOST[:PORT] URL."""


def check_url(url: Any) -> None:
    """ServiceURLError (a ValueError) unless `url` is an http(s) URL with a host: a malformed one
    would only show as a warning per outage, every pair keeping its default."""
    try:
        parsed = httpx.URL(url)
    except (TypeError, httpx.InvalidURL) as e:
        raise ServiceURLError(f"service URL {url!r} is not a URL: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ServiceURLError(f"service URL {url!r}: expected http(s)://HOST[:PORT], e.g. http://autotuner:8000")


class _Refused(ClientError):
    """The service answered 4xx: asking again will not help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _NotNow(ClientError):
    """408, 429 or 503: the service (or a proxy before it) is busy; ask again after ``retry_after``
    seconds (its Retry-After header, where it sent one)."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    """A Retry-After header's seconds (delta-seconds or an HTTP date), capped; None if absent or
    unreadable."""
    if not value:
        return None
    try:
        secs = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            secs = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return min(max(0.0, secs), MAX_RETRY_AFTER) if secs == secs else None


@dataclass(frozen=True)
class _Reply:
    """A whole answer: its status, headers and (decoded) body."""

    status_code: int
    headers: httpx.Headers
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


def _send(http: httpx.Client, method: str, path: str, deadline_s: float, **kw: Any) -> _Reply:
    """One request whose answer is read whole within `deadline_s` seconds in all and holds at
    most MAX_ANSWER_BYTES (ClientError otherwise); a 408, 429 or 503 raises `_NotNow`."""
    start = time.monotonic()
    with http.stream(method, path, **kw) as resp:
        if resp.status_code in TRANSIENT:
            raise _NotNow(f"{method} {path} answered {resp.status_code}",
                          _retry_after(resp.headers.get("retry-after")))
        body = bytearray()
        for part in resp.iter_bytes():   # decoded: the cap holds for a compressed answer too
            body += part
            if len(body) > MAX_ANSWER_BYTES:
                raise ClientError(f"{method} {path}: the answer is larger than {MAX_ANSWER_BYTES} bytes")
            if time.monotonic() - start > deadline_s:
                raise ClientError(f"{method} {path}: no whole answer within {deadline_s:g} s")
    return _Reply(resp.status_code, resp.headers, bytes(body))


def _decode(content: bytes, where: str) -> Any:
    """The JSON ``content`` holds; ClientError for invalid UTF-8 (UnicodeDecodeError, a
    ValueError) or JSON, or nesting deeper than the parser recurses (RecursionError)."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError) as e:
        raise ClientError(f"{where}: the answer is not JSON ({type(e).__name__}: {str(e)[:100]})") from None
