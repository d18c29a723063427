"""Load benchmark of the lookup service: lookups/s and latency percentiles.

    python bench/load.py [--db /tmp/bench.db --db postgresql+psycopg://...] [--fill 100000]
    python bench/load.py --db /tmp/bench.db --anonymous-flood 4 --rate 200 --seconds 5

Without ``--db``: SQLite (``/tmp/autotuner-bench/bench.db``) and PostgreSQL (started and
prepared as the tests do it, by ``scripts/ci_services.sh``, database ``autotuner_bench``), one
after the other, and at the end the summary table of issue 16 with both. For each database: fill it to ``--fill`` tuned problems if it has fewer (``bench/fill_db.py``),
start ``uvicorn service.app:app`` on 127.0.0.1 (``--workers``, access log off), then measure

- single lookups of tuned problems (drawn uniformly from all of them, so the service's
  short-lived answer cache rarely helps) flat out with ``--concurrency`` requests in flight;
- single lookups at a fixed offered rate (``--rate``, default 1000/s; open loop: latency is
  counted from when a request was due, so a server falling behind shows in the percentiles);
- the same two over a hot set of ``--hot`` (1000) problems, the working set of a few models
  being compiled again and again: mostly answered from the service's answer cache
  (``AUTOTUNER_LOOKUP_CACHE_SECONDS``);
- batch lookups of ``--batch`` (500) tuned problems, one at a time, each batch new (disjoint
  batches over all the tuned problems, so none is answered from the answer cache);
- single lookups of problems that were never tuned (nearest tuned shape or cost model, and
  demand), flat out, each problem new to the server at first: after a warm-up on other
  untuned problems of the same groups, so the in-memory nearest index is read;
- the client's in-process cache hit (`autotuner.runtime.client.Client.lookup`), in this process.

These requests carry a token (the server is started with ``AUTOTUNER_WRITE_TOKENS``), so the
limits on anonymous lookups (``service/ratelimit.py``) never apply to them.
``--anonymous-flood N`` measures those limits instead: single lookups with the token at
``--rate`` offered, for ``--seconds`` alone and then beside ``N`` anonymous batch lookups per
second (``--batch`` untuned problems each, so every admitted one costs the cost model's CPU),
and alone again, and prints the valid requests' percentiles side by side with the anonymous ones' 200s and 429s
(the limits are the server's: set ``AUTOTUNER_ANON_*`` in the environment to change them).

The load generator runs in this process (one core's worth at most) on the same 2-core machine
as the server: it competes with the server for CPU. ``--client raw`` (default) writes
pre-encoded HTTP/1.1 requests on keep-alive sockets and parses the status line of each reply,
which costs the machine little per request, so the figures are the server's; ``--client httpx``
uses httpx.AsyncClient with a bounded pool, a real Python client, whose own cost is the limit here:
with httpx 0.29 on this 2-core machine it sent 562-670 lookups/s flat out while the server spent
494-1043 us of CPU per lookup, and at 1000/s offered it fell behind (half the requests dropped,
p99 2.0-2.1 s), where the raw client measured 4992-6516 lookups/s and p99 2.1-5.1 ms against the
same server (docs/service.md). Every request's status is checked; any non-200 is counted as an error.
The last column is the CPU time the server's processes spent per lookup during the phase
(from /proc): what a lookup costs the server whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fill_db  # noqa: E402

from service.testing import HOST, free_port, start_server, stop_server  # noqa: E402


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    dropped: int = 0
    seconds: float = 0.0
    items: int = 1  # problems per request
    server_cpu_s: float = 0.0  # CPU time the server's processes used during the phase
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)

    def failed(self, reason: str) -> None:
        self.errors += 1
        self.reasons[reason] += 1

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")

        n = len(lat)
        return {"phase": self.name, "requests": n, "errors": self.errors, "dropped": self.dropped,
                "req_per_s": n / self.seconds if self.seconds else 0.0,
                "lookups_per_s": n * self.items / self.seconds if self.seconds else 0.0,
                "p50_ms": pct(0.50), "p90_ms": pct(0.90), "p99_ms": pct(0.99),
                "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
                "server_cpu_us_per_lookup": self.server_cpu_s / (n * self.items) * 1e6 if n else float("nan")}


def group_cpu_seconds(pgid: int) -> float:
    """user + system CPU seconds of every live process in process group ``pgid`` (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state ppid pgrp ... utime stime
            total += int(fields[11]) + int(fields[12])
    return total / tick


# -- transports --------------------------------------------------------------------------------

Send = Callable[[bytes, str], Awaitable[int]]


class RawPool:
    """Keep-alive HTTP/1.1 connections; one request at a time per connection."""

    def __init__(self, port: int, size: int, token: str | None = None) -> None:
        self.port, self.size = port, size
        self.auth = b"Authorization: Bearer %s\r\n" % token.encode() if token else b""
        self.free: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def open(self) -> None:
        for _ in range(self.size):
            self.free.put_nowait(await asyncio.open_connection(HOST, self.port))

    async def close(self) -> None:
        while not self.free.empty():
            _, w = self.free.get_nowait()
            w.close()

    async def _roundtrip(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes,
                         path: str) -> int:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), HOST.encode(), self.auth, len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)
        return status

    async def send(self, body: bytes, path: str) -> int:
        reader, writer = await self.free.get()
        try:
            try:
                status = await self._roundtrip(reader, writer, body, path)
            except (asyncio.IncompleteReadError, ConnectionError):
                # the server closed an idle keep-alive connection: a new one, once (as clients do)
                writer.close()
                reader, writer = await asyncio.open_connection(HOST, self.port)
                status = await self._roundtrip(reader, writer, body, path)
        except Exception:
            writer.close()
            self.free.put_nowait(await asyncio.open_connection(HOST, self.port))
            raise
        self.free.put_nowait((reader, writer))
        return status


class HttpxPool:
    def __init__(self, port: int, size: int, token: str | None = None) -> None:
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.client = httpx.AsyncClient(base_url=f"http://{HOST}:{port}", limits=limits, timeout=30.0,
                                        trust_env=False, headers=headers)

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.client.aclose()

    async def send(self, body: bytes, path: str) -> int:
        r = await self.client.post(path, content=body, headers={"content-type": "application/json"})
        return r.status_code


# -- load shapes -------------------------------------------------------------------------------

async def closed_loop(pool: Any, bodies: list[bytes], path: str, seconds: float, concurrency: int,
                      phase: Phase, *, in_order: bool = False) -> None:
    """``concurrency`` requests in flight for ``seconds``: random bodies, or each in turn."""
    stop = time.perf_counter() + seconds
    rng = random.Random(1)
    turn = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() < stop:
            body = bodies[next(turn) % len(bodies)] if in_order else bodies[rng.randrange(len(bodies))]
            t = time.perf_counter()
            try:
                status = await pool.send(body, path)
            except Exception as e:  # noqa: BLE001 - counted
                phase.failed(type(e).__name__)
                continue
            phase.latencies.append(time.perf_counter() - t)
            if status != 200:
                phase.failed(f"HTTP {status}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.seconds = time.perf_counter() - t0


async def open_loop(pool: Any, bodies: list[bytes], path: str, seconds: float, rate: float,
                    bound: int, phase: Phase) -> None:
    """Requests due every 1/rate s; at most ``bound`` in flight (more are dropped, counted)."""
    rng = random.Random(2)
    inflight: set[asyncio.Task[None]] = set()

    async def one(due: float) -> None:
        try:
            status = await pool.send(bodies[rng.randrange(len(bodies))], path)
        except Exception as e:  # noqa: BLE001 - counted
            phase.failed(type(e).__name__)
            return
        phase.latencies.append(time.perf_counter() - due)
        if status != 200:
            phase.failed(f"HTTP {status}")

    t0 = time.perf_counter()
    n_total = int(seconds * rate)
    i = 0
    while i < n_total:
        now = time.perf_counter()
        while i < n_total and t0 + i / rate <= now:
            if len(inflight) >= bound:
                phase.dropped += 1
            else:
                task = asyncio.ensure_future(one(t0 + i / rate))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
    await asyncio.gather(*inflight)
    phase.seconds = time.perf_counter() - t0


# -- one database --------------------------------------------------------------------------------

def bodies_for(problems: list[Any], device: dict[str, Any]) -> list[bytes]:
    return [json.dumps({"device": device, "problem": p.to_dict()}).encode() for p in problems]


BENCH_TOKEN = "load-benchmark-token"  # the valid requests' token (AUTOTUNER_WRITE_TOKENS of the server)
SERVER_ENV = {"AUTOTUNER_WRITE_TOKENS": BENCH_TOKEN}


def prepare(url: str, args: argparse.Namespace) -> tuple[str, Any, list[Any], list[Any]]:
    """Fill the database to ``args.fill`` tuned problems: (dialect, device, tuned, 2000 untuned)."""
    from db import Database
    from db import repository as repo

    database = Database(url)
    database.upgrade()  # a benchmark database: migrate it to this code's schema
    with database.session(read_only=True) as s:
        have = repo.list_problems(s, device_key=fill_db.bench_device().key, limit=1).total
    if have < args.fill:
        print(f"[{database.dialect}] filling to {args.fill} tuned problems ...", file=sys.stderr)
        t = time.perf_counter()
        fill_db.fill(database, args.fill)
        print(f"[{database.dialect}] filled in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    dialect = database.dialect
    database.dispose()

    device = fill_db.bench_device()
    tuned = list(fill_db.problems(args.fill))
    tuned_keys = {p.key for p in tuned}
    untuned = [p for p in fill_db.problems(3000, seed=987654) if p.key not in tuned_keys][:2000]
    return dialect, device, tuned, untuned


def run_db(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    dialect, device, tuned, untuned = prepare(url, args)
    single = bodies_for(tuned, device.to_dict())
    misses = bodies_for(untuned[:1000], device.to_dict())
    misses_warm = bodies_for(untuned[1000:], device.to_dict())
    # disjoint batches over every tuned problem, in a random order: each batch is answered from
    # the database, not from the service's answer cache
    order = list(tuned)
    random.Random(3).shuffle(order)
    batches = [json.dumps({"device": device.to_dict(),
                           "problems": [p.to_dict() for p in order[lo:lo + args.batch]]}).encode()
               for lo in range(0, len(order) - args.batch + 1, args.batch)]

    port = free_port()
    proc, _ = start_server(url, port=port, workers=args.workers, env=SERVER_ENV)
    time.sleep(0.5 * args.workers)  # let every worker finish starting
    rows = []
    try:
        async def main() -> None:
            pool_cls = RawPool if args.client == "raw" else HttpxPool
            pool = pool_cls(port, args.concurrency, BENCH_TOKEN)
            await pool.open()
            try:
                def measured(phase: Phase, run: Awaitable[None]) -> Awaitable[None]:
                    return measured_cpu(proc.pid, phase, run)

                warm = Phase("warm-up")
                await closed_loop(pool, single, "/v1/lookup", 2.0, args.concurrency, warm)
                flat = Phase("single, flat out")
                await measured(flat, closed_loop(pool, single, "/v1/lookup", args.seconds, args.concurrency, flat))
                fixed = Phase(f"single, {args.rate:g}/s offered")
                await measured(fixed, open_loop(pool, single, "/v1/lookup", args.seconds, args.rate, 256, fixed))
                hot = single[:args.hot]
                await closed_loop(pool, hot, "/v1/lookup", 1.5, args.concurrency, Phase("warm-up hot"))
                hot_flat = Phase(f"single, hot set of {args.hot}, flat out")
                await measured(hot_flat, closed_loop(pool, hot, "/v1/lookup", args.seconds, args.concurrency,
                                                     hot_flat))
                hot_fixed = Phase(f"single, hot set, {args.rate:g}/s offered")
                await measured(hot_fixed, open_loop(pool, hot, "/v1/lookup", args.seconds, args.rate, 256,
                                                    hot_fixed))
                batch = Phase(f"batch of {args.batch}", items=args.batch)
                await measured(batch, closed_loop(pool, batches, "/v1/lookup/batch", args.seconds, 1, batch,
                                                  in_order=True))
                await closed_loop(pool, misses_warm, "/v1/lookup", 2.0, args.concurrency,
                                  Phase("warm-up untuned"))
                miss = Phase("single untuned (nearest+demand)")
                await measured(miss, closed_loop(pool, misses, "/v1/lookup", min(args.seconds, 3.0),
                                                 args.concurrency, miss))
                for ph in (flat, fixed, hot_flat, hot_fixed, batch, miss):
                    rows.append({"db": dialect, **ph.row()})
                    if ph.reasons:
                        print(f"[{dialect}] {ph.name}: errors {dict(ph.reasons)}", file=sys.stderr)
            finally:
                await pool.close()

        asyncio.run(main())
        rows.append({"db": dialect, **client_hit(port, device, tuned[0])})
    finally:
        stop_server(proc)
    return rows


def client_hit(port: int, device: Any, problem: Any) -> dict[str, Any]:
    """The in-process cache hit of autotuner.runtime.client.Client.lookup (median of 5 x 100k calls)."""
    from autotuner.runtime.client import Client

    with Client(f"http://{HOST}:{port}", timeout=5.0, token=BENCH_TOKEN) as client:
        t = time.perf_counter()
        first = client.lookup(problem, device)
        first_ms = (time.perf_counter() - t) * 1e3
        assert first.origin == "service" and first.source == "tuned", first
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(100_000):
                client.lookup(problem, device)
            runs.append((time.perf_counter() - t) / 100_000)
    hit_us = statistics.median(runs) * 1e6
    return {"phase": f"client cache hit (first call {first_ms:.1f} ms)", "requests": 500_000, "errors": 0,
            "dropped": 0, "req_per_s": 1e6 / hit_us, "lookups_per_s": 1e6 / hit_us,
            "p50_ms": hit_us / 1e3, "p90_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": hit_us / 1e3,
            "server_cpu_us_per_lookup": 0.0}


def run_flood(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Valid single lookups (with the token) at ``args.rate`` offered, alone and then beside
    ``args.anonymous_flood`` anonymous batch lookups per second: a row per phase, with the
    anonymous requests' statuses."""
    dialect, device, tuned, _ = prepare(url, args)
    single = bodies_for(tuned, device.to_dict())
    # distinct batches of untuned problems, so that an admitted one is not answered from the cache
    n_batches = max(1, min(40, int(args.anonymous_flood * args.seconds) + 1))
    tuned_keys = {p.key for p in tuned}
    flood_problems = [p for p in fill_db.problems(n_batches * args.batch + 1000, seed=424242)
                      if p.key not in tuned_keys][:n_batches * args.batch]
    batches = [json.dumps({"device": device.to_dict(),
                           "problems": [p.to_dict() for p in flood_problems[lo:lo + args.batch]]}).encode()
               for lo in range(0, len(flood_problems), args.batch)]
    port = free_port()
    proc, _ = start_server(url, port=port, workers=args.workers, env=SERVER_ENV)
    time.sleep(0.5 * args.workers)
    rows = []
    try:
        async def main() -> None:
            pool_cls = RawPool if args.client == "raw" else HttpxPool
            valid_pool, flood_pool = pool_cls(port, args.concurrency, BENCH_TOKEN), pool_cls(port, 8)
            await valid_pool.open()
            await flood_pool.open()
            try:
                await closed_loop(valid_pool, single, "/v1/lookup", 1.0, args.concurrency, Phase("warm-up"))
                # alone, beside, alone again: the machine's drift (and a server still warming up:
                # the nearest index is read in the background) shows as two different "alone" rows
                for name, flood_rate in (("valid, alone", 0.0), ("valid, beside the anonymous flood",
                                                                 args.anonymous_flood),
                                         ("valid, alone again", 0.0)):
                    valid, anon = Phase(name), Phase("anonymous", items=args.batch)
                    load = open_loop(valid_pool, single, "/v1/lookup", args.seconds, args.rate, 256, valid)
                    if flood_rate:
                        flood = open_loop(flood_pool, batches, "/v1/lookup/batch", args.seconds, flood_rate,
                                          8, anon)
                        await asyncio.gather(measured_cpu(proc.pid, valid, load), flood)
                    else:
                        await measured_cpu(proc.pid, valid, load)
                    sent = len(anon.latencies)  # answered, whatever the status
                    refused = sum(n for reason, n in anon.reasons.items() if reason.startswith("HTTP "))
                    limited = anon.reasons.get("HTTP 429", 0)
                    rows.append({"db": dialect, **valid.row(), "anonymous_sent": sent,
                                 "anonymous_200": sent - refused, "anonymous_429": limited,
                                 "anonymous_other": anon.errors - limited, "anonymous_dropped": anon.dropped})
                    if valid.reasons:
                        print(f"[{dialect}] {name}: errors {dict(valid.reasons)}", file=sys.stderr)
            finally:
                await valid_pool.close()
                await flood_pool.close()

        asyncio.run(main())
    finally:
        stop_server(proc)
    return rows


async def measured_cpu(pgid: int, phase: Phase, run: Awaitable[None]) -> None:
    """Await ``run``, counting the CPU time of process group ``pgid`` meanwhile into ``phase``."""
    before = group_cpu_seconds(pgid)
    await run
    phase.server_cpu_s = group_cpu_seconds(pgid) - before


def flood_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (f"{'db':10} {'phase':36} {'valid':>6} {'err':>4} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'anon sent':>9} {'anon 200':>8} {'anon 429':>8} {'anon other':>10}")
    from autotuner.settings import Settings

    limits = Settings()  # what the server read from the same environment
    lines = [f"valid: single lookups with a token at {args.rate:g}/s offered; anonymous: "
             f"{args.anonymous_flood:g} batches of {args.batch} untuned problems per second",
             f"the server's limits per worker: {limits.anon_lookup_rate:g} problems/s per address, bursts of "
             f"{limits.anon_lookup_burst}, {limits.anon_batch_concurrency} anonymous batches at once "
             "(AUTOTUNER_ANON_*; 0: none)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['db']:10} {r['phase']:36} {r['requests']:>6} {r['errors']:>4} {r['p50_ms']:>8.2f} "
                     f"{r['p99_ms']:>8.2f} {r['anonymous_sent']:>9} {r['anonymous_200']:>8} "
                     f"{r['anonymous_429']:>8} {r['anonymous_other']:>10}")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'db':10} {'phase':42} {'requests':>8} {'err':>4} {'drop':>4} {'lookups/s':>10} " \
           f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'srv CPU us/lookup':>18}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['db']:10} {r['phase']:42} {r['requests']:>8} {r['errors']:>4} {r['dropped']:>4} "
                     f"{r['lookups_per_s']:>10.0f} {r['p50_ms']:>8.3f} {r['p90_ms']:>8.3f} {r['p99_ms']:>8.3f} "
                     f"{r['server_cpu_us_per_lookup']:>18.0f}")
    return "\n".join(lines)


BENCH_SQLITE = "/tmp/autotuner-bench/bench.db"
ROOT = Path(__file__).resolve().parent.parent


def postgres_url() -> str:
    """A PostgreSQL database for the benchmark: started and created by scripts/ci_services.sh
    (as for the tests), database ``autotuner_bench``."""
    env = {**os.environ, "AUTOTUNER_CI_PG_DB": "autotuner_bench"}
    done = subprocess.run(["bash", "-c", 'source scripts/ci_services.sh && printf %s "$AUTOTUNER_TEST_PG_URL"'],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.startswith("postgresql"):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"load.py: could not start PostgreSQL with scripts/ci_services.sh ({tail}); "
                         "pass --db URL for each database to use instead")
    return done.stdout


def summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Issue 16's table (markdown), one column per database."""
    fixed, batch = f"single, {args.rate:g}/s offered", f"batch of {args.batch}"
    figures = [  # (figure, target, how it is read from one database's phases)
        ("single lookups/s, flat out", ">= 4000",
         lambda r: f"{r['single, flat out']['lookups_per_s']:.0f}"),
        (f"p99 at an offered {args.rate:g}/s", "<= 10 ms", lambda r: f"{r[fixed]['p99_ms']:.1f} ms"),
        (f"batch of {args.batch}: p50 / p99", "<= 30 / 100 ms",
         lambda r: f"{r[batch]['p50_ms']:.0f} / {r[batch]['p99_ms']:.0f} ms"),
        ("untuned (fallback) lookups/s", ">= 1000",
         lambda r: f"{r['single untuned (nearest+demand)']['lookups_per_s']:.0f}"),
        ("client cache hit (in-process)", "<= 20 us",
         lambda r: f"{next(v for k, v in r.items() if k.startswith('client'))['p50_ms'] * 1e3:.1f} us"),
        ("server CPU per uncached single lookup", "(none)",
         lambda r: f"{r['single, flat out']['server_cpu_us_per_lookup']:.0f} us"),
    ]
    by_db: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_db.setdefault(r["db"], {})[r["phase"]] = r
    lines = ["| figure | target | " + " | ".join(by_db) + " |", "|---|---|" + "---|" * len(by_db)]
    for figure, target, read in figures:
        cells = []
        for phases in by_db.values():
            try:
                cells.append(read(phases))
            except (KeyError, StopIteration):
                cells.append("-")
        lines.append(f"| {figure} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", action="append",
                    help="database URL or SQLite file; repeat for several (default: SQLite "
                         f"{BENCH_SQLITE} and PostgreSQL via scripts/ci_services.sh)")
    ap.add_argument("--fill", type=int, default=100_000, help="tuned problems the database must hold")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each phase")
    ap.add_argument("--rate", type=float, default=1000.0, help="offered rate of the fixed-rate phase")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (flat out)")
    ap.add_argument("--batch", type=int, default=500, help="problems per batch lookup")
    ap.add_argument("--hot", type=int, default=1000,
                    help="distinct problems of the hot-set phases (a compiler's working set)")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw")
    ap.add_argument("--anonymous-flood", type=float, default=0.0, metavar="N",
                    help="instead of the phases above: valid lookups at --rate alone, then beside N "
                         "anonymous batch lookups per second (--batch untuned problems each)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = ap.parse_args(argv)

    if not args.db:
        Path(BENCH_SQLITE).parent.mkdir(parents=True, exist_ok=True)
        args.db = [BENCH_SQLITE, postgres_url()]
    rows = []
    load_before = os.getloadavg()
    if args.anonymous_flood:
        for url in args.db:
            rows += run_flood(url, args)
        print(f"machine load average (1 min) before / after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}")
        print(flood_table(rows, args))
        if args.json:
            for r in rows:
                print(json.dumps(r))
        return 0
    for url in args.db:
        rows += run_db(url, args)
    print(f"machine load average (1 min) before / after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} "
          "(anything above ~0 means other processes competed for the 2 cores)")
    print(f"load benchmark: {args.workers} uvicorn workers, {os.cpu_count()} CPUs, client {args.client}, "
          f"{args.concurrency} in flight, {args.seconds:g} s per phase, {args.fill} tuned problems")
    print(table(rows))
    print()
    print(summary(rows, args))
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
