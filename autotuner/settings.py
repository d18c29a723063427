"""The one settings object of the project, read from ``AUTOTUNER_*`` environment variables.

``Settings`` lives in the light core of ``autotuner`` (pydantic-settings only: no JAX, no
SQLAlchemy), so the service, the database layer, the tuner, the CLI and a training job's client
all read the same fields the same way. Fields:

- ``AUTOTUNER_DB_URL``: SQLAlchemy URL or a bare file path; default ``autotuner.db`` in the
  current directory. ``postgres://`` and ``postgresql://`` are normalised to
  ``postgresql+psycopg://`` (psycopg 3), a bare path to an absolute ``sqlite:///`` URL.
- ``AUTOTUNER_WRITE_TOKENS`` / ``AUTOTUNER_READ_TOKENS``: comma-separated bearer tokens
  (in addition to the tokens table).
- ``AUTOTUNER_MAX_BODY_BYTES``, ``AUTOTUNER_MAX_BATCH``, ``AUTOTUNER_LEASE_SECONDS``: limits.
- ``AUTOTUNER_LOOKUP_CACHE_SECONDS`` (3600), ``AUTOTUNER_LOOKUP_POLL_SECONDS`` (0.2),
  ``AUTOTUNER_NEAREST_MAX_DISTANCE`` (2): lookups (a service process keeps an answer until a
  winner it depends on changes, which it learns within the poll interval, or at most that long).
- ``AUTOTUNER_SERVICE_URL`` / ``AUTOTUNER_SERVICE_TOKEN``: the service clients ask by default.
- ``AUTOTUNER_PARSE_MEMO_ENTRIES`` / ``_BYTES``, ``AUTOTUNER_LOOKUP_CACHE_ENTRIES`` / ``_BYTES``,
  ``AUTOTUNER_NEAREST_MAX_GROUPS`` / ``_BYTES``, ``AUTOTUNER_DEMAND_MAX_ROWS`` / ``_PENDING``:
  what a service process keeps in memory and in the demand table (README "Limits and bounds").
- ``AUTOTUNER_ANON_LOOKUP_RATE`` / ``_BURST`` / ``_CLIENTS``, ``AUTOTUNER_ANON_BATCH_CONCURRENCY`` /
  ``_SHARE`` / ``_SLICE``:
  what lookups without a valid token may cost a service process (``service.ratelimit``).

A variable set but empty is its default; one that does not hold what its field takes is a
``SettingsError`` naming it (the CLI's one-line error), from ``get_settings``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from autotuner.errors import AutotunerError

__all__ = ["DEFAULT_DB_FILE", "Settings", "SettingsError", "get_settings", "normalize_db_url", "redact_db_url"]

DEFAULT_DB_FILE = "autotuner.db"

_PG_PREFIXES = ("postgres://", "postgresql://")


def normalize_db_url(url: str | os.PathLike[str]) -> str:
    """Return a SQLAlchemy URL for ``url``.

    - ``postgres://...`` and ``postgresql://...`` become ``postgresql+psycopg://...``;
      URLs naming a driver explicitly (``postgresql+psycopg://``) are kept.
    - A bare file path (no ``://``) becomes ``sqlite:///ABSOLUTE/PATH`` (``~`` expanded);
      ``:memory:`` becomes ``sqlite://``.
    - Anything else with a scheme (``sqlite:///x.db``) is returned unchanged.

    Raises ``ValueError`` for an empty URL.
    """
    text = os.fspath(url).strip()
    if not text:
        raise ValueError("database URL is empty; set AUTOTUNER_DB_URL or pass --db URL")
    for prefix in _PG_PREFIXES:
        if text.startswith(prefix):
            return "postgresql+psycopg://" + text[len(prefix) :]
    if "://" in text:
        return text
    if text == ":memory:":
        return "sqlite://"
    path = Path(text).expanduser().resolve()
    return f"sqlite:///{path}"


def redact_db_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}{slash}{tail}"


def _split_tokens(value: Any) -> Any:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``; a JSON list (``'["a", "b"]'``) is accepted too."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            if isinstance(parsed, list):
                return [str(part).strip() for part in parsed if str(part).strip()]
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    """Process-wide settings; every field can be set as ``AUTOTUNER_<FIELD>``."""

    model_config = SettingsConfigDict(
        env_prefix="AUTOTUNER_",
        extra="ignore",
        frozen=True,
        env_ignore_empty=True,   # AUTOTUNER_DB_URL= (set, empty) is the default, not an error
    )

    db_url: str = Field(
        default_factory=lambda: normalize_db_url(Path.cwd() / DEFAULT_DB_FILE),
        description="SQLAlchemy URL (or file path) of the results database.",
    )
    # repr=False: tokens never show up in logs or tracebacks that print the settings.
    write_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        repr=False,
        description="Bearer tokens allowed to write (comma-separated).",
    )
    read_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        repr=False,
        description="Bearer tokens allowed to read (comma-separated).",
    )
    max_body_bytes: int = Field(default=1_000_000, gt=0)
    max_batch: int = Field(default=1000, gt=0)
    lease_seconds: float = Field(default=300.0, gt=0)
    # service: how long a worker keeps a lookup answer; how far (log2-shape distance) a
    # tuned neighbour may be for a `nearest` answer
    # (a backstop: every process learns of changed winners within lookup_poll_seconds)
    lookup_cache_seconds: float = Field(default=3600.0, ge=0)
    lookup_poll_seconds: float = Field(default=0.2, gt=0, le=60)
    nearest_max_distance: float = Field(default=2.0, ge=0)
    # per request: how long the cost model may predict for untuned shapes (the rest: default)
    model_budget_seconds: float = Field(default=2.0, ge=0)
    # service: what a process keeps (README "Limits and bounds"); bytes are estimated
    parse_memo_entries: int = Field(default=16_384, ge=0,
                                    description="Parsed request objects remembered, per memo table.")
    parse_memo_bytes: int = Field(default=32 * 2**20, ge=0,
                                  description="Bytes of parsed request objects remembered, per memo table.")
    lookup_cache_entries: int = Field(default=200_000, ge=0, description="Lookup answers cached.")
    lookup_cache_bytes: int = Field(default=256 * 2**20, ge=0, description="Bytes of lookup answers cached.")
    nearest_max_groups: int = Field(default=4096, ge=0,
                                    description="(device, pattern, dtype, mesh size) groups the nearest index holds.")
    nearest_max_bytes: int = Field(default=256 * 2**20, ge=0,
                                   description="Bytes of the nearest index's groups.")
    demand_max_rows: int = Field(default=100_000, gt=0,
                                 description="Rows of the demand table (the least missed go first).")
    demand_max_pending: int = Field(default=10_000, gt=0,
                                    description="(device, problem) misses buffered between demand writes.")
    # service: lookups without a valid token, per process (service.ratelimit); a token is never limited
    anon_lookup_rate: float = Field(default=200.0, ge=0,
                                    description="Problems per second one address may look up without a token (0: no limit).")
    anon_lookup_burst: int = Field(default=5000, gt=0,
                                   description="Problems one address may look up at once without a token (a larger batch costs all).")
    anon_lookup_clients: int = Field(default=16_384, gt=0,
                                     description="Addresses whose anonymous lookups are counted (the least recently seen go first).")
    anon_batch_concurrency: int = Field(default=8, ge=0,
                                        description="Anonymous batch lookups admitted at once, their slices paced (0: no limit).")
    anon_batch_share: float = Field(default=0.1, gt=0, le=1,
                                    description="Share of a process's time its anonymous batch lookups may take together (1: not paced).")
    anon_batch_slice: int = Field(default=8, gt=0,
                                  description="Problems of an anonymous batch answered at a time, between rests (service.pacing).")
    # client (autotuner.runtime.client.default_client): the service a training job asks
    service_url: str | None = None
    service_token: str | None = Field(default=None, repr=False)
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "autotuner",
        description="Local scratch: studies and measurements of runs that report to a service.",
    )
    trial_lease_seconds: float = Field(
        default=900.0, gt=0,
        description="A tuner trial untouched this long belongs to a dead worker and is re-queued.",
    )

    def __repr_args__(self) -> Any:
        # Never print a database password.
        for name, value in super().__repr_args__():
            if name == "db_url" and isinstance(value, str):
                value = redact_db_url(value)
            yield name, value

    @field_validator("db_url", mode="before")
    @classmethod
    def _normalize_db_url(cls, value: Any) -> Any:
        if isinstance(value, str | os.PathLike):
            return normalize_db_url(value)
        return value

    @field_validator("write_tokens", "read_tokens", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return _split_tokens(value)


class SettingsError(AutotunerError, ValueError):
    """An ``AUTOTUNER_*`` variable that does not hold what its field takes."""


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings read from the environment, built once per process; SettingsError names each
    variable that does not hold what its field takes (its value, unless a token or a password).

    Call ``get_settings.cache_clear()`` after changing the environment (tests).
    """
    try:
        return Settings()
    except ValidationError as e:
        raise SettingsError("; ".join(_said(err) for err in e.errors())) from None


def _said(err: Any) -> str:
    """One field's complaint as the user set it: `AUTOTUNER_MAX_BATCH='abc': Input should be ...`."""
    name = f"AUTOTUNER_{err['loc'][0]}".upper() if err["loc"] else "AUTOTUNER_*"
    value = err.get("input")
    if "TOKEN" in name:
        shown = "(hidden)"
    elif name == "AUTOTUNER_DB_URL" and isinstance(value, str):
        shown = repr(redact_db_url(value))
    else:
        shown = repr(value)
    return f"{name}={shown}: {err['msg'].removeprefix('Value error, ')}"
