"""The compile-time client of the autotuner service.

>>> client = Client("http://tuner:8000")                       # doctest: +SKIP
>>> client.lookup(problem, device).strategy                     # doctest: +SKIP
Strategy(method='ring', direction='bidi', chunks=2, ...)

Where an answer comes from, in order:

1. the in-process cache: every answer the service gave, keyed by ``(device.key, problem.key)``
   (and, in front of it, by the very objects, so that a repeated trace-time lookup costs a
   dictionary probe: about a microsecond);
2. the service (``POST /v1/lookup`` / ``/v1/lookup/batch``), unless it failed less than
   ``retry_after`` seconds ago;
3. the on-disk cache (``cache_dir``), written with every service answer: what a process that
   cannot reach the service still knows;
4. the baseline (``source="default"``).

``Client(offline="snapshot.json")`` never touches the network: it answers from a snapshot
exported from the service (``GET /v1/snapshot``, :meth:`Client.export_snapshot`, or
``autotuner snapshot``), else the baseline. When the service cannot be reached the client logs
ONE warning (per outage, not per call) and falls back as above.

``LookupResult.origin`` says which of these answered: ``service``, ``memory``, ``disk``,
``snapshot`` or ``fallback``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from autotuner import snapshot
from autotuner.device import Device
from autotuner.errors import AutotunerError
from autotuner.problem import GroupedProblem, Problem, problem_from_dict
from autotuner.strategy import Strategy, StrategyError

__all__ = ["Client", "ClientError", "LookupResult", "default_client", "load_snapshot"]

log = logging.getLogger("autotuner.runtime.client")

SOURCES = ("tuned", "nearest", "model", "default")
BATCH = 500  # problems per POST /v1/lookup/batch (the service accepts up to AUTOTUNER_MAX_BATCH)


class ClientError(AutotunerError, RuntimeError):
    """A failed request to the service, or an unusable snapshot file."""


class _Refused(ClientError):
    """The service answered 4xx: asking again will not help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The strategy to use for one problem on one device (see the service's ``Lookup``); its
    JSON carries a snapshot entry's fields in their form (:mod:`autotuner.snapshot`)."""

    strategy: Strategy
    source: str                              # tuned | nearest | model | default
    speedup: float | None
    confidence: tuple[float, float] | None
    record_id: int | None
    measured_at: datetime | None
    problem_key: str
    device_key: str
    origin: str = "service"                  # service | memory | disk | snapshot | fallback
    distance: float | None = None
    neighbor_key: str | None = None
    trials: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any], origin: str) -> LookupResult:
        return cls(strategy=Strategy.from_dict(d["strategy"]), source=str(d.get("source", "tuned")),
                   speedup=d.get("speedup"), confidence=snapshot.confidence_of(d.get("confidence")),
                   record_id=d.get("record_id"), measured_at=snapshot.time_of(d.get("measured_at")),
                   problem_key=str(d["problem_key"]), device_key=str(d["device_key"]),
                   origin=str(d.get("origin", origin)),
                   distance=d.get("distance"), neighbor_key=d.get("neighbor_key"), trials=d.get("trials"))

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy.to_dict(), "source": self.source, "speedup": self.speedup,
                "confidence": list(self.confidence) if self.confidence else None,
                "record_id": self.record_id, "measured_at": snapshot.time_json(self.measured_at),
                "problem_key": self.problem_key, "device_key": self.device_key,
                "distance": self.distance, "neighbor_key": self.neighbor_key, "trials": self.trials}

    @classmethod
    def baseline(cls, problem_key: str, device_key: str) -> LookupResult:
        return cls(strategy=Strategy.baseline(), source="default", speedup=1.0, confidence=None,
                   record_id=None, measured_at=None, problem_key=problem_key, device_key=device_key,
                   origin="fallback")


def load_snapshot(path: str | os.PathLike[str]) -> dict[tuple[str, str], LookupResult]:
    """The answers of a snapshot file (``GET /v1/snapshot``), by (device key, problem key)."""
    try:
        doc = snapshot.load(path)
    except snapshot.SnapshotError as e:
        raise ClientError(str(e)) from None
    out = {}
    for i, e in enumerate(doc.get("entries", [])):
        try:
            r = LookupResult.from_json({**e, "source": "tuned"}, "snapshot")
        except (KeyError, TypeError, ValueError, StrategyError) as err:
            raise ClientError(f"{path}: entries[{i}] is invalid: {err}") from None
        out[(r.device_key, r.problem_key)] = r
    return out


class _DiskCache:
    """One JSON-lines file per device under ``root``; later lines win; bad lines are skipped."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._loaded: dict[str, dict[str, LookupResult]] = {}
        self._lock = threading.Lock()

    def _path(self, device_key: str) -> Path:
        return self.root / f"lookups-{device_key}.jsonl"

    def _device(self, device_key: str) -> dict[str, LookupResult]:
        table = self._loaded.get(device_key)
        if table is not None:
            return table
        table = {}
        try:
            with self._path(device_key).open() as f:
                for line in f:
                    try:
                        r = LookupResult.from_json(json.loads(line), "disk")
                    except (KeyError, TypeError, ValueError, StrategyError):
                        continue
                    table[r.problem_key] = r
        except OSError:
            pass
        self._loaded[device_key] = table
        return table

    def get(self, device_key: str, problem_key: str) -> LookupResult | None:
        with self._lock:
            return self._device(device_key).get(problem_key)

    def put(self, results: Iterable[LookupResult]) -> None:
        by_device: dict[str, list[LookupResult]] = {}
        for r in results:
            by_device.setdefault(r.device_key, []).append(r)
        with self._lock:
            for dkey, rs in by_device.items():
                table = self._device(dkey)
                new = [r for r in rs if table.get(r.problem_key) != replace(r, origin="disk")]
                if not new:
                    continue
                try:
                    self.root.mkdir(parents=True, exist_ok=True)
                    with self._path(dkey).open("a") as f:  # one write of whole lines
                        f.write("".join(json.dumps(r.to_json()) + "\n" for r in new))
                except OSError as e:
                    log.warning("cannot write the lookup cache %s: %s", self._path(dkey), e)
                    return
                for r in new:
                    table[r.problem_key] = replace(r, origin="disk")


class Client:
    """Looks up the strategy to use per (problem, device); see the module docs for the order.

    ``url``: the service (e.g. ``http://127.0.0.1:8000``); ``token``: a bearer token (needed
    when the service closes reads, and for :meth:`export_snapshot` likewise); ``timeout``:
    seconds per request; ``cache_dir``: where the on-disk cache lives (none by default);
    ``offline``: a snapshot file to answer from instead of the service; ``retry_after``:
    seconds to skip the service after it failed; ``device``: the fingerprint
    :func:`autotuner.collective_einsum` uses (default ``Device.current(topology)``).
    Thread-safe.
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 2.0,
                 cache_dir: str | os.PathLike[str] | None = None,
                 offline: str | os.PathLike[str] | None = None, *, retry_after: float = 30.0,
                 device: Device | None = None, topology: str | None = None) -> None:
        if url is None and offline is None:
            raise ValueError("Client needs a service url, or offline=SNAPSHOT_FILE")
        self.url = url.rstrip("/") if url else None
        self.timeout = timeout
        self.retry_after = retry_after
        self.topology = topology
        self._device = device
        self._token = token
        self._memo: dict[tuple[Device, Problem], LookupResult] = {}   # by object: the fast path
        self._cache: dict[tuple[str, str], LookupResult] = {}          # by (device key, problem key)
        self._keys: dict[Problem | Device, str] = {}
        self._disk = _DiskCache(Path(cache_dir)) if cache_dir is not None else None
        self._snapshot = load_snapshot(offline) if offline is not None else None
        self.offline = offline
        self._http: httpx.Client | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._warned: set[str] = set()

    def __repr__(self) -> str:  # the token never shows
        where = f"offline={str(self.offline)!r}" if self.offline is not None else repr(self.url)
        return f"Client({where})"

    # -- the fast path -------------------------------------------------------------------------
    def lookup(self, problem: Problem, device: Device | None = None) -> LookupResult:
        """The strategy for ``problem`` on ``device`` (default: :attr:`device`); never raises
        for an unreachable service (falls back as the module docs say)."""
        if device is None:
            device = self.device
        try:
            hit = self._memo.get((device, problem))
        except TypeError:  # a dict, not a Problem
            hit = None
        if hit is not None:
            return hit
        return self.lookup_batch([problem], device)[0]

    def lookup_batch(self, problems: Sequence[Problem], device: Device | None = None) -> list[LookupResult]:
        """:meth:`lookup` for many problems at once: cache hits locally, the rest in batches of
        :data:`BATCH` per request."""
        if device is None:
            device = self.device
        problems = [p if isinstance(p, (Problem, GroupedProblem)) else problem_from_dict(p) for p in problems]
        out: list[LookupResult | None] = [self._memo.get((device, p)) for p in problems]
        todo = [i for i, r in enumerate(out) if r is None]
        if not todo:
            return out  # type: ignore[return-value]
        dkey = self._key(device)
        ask: dict[str, Problem] = {}
        for i in todo:
            p = problems[i]
            pkey = self._key(p)
            hit = self._cache.get((dkey, pkey))
            if hit is not None:
                out[i] = hit
                self._memo[(device, p)] = hit
            else:
                ask.setdefault(pkey, p)
        if ask:
            answers = self._resolve(device, dkey, ask)
            for i in todo:
                if out[i] is None:
                    out[i] = answers[self._key(problems[i])]
        return out  # type: ignore[return-value]

    # -- the slow path -------------------------------------------------------------------------
    @property
    def device(self) -> Device:
        """The fingerprint of this process's devices (imports JAX), unless given."""
        if self._device is None:
            self._device = Device.current(self.topology)
        return self._device

    def _key(self, obj: Problem | Device) -> str:
        key = self._keys.get(obj)
        if key is None:
            key = obj.key
            if len(self._keys) > 100_000:
                self._keys.clear()
            self._keys[obj] = key
        return key

    def _remember(self, device: Device, problems: dict[str, Problem], results: Iterable[LookupResult]) -> None:
        if len(self._memo) > 200_000:  # a bound, far above any program's distinct einsums
            self._memo.clear()
            self._cache.clear()
        for r in results:
            cached = replace(r, origin="memory")
            self._cache[(r.device_key, r.problem_key)] = cached
            p = problems.get(r.problem_key)
            if p is not None:
                self._memo[(device, p)] = cached

    def _resolve(self, device: Device, dkey: str, ask: dict[str, Problem]) -> dict[str, LookupResult]:
        answers: dict[str, LookupResult] = {}
        if self._snapshot is not None:
            for pkey in ask:
                hit = self._snapshot.get((dkey, pkey))
                answers[pkey] = hit if hit is not None else LookupResult.baseline(pkey, dkey)
            self._remember(device, ask, answers.values())
            return answers
        got = self._ask_service(device, dkey, ask)
        if got is not None:
            self._remember(device, ask, got.values())
            if self._disk is not None:
                self._disk.put(r for r in got.values() if r.origin == "service")
            return got
        # the service is down: the disk cache, then the baseline (not remembered: ask again later)
        for pkey in ask:
            hit = self._disk.get(dkey, pkey) if self._disk is not None else None
            answers[pkey] = hit if hit is not None else LookupResult.baseline(pkey, dkey)
        return answers

    def _client(self) -> httpx.Client:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            self._http = httpx.Client(base_url=self.url or "", timeout=self.timeout, headers=headers,
                                      trust_env=False)
        return self._http

    def _ask_service(self, device: Device, dkey: str, ask: dict[str, Problem]) -> dict[str, LookupResult] | None:
        """The service's answers; None (and one warning) when it cannot be reached or fails.

        A refusal (4xx: e.g. a problem this service version rejects, or a missing read token)
        is final for those problems: they get the baseline, remembered like an answer."""
        if time.monotonic() < self._down_until:
            return None
        keys = list(ask)
        out: dict[str, LookupResult] = {}
        try:
            with self._lock:
                http = self._client()
                for lo in range(0, len(keys), BATCH):
                    chunk = keys[lo:lo + BATCH]
                    docs = self._fetch(http, device, dkey, chunk, ask)
                    for k, doc in zip(chunk, docs, strict=True):
                        r = LookupResult.from_json(doc, "service")
                        out[k] = replace(r, problem_key=k, device_key=dkey) if r.problem_key != k else r
        except (httpx.HTTPError, ClientError, KeyError, TypeError, ValueError, StrategyError) as e:
            self._down_until = time.monotonic() + self.retry_after
            self._warn_once("down", f"autotuner service {self.url} cannot answer ({type(e).__name__}: {e}); "
                            f"using cached strategies, else the baseline; retrying every "
                            f"{self.retry_after:g}s")
            return None
        if "down" in self._warned:
            self._warned.discard("down")
            log.info("autotuner service %s answers again", self.url)
        return out

    def _fetch(self, http: httpx.Client, device: Device, dkey: str, chunk: list[str],
               ask: dict[str, Problem]) -> list[Any]:
        """The service's answers for ``chunk``. A refused batch (413/422: too large for this
        service, or one problem it rejects) is split in halves until the refused problems are
        alone; those, and everything on a 401/403, get the baseline."""
        try:
            return self._post_chunk(http, device, [ask[k] for k in chunk])
        except _Refused as e:
            if len(chunk) > 1 and e.status in (413, 422):
                mid = len(chunk) // 2
                return (self._fetch(http, device, dkey, chunk[:mid], ask)
                        + self._fetch(http, device, dkey, chunk[mid:], ask))
            self._warn_once("refused", f"autotuner service {self.url} refused a lookup ({e}); "
                                       "using the baseline for it")
            return [{**LookupResult.baseline(k, dkey).to_json(), "origin": "fallback"} for k in chunk]

    def _warn_once(self, kind: str, message: str) -> None:
        """One warning per kind (``down``: per outage; ``refused``: per client)."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", message)

    @staticmethod
    def _post_chunk(http: httpx.Client, device: Device, problems: list[Problem]) -> list[Any]:
        if len(problems) == 1:
            path, body = "/v1/lookup", {"device": device.to_dict(), "problem": problems[0].to_dict()}
        else:
            path = "/v1/lookup/batch"
            body = {"device": device.to_dict(), "problems": [p.to_dict() for p in problems]}
        resp = http.post(path, json=body)
        if 400 <= resp.status_code < 500:
            raise _Refused(resp.status_code, f"POST {path}: {resp.status_code} {resp.text[:200]}")
        if resp.status_code != 200:
            raise ClientError(f"POST {path} answered {resp.status_code}: {resp.text[:200]}")
        doc = resp.json()
        docs = [doc] if len(problems) == 1 else doc["results"]
        if len(docs) != len(problems):
            raise ClientError(f"the service answered {len(docs)} results for {len(problems)} problems")
        return docs

    # -- the rest ------------------------------------------------------------------------------
    def export_snapshot(self, path: str | os.PathLike[str], device: Device | None = None, *,
                        all_devices: bool = False) -> int:
        """Write the service's snapshot (of ``device``, or every device) to ``path``
        atomically; returns the number of entries. Raises :class:`ClientError`."""
        if self.url is None:
            raise ClientError("export_snapshot needs a service url")
        params = {} if all_devices else {"device_key": self._key(device or self.device)}
        try:
            resp = self._client().get("/v1/snapshot", params=params, timeout=max(self.timeout, 60.0))
        except httpx.HTTPError as e:
            raise ClientError(f"GET /v1/snapshot failed: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise ClientError(f"GET /v1/snapshot answered {resp.status_code}: {resp.text[:300]}")
        doc = resp.json()
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, target)
        return len(doc.get("entries", []))

    def clear_cache(self) -> None:
        """Forget the in-process cache (the on-disk cache stays)."""
        self._memo.clear()
        self._cache.clear()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: Client | None = None
_default_lock = threading.Lock()


def default_client() -> Client | None:
    """The client ``AUTOTUNER_SERVICE_URL`` / ``AUTOTUNER_SERVICE_TOKEN`` configure (settings),
    built once; ``None`` when no service is configured."""
    global _default
    with _default_lock:
        if _default is None:
            from autotuner.settings import get_settings

            settings = get_settings()
            if not settings.service_url:
                return None
            _default = Client(settings.service_url, token=settings.service_token)
        return _default
