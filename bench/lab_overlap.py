"""Does any XLA:CPU setting or process placement make the lab overlap? The built-in example's
training step (autotuner/examples/transformer.py, 1 layer, batch 8 x seq 128, d_model 512, on a
2-way model axis) on `lab:shared:2:2gbit`, plain jit vs `overlap` with the winners of `--db`,
through `bench-model --profile N --json`, once per variant and round, the variants interleaved
round by round (each run is a fresh lab: its own processes, its own compile). Per variant,
medians over rounds [min, max]: each program's collective, compute and side-by-side time per step
(process 0's thunks, `measure/profile.py`: side by side = a collective and compute running at
once), the step speedup (plain / overlapped medians of `--reps` timed steps) and the overlap
share (more side-by-side time in the overlapped step than in plain, over the time it saves).

A variant is environment for the lab's processes (the lab hands the caller's XLA_FLAGS and the
rest of its environment to its workers; `autotuner/lab/launcher.py`):
- `default`: none (XLA_FLAGS and PJRT_NPROC emptied);
- `sched-concurrency` / `sched-memory`: `--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_...`, XLA:CPU's
  HLO scheduler. With jaxlib 0.10.2 the default already picks the concurrency-optimized schedule
  for these programs (they have collectives): `sched-concurrency` (and the older
  `--xla_cpu_enable_concurrency_optimized_scheduler=true`) compile to byte-identical HLO and
  buffer assignment, so `sched-concurrency` is an A/A control of the run's noise;
- `eigen-single`: `--xla_cpu_multi_thread_eigen=false` (no multi-threaded Eigen kernels);
- `no-xnnpack`: `--xla_cpu_use_xnnpack=false`;
- `pool-1` / `pool-4`: PJRT_NPROC=1 / 4, the size of each process's intra-op thread pool (the
  thunk executor's task runner; default: the schedulable cores, 2);
- `pin`: each lab process pinned to its own core (as `LabSpec(pin=True)`), by a `sitecustomize`
  put first on the workers' PYTHONPATH that pins a process started as `autotuner.lab worker
  --id I` to core I before JAX starts (so its pool has 1 thread); `pin-pool-2`: pinned, 2 pool
  threads.
Every flag here exists in the installed jaxlib (an unknown XLA flag aborts the process).
`--strategy KEY` forces one strategy for every pair instead of the --db winners.

    .venv/bin/python bench/lab_overlap.py --db sqlite:///WORK/step.db                # all, 3 rounds
    .venv/bin/python bench/lab_overlap.py --db sqlite:///WORK/step.db --variants default,pin,pool-4 --rounds 5
    .venv/bin/python bench/lab_overlap.py --db sqlite:///WORK/step.db --variants default --strategy ring-uni-c4-ufull-loop-send

`--db` holds the step's tuned winners (bench/train_step.sh's extract and tune steps build one,
e.g. `TRIALS=3`); all variants read the same winners, so the plan is the same in every run.
Seen here (jax 0.10.2, 4 rounds): no variant raised the overlapped step's side-by-side time
beyond the default's 2-4 ms. `pin` and `pool-1` made it 0, and `sched-memory` lowered it. XLA:CPU's
thunk executor runs a gloo collective inline and runs compute beside it only when it has handed
that compute to another pool thread. Its thresholds for that are compile-time constants, not flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "autotuner.examples.transformer:train_step"
MESH = '{"model": 2}'
KWARGS = '{"layers": 1, "batch": 8, "seq": 128, "d_model": 512, "heads": 8, "d_head": 16, "d_ff": 512}'
_SCHED = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_"
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "sched-concurrency": {"XLA_FLAGS": _SCHED + "CONCURRENCY_OPTIMIZED"},
    "sched-memory": {"XLA_FLAGS": _SCHED + "MEMORY_OPTIMIZED"},
    "eigen-single": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
    "no-xnnpack": {"XLA_FLAGS": "--xla_cpu_use_xnnpack=false"},
    "pool-1": {"PJRT_NPROC": "1"},
    "pool-4": {"PJRT_NPROC": "4"},
    "pin": {"PIN": "1"},
    "pin-pool-2": {"PIN": "1", "PJRT_NPROC": "2"},
}
# put first on a lab worker's PYTHONPATH: pins `python -m autotuner.lab worker --id I ...` to the
# I-th schedulable core (mod their number) before anything else runs, as the lab's own pin does
SITECUSTOMIZE = '''import os
try:
    _a = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    if b"autotuner.lab" in _a and b"worker" in _a and b"--id" in _a:
        _c = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {_c[int(_a[_a.index(b"--id") + 1]) % len(_c)]})
except Exception:
    pass
'''


def _env(variant: dict[str, str], shim: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env.setdefault("KERAS_BACKEND", "jax")
    for k, v in variant.items():
        if k == "PIN":
            env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH")) if p)
        else:
            env[k] = v
    return env


def run_one(args: argparse.Namespace, variant: dict[str, str], shim: str) -> dict:
    """One `bench-model --profile --json` run of the step under `variant`; its JSON."""
    cmd = [args.autotuner, "bench-model", PROG, "--mesh", MESH, "--explicit", "--kwargs", KWARGS,
           "--target", args.target, "--db", args.db, "--reps", str(args.reps), "--profile", str(args.profile),
           "--strategy", args.strategy, "--json", "--no-pairs", "--no-store"]
    done = subprocess.run(cmd, env=_env(variant, shim), capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench-model failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def _fig(values: list[float | None], scale: float = 1e3, fmt: str = ".2f") -> str:
    v = [x * scale for x in values if x is not None]
    if not v:
        return "-"
    med = format(statistics.median(v), fmt)
    return med if len(v) == 1 else f"{med} [{min(v):{fmt}}, {max(v):{fmt}}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, help="results database with the step's winners (sqlite:///...)")
    ap.add_argument("--target", default="lab:shared:2:2gbit")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10, help="bench-model --reps (timed steps per program)")
    ap.add_argument("--profile", type=int, default=10, help="bench-model --profile (profiled steps per program)")
    ap.add_argument("--strategy", default="auto", help="bench-model --strategy: auto (the --db winners) or "
                    "one strategy key for every pair, e.g. ring-uni-c4-ufull-loop-send")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per bench-model run")
    ap.add_argument("--autotuner", default=os.path.join(ROOT, ".venv", "bin", "autotuner"))
    ap.add_argument("--raw", help="also write every run's JSON (one line per run) to this file")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory(prefix="lab-overlap-") as shim:
        with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        for r in range(args.rounds):
            for v in names:
                load = open("/proc/loadavg").read().split()[:3]
                t0 = time.monotonic()
                got = run_one(args, VARIANTS[v], shim)
                got["_load"], got["_round"], got["_variant"] = load, r, v
                runs[v].append(got)
                p, o = got["plain"], got["overlapped"]
                print(f"round {r + 1}/{args.rounds} {v}: {time.monotonic() - t0:.0f}s, load {' '.join(load)}, "
                      f"speedup {got['speedup']:.3f}, side by side plain/overlapped "
                      f"{_fig([p['side_by_side_s']])}/{_fig([o['side_by_side_s']])} ms", file=sys.stderr, flush=True)
                if args.raw:
                    with open(args.raw, "a") as f:
                        f.write(json.dumps(got) + "\n")
    print(f"\n{args.target}, {PROG} {KWARGS}, --strategy {args.strategy} --reps {args.reps} --profile {args.profile}, "
          f"{args.rounds} round(s); "
          "ms per step, median over rounds [min, max]\n")
    head = ["variant", "env", "plain step", "overlapped step", "speedup", "plain collectives",
            "overlapped collectives", "plain compute", "overlapped compute", "plain side by side",
            "overlapped side by side", "overlap share %"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for v in names:
        rs = runs[v]
        env = " ".join(f"{k}={x}" for k, x in VARIANTS[v].items()) or "-"
        row = [v, f"`{env}`",
               _fig([x["plain"]["median_s"] for x in rs]), _fig([x["overlapped"]["median_s"] for x in rs]),
               _fig([x["speedup"] for x in rs], 1, ".3f"),
               *[_fig([x[p][k] for x in rs]) for k in ("collective_s", "compute_s", "side_by_side_s")
                 for p in ("plain", "overlapped")],
               _fig([x["overlap_share"] for x in rs], 100, ".0f")]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
