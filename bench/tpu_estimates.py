"""TPU truth from the real compiler, no TPU: what XLA:TPU does with each problem, and what our rings
would do, estimated from the compiled schedules (`autotuner tune --target aot:tpu:TOPOLOGY`). Every
figure here is an ESTIMATE (XLA:TPU compile, no TPU), never a measurement.

    .venv/bin/python bench/tpu_estimates.py --problems suite --target aot:tpu:v5e:2x4 --exhaustive
    .venv/bin/python bench/tpu_estimates.py --problems step.json --target aot:tpu:v5e:2x4 --target aot:tpu:v6e:2x4 --trials 12
    .venv/bin/python bench/tpu_estimates.py --calibrate
    .venv/bin/python bench/tpu_estimates.py --spearman lab.jsonl aot.jsonl

Per target, `autotuner tune --json` runs into a scratch database; the table has, per problem,
the estimated time of `plain` (what the user's jax.jit compiles to: XLA's own windowed einsum
where XLA decides so), `xla_windowed` (forced on), the hand-written `baseline` and the best ring,
the best ring's temp memory against plain's, and how much of its transfers its schedule hides;
then how often our best estimate beats XLA's default. Candidates that did not compile are
counted with the compiler's reason.
`--calibrate`: per generation, the fraction of the published peak at which XLA:TPU's own cycle
estimate of an 8192^3 bf16 matmul runs at our clock (`autotuner.hlo.chips`), and our compute
estimate over the compiler's `optimal_seconds` for it (the compute part checked against the
compiler's other figure).
`--spearman LAB AOT`: the rank correlation between two `tune --exhaustive --json` outputs for the
same problems (e.g. the lab's measurements and a TPU target's estimates), per problem over the
candidates both have.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from autotuner.strategy import Strategy  # noqa: E402

TOPOLOGIES = ("v4:2x2x1", "v5e:2x4", "v5p:2x2x1", "v6e:2x2")


def tune(problems: str, target: str, *, exhaustive: bool, trials: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="tpu-estimates-") as tmp:
        cmd = [sys.executable, "-m", "autotuner.cli", "tune", "--problems", problems, "--target", target,
               "--json", "--db", f"sqlite:///{tmp}/estimates.db"]
        cmd += ["--exhaustive"] if exhaustive else ["--trials", str(trials)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    if r.returncode != 0 and not rows:
        sys.exit(f"{target}: tune failed:\n{r.stderr[-3000:]}")
    return rows


def _ms(c: dict[str, Any] | None) -> str:
    return "-" if c is None or c.get("estimated_s") is None else f"{c['estimated_s'] * 1e3:.3f}"


def table(target: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n### {target} — estimated (XLA:TPU compile, no TPU)\n")
    print("| problem | plain ms | xla_windowed ms | baseline ms | best ring | ms | plain / best | "
          "temp MB plain -> best | overlapped / async | hidden | winner (x plain) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    wins = wins5 = windowed = failed = compiled = n = beaten = 0
    for r in rows:
        cands = {c["key"]: c for c in r.get("candidates") or []}
        if "plain" not in cands:
            print(f"| {r['name']} | failed: {(r.get('error') or 'no plain candidate')[:80]} |||||||||")
            continue
        n += 1
        failed += sum(not c["compiled"] for c in cands.values())
        compiled += sum(c["compiled"] for c in cands.values())
        plain, forced, base = cands["plain"], cands.get("xla_windowed"), cands.get("baseline")
        rings = [c for c in cands.values() if c["key"].startswith("ring") and c.get("estimated_s")]
        best = min(rings, key=lambda c: c["estimated_s"], default=None)
        ratio = plain["estimated_s"] / best["estimated_s"] if best else None
        wins += ratio is not None and ratio > 1
        wins5 += ratio is not None and ratio > 1.05
        windowed += (forced is not None and forced.get("estimated_s") is not None
                     and forced["estimated_s"] < plain["estimated_s"] * 0.999)
        temp = (f"{(plain['temp_bytes'] or 0) / 1e6:.1f} -> {(best['temp_bytes'] or 0) / 1e6:.1f}" if best else "-")
        ov = f"{best['overlapped_collectives']} / {best['async_collectives']}" if best else "-"
        hid = f"{best['hidden_fraction'] * 100:.0f}%" if best and best.get("hidden_fraction") is not None else "-"
        won = Strategy.from_dict(r["winner"]).key if r.get("winner") else "-"
        beaten += won not in ("plain", "-")
        print(f"| {r['name']} | {_ms(plain)} | {_ms(forced)} | {_ms(base)} | {best['key'] if best else '-'} | "
              f"{_ms(best)} | {f'{ratio:.3f}x' if ratio else '-'} | {temp} | {ov} | {hid} | "
              f"{won} ({r['speedup']:.3f}x) |")
    print(f"\nthe winner (the best estimate over plain jit, XLA's default) is another program on {beaten} of "
          f"{n} problems; our best ring's estimate beats plain on {wins} ({wins5} by more than 5%); forcing "
          f"XLA's windowed einsum beats its default on {windowed}; {compiled} candidates compiled, {failed} did "
          "not (each with XLA:TPU's reason in the JSON)")
    for r in rows:
        for c in r.get("candidates") or []:
            if not c["compiled"]:
                print(f"  {r['name']} {c['key']}: {c['reason']}")


def calibrate() -> None:
    from autotuner.measure.aot import AotSpec, mesh_on, topology_devices

    rows = []
    for topo in TOPOLOGIES:
        devs = topology_devices(AotSpec.parse("aot:tpu:" + topo))   # before jax starts: libtpu's settings
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from autotuner.hlo.chips import chip_for
        from autotuner.hlo.schedule import estimate, placement_of

        n = 8192
        chip = chip_for(devs[0].device_kind)
        mesh = mesh_on(devs, (1,), ("x",))
        a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
        compiled = jax.jit(lambda x, y: x @ y).lower(a, a).compile()
        e = estimate(compiled.as_text(), chip, placement_of(list(mesh.devices.flat)))
        peak = chip.peak_flops / (chip.cores if devs[0].device_kind == "TPU v4" else 1)  # v4: a core a device
        cost = compiled.cost_analysis()
        cost = cost if isinstance(cost, dict) else cost[0]
        rows.append((topo, chip, 2 * n ** 3 / e.compute_s / peak, e.compute_s / cost["optimal_seconds"]))
    print("| generation | clock | source | XLA's 8192^3 bf16 matmul estimate at that clock | our compute / XLA's optimal_seconds |")
    print("|---|---|---|---|---|")
    for topo, chip, frac, over in rows:
        print(f"| {topo} | {chip.clock_hz / 1e9:.2f} GHz | {chip.clock_source} | {frac * 100:.1f}% of peak | {over:.3f} |")


def spearman(lab: str, aot: str) -> None:
    from scipy.stats import spearmanr

    names: dict[str, str] = {}

    def load(path: str) -> dict[str, dict[str, float]]:
        out = {}
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                names[r["key"]] = r["name"]
                out[r["key"]] = {c["key"]: c.get("median_s") or c.get("estimated_s") for c in r.get("candidates") or []
                                 if (c.get("median_s") or c.get("estimated_s"))}
        return out

    a, b = load(lab), load(aot)
    print("| problem | candidates | Spearman (first file's times vs the second's) |")
    print("|---|---|---|")
    for key in sorted(a.keys() & b.keys(), key=lambda k: names[k]):
        common = sorted(a[key].keys() & b[key].keys())
        if len(common) >= 3:
            rho = spearmanr([a[key][k] for k in common], [b[key][k] for k in common]).statistic
            print(f"| {names[key]} | {len(common)} | {rho:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default="suite")
    ap.add_argument("--target", action="append", default=[])
    ap.add_argument("--exhaustive", action="store_true")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--json", help="also write every row to this JSONL file")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--spearman", nargs=2, metavar=("FIRST", "SECOND"))
    ap.add_argument("--table", metavar="JSONL", help="print the tables of rows a --json run wrote, per device")
    args = ap.parse_args()
    if args.table:
        rows = [json.loads(x) for x in open(args.table) if x.strip()]
        for topo in dict.fromkeys(r["device"]["topology"] for r in rows):
            table(topo, [r for r in rows if r["device"]["topology"] == topo])
        return
    if args.calibrate:
        calibrate()
        return
    if args.spearman:
        spearman(*args.spearman)
        return
    for target in args.target or ["aot:tpu:v5e:2x4"]:
        rows = tune(args.problems, target, exhaustive=args.exhaustive, trials=args.trials)
        if args.json:
            with open(args.json, "a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
        table(target, rows)


if __name__ == "__main__":
    main()
