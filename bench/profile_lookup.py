"""Profile the lookup path of the running service with py-spy (every thread, no restart).

    python bench/profile_lookup.py --db /tmp/bench.db [--seconds 10] [--kind single|batch|untuned]

Starts ``uvicorn service.app:app`` (one worker) on a database ``bench/fill_db.py`` filled with
100k tuned problems (fill it first, e.g. with ``bench/load.py``), loads it with ``bench/load.py``'s
raw keep-alive client (16 in flight: single lookups of tuned problems, batches of 500 of them, or
single lookups of untuned problems) and samples the server with ``py-spy record`` meanwhile
(``pip install py-spy``). Prints the lookups/s the client saw and the functions where the
server's on-CPU samples fall: by own time (the frame on top) and by total time (anywhere on the
stack), each as a share of all samples.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fill_db  # noqa: E402
from load import Phase, RawPool, bodies_for, closed_loop  # noqa: E402

from autotuner.settings import normalize_db_url  # noqa: E402
from service.testing import free_port, start_server, stop_server  # noqa: E402


def workload(kind: str) -> tuple[list[bytes], str, int, int]:
    """(bodies, path, in flight, problems per request)."""
    device = fill_db.bench_device().to_dict()
    tuned = list(fill_db.problems(100_000))
    if kind == "single":
        return bodies_for(tuned, device), "/v1/lookup", 16, 1
    if kind == "untuned":
        keys = {p.key for p in tuned}
        untuned = [p for p in fill_db.problems(2000, seed=987654) if p.key not in keys][:1000]
        return bodies_for(untuned, device), "/v1/lookup", 16, 1
    random.Random(3).shuffle(tuned)
    return ([json.dumps({"device": device, "problems": [p.to_dict() for p in tuned[lo:lo + 500]]}).encode()
             for lo in range(0, len(tuned) - 499, 500)], "/v1/lookup/batch", 1, 500)


def top(collapsed: str, n: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        frames = [f.strip() for f in stack.split(";")]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        samples += c
        own[frames[-1]] += c
        for f in set(frames):
            total[f] += c
    lines = [f"{samples} samples"]
    for title, counter in (("own time", own), ("total time", total)):
        lines.append(f"-- by {title}")
        lines += [f"{100 * c / samples:5.1f}%  {f}" for f, c in counter.most_common(n)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, help="database URL or SQLite file (filled)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--kind", choices=("single", "batch", "untuned"), default="single")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--raw", type=Path, help="also write py-spy's collapsed stacks here")
    args = ap.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("profile_lookup: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2

    bodies, path, conc, items = workload(args.kind)
    proc, _ = start_server(normalize_db_url(args.db), port=(port := free_port()))
    try:
        async def run() -> Phase:
            pool = RawPool(port, conc)
            await pool.open()
            try:
                await closed_loop(pool, bodies, path, 2.0, conc, Phase("warm-up"))
                with tempfile.NamedTemporaryFile(suffix=".txt") as out:
                    spied = subprocess.Popen([spy, "record", "--pid", str(proc.pid), "--format", "raw",
                                              "--rate", "250", "--duration", str(int(args.seconds)),
                                              "--output", out.name, "--nonblocking"],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    time.sleep(0.5)
                    phase = Phase(args.kind, items=items)
                    await closed_loop(pool, bodies, path, args.seconds - 0.5, conc, phase,
                                      in_order=args.kind == "batch")
                    _, err = spied.communicate(timeout=60)
                    if spied.returncode != 0:
                        raise SystemExit(f"py-spy failed: {err.strip().splitlines()[-1:]}")
                    phase.reasons["profile"] = 0
                    phase.profile = Path(out.name).read_text()  # type: ignore[attr-defined]
                return phase
            finally:
                await pool.close()

        phase = asyncio.run(run())
    finally:
        stop_server(proc)
    row = phase.row()
    print(f"{args.kind}: {row['lookups_per_s']:.0f} lookups/s, p50 {row['p50_ms']:.2f} ms, "
          f"p99 {row['p99_ms']:.2f} ms, {row['requests']} requests, {row['errors']} errors "
          "(while sampled by py-spy, non-blocking)")
    if args.raw:
        args.raw.write_text(phase.profile)  # type: ignore[attr-defined]
    print(top(phase.profile, args.top))  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
