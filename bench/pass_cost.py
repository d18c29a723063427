"""What the compiler pass costs to prepare, against plain jit, on a third-party model's training
step at several depths, every pair forced to its first ring (as `overlap(step, strategy=callable)`)
under the default memory bound (+5% temp memory; `--memory none` for none), and the compiled
step's temp memory, plain vs overlapped. Two models of the test extra and the built-in example (`--model`):
- `keras-llama` (default): keras-hub's Llama (tests/models/keras_hub_llama.py), sequence parallel
  on the 2x2 (data, model) mesh of 4 in-process CPU devices, its tiny default size (its forced
  rings shrink temp memory: the bound never bites);
- `penzai-neox`: penzai's GPT-NeoX (tests/models/penzai_llama.py, variant gpt_neox), sequence
  parallel on a 1x2 mesh of 2 devices, batch 4 x sequence 256, embedding 256: there the forced
  rings grow temp memory by +20-24%, so the bound sheds most of them (`overlap.memory.fit`);
- `flax-scan`: a GPT of Flax NNX's layers with its blocks scanned (`nnx.scan`, tests/models/flax_gpt.py
  `train_step_scan_sp`), sequence parallel on the 2x2 mesh, the README's bench size (hidden 512,
  MLP 1024, batch 2 x sequence 192): a deep model written to compile one block, whatever its depth;
- `example`: the built-in example's training step (autotuner/examples/transformer.py) on a 4-way
  model axis of 4 devices, whose kept gathers and rings grow temp memory by +16-23%.

    .venv/bin/python bench/pass_cost.py --layers 2,8,16 --reps 2
    .venv/bin/python bench/pass_cost.py --model penzai-neox --layers 2,8 --reps 3
    .venv/bin/python bench/pass_cost.py --layers 2,8 --restart     # a restarted job, JAX's cache on
    .venv/bin/python bench/pass_cost.py --layers 16 --reps 1 --passes  # and XLA's passes, both compiles
    .venv/bin/python bench/pass_cost.py --model penzai-neox --layers 8 --reps 3 --dump   # what round 1's dump costs

Per depth and repetition, interleaved (caches cleared before each): `jit` is
`jax.jit(step).lower(*args).compile()`; `overlap` is `overlap(step).plan(*args)`, which traces,
analyses and compiles the program its calls run (the first call compiles nothing more:
tests/autotuner/overlap/test_overlap.py counts it), i.e. the time until the overlapped step can run.
Temp memory: plain from the compiled plain step, overlapped from the plan (`plan.memory`). Medians, [min, max] with more than one repetition.
A second table says where the time goes, medians per phase: jit's trace + lowering and compile,
and the pass's own phases as `plan.cost` reports them (`autotuner.overlap.plan.Cost`). A third
gives the two programs' sizes (measured after the timings): StableHLO lines and the compiled HLO's
instructions, fused computations' included.
`--restart`: each depth runs in two fresh processes sharing a persistent compilation cache
(JAX_COMPILATION_CACHE_DIR in a temporary folder): the first fills it, the second is timed (jit
and overlap both warm), which is what a restarted training job pays.
`--dump`: the rewritten program compiled `--reps` times more each way, alternated, freshly
lowered: with XLA's dump on, as round 1 of an Auto-layout program compiles it to read the
partitioner's texts (`hlo.compile.partitioned_texts`: on XLA:CPU the dump also writes every
kernel's LLVM IR and object file), and plain `compile()`; the difference is what that dump costs.
`--passes`: both programs compiled once more under `jax.profiler`, and the compile's events
(XLA's passes and pipelines) that grow most from the plain program to the overlapped one; and once
more with XLA's dumps, and the module's instructions at stages of XLA's pipeline (after the call
graph is flattened, Shardy, the partitioner, layout assignment), plain against overlapped.
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


def _setup() -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the installed libtpu need not be probed
    sys.path.insert(0, ROOT)


def _temp_kb(compiled: object) -> float:
    m = compiled.memory_analysis()  # type: ignore[attr-defined]
    return m.temp_size_in_bytes / 2**10


def _compile_events(lowered: object) -> dict[str, float]:
    """Seconds per event name of one fresh compile of `lowered` under jax.profiler (XLA's passes
    and pipelines, summed over their occurrences)."""
    import collections
    import glob

    import jax

    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    with tempfile.TemporaryDirectory(prefix="pass-cost-profile-") as d:
        jax.clear_caches()   # and compiler options, so that no cache answers: this compile is timed
        with jax.profiler.trace(d, profiler_options=opts):
            lowered.compile(compiler_options={"xla_embed_ir_in_executable": False})  # type: ignore[attr-defined]
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
        tot: collections.Counter[str] = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                for ev in line.events:
                    tot[ev.name] += ev.duration_ns / 1e9
    return dict(tot)


# XLA:CPU's pipeline stages whose module sizes `--passes` prints (dumped after these passes)
STAGES = ("flatten-call-graph", "shardy-xla", "spmd-partitioning", "layout-assignment")


def _stage_sizes(lowered: object) -> dict[str, int]:
    """Instructions of `lowered`'s module (`_instructions`) after each pass of STAGES (its pipeline
    and pass as the dump names them), before optimizations and compiled: one fresh compile with
    XLA's dumps."""
    import glob
    import re

    import jax

    sizes = {}
    with tempfile.TemporaryDirectory(prefix="pass-cost-stages-") as d:
        jax.clear_caches()
        lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_text": True,  # type: ignore[attr-defined]
                                          "xla_dump_hlo_pass_re": "|".join(STAGES)})
        for f in sorted(glob.glob(os.path.join(d, "*.txt"))):
            name = os.path.basename(f)
            m = re.search(r"\.(?:\d{4}\.)?([^.]+)\.after_(" + "|".join(STAGES) + r")\.", name)
            stage = (f"{m.group(1)}: after {m.group(2)}" if m else "before optimizations"
                     if name.endswith(".before_optimizations.txt") else "compiled"
                     if name.endswith("after_optimizations.txt") else None)
            if stage and stage not in sizes:
                with open(f) as fh:
                    sizes[stage] = _instructions(fh.read())
    order = ["before optimizations", *(k for k in sizes if ": after " in k), "compiled"]   # as XLA runs them
    return {k: sizes[k] for k in order if k in sizes}


MODELS = ("keras-llama", "penzai-neox", "flax-scan", "example")


def _step(model: str, layers: int) -> tuple[object, tuple[object, ...]]:
    """A fresh (jitted training step, its arguments) of `model` at `layers` depth."""
    import jax
    from jax.sharding import AxisType

    if model == "example":
        from autotuner.examples import transformer

        return transformer.train_step(layers=layers)
    if model == "flax-scan":
        from tests.models import flax_gpt, meshes

        return flax_gpt.train_step_scan_sp(layers=layers, **meshes.BENCH)
    if model == "penzai-neox":
        from tests.models import penzai_llama

        mesh = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:2])
        return penzai_llama.train_step(mesh, sp=True, variant="gpt_neox", layers=layers, batch=4, seq=256)
    from tests.models import keras_hub_llama

    return keras_hub_llama.train_step_sp(layers=layers)


def _dump_cost(ov: object, args: tuple[object, ...], reps: int) -> dict[str, list[float]]:
    """Seconds of the rewritten program's compile with the partitioner's dump as the pass's round 1
    reads it (`hlo.compile.partitioned_texts`), and without (`compile()`), alternated, each freshly
    lowered with caches cleared."""
    import jax

    from autotuner.hlo.compile import partitioned_texts

    out: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(reps):
        for way, times in out.items():
            jax.clear_caches()
            lowered = ov.lower(*args)  # type: ignore[attr-defined]
            t = time.perf_counter()
            partitioned_texts(lowered) if way == "with" else lowered.compile()
            times.append(time.perf_counter() - t)
    return out


def measure(layers: int, reps: int, passes: bool = False, model: str = MODELS[0],
            memory: float | None = 0.05, dump: bool = False) -> dict[str, object]:
    import jax

    from autotuner import space
    from autotuner.overlap import overlap

    jit_s, ov_s, phases = [], [], []
    plain_mb = ov_mb = 0.0
    applied = pairs = 0
    for _ in range(reps):
        # a fresh model for each compile: Keras's train_step does not trace twice
        fn, args = _step(model, layers)
        jax.clear_caches()
        t = time.perf_counter()
        lowered = fn.lower(*args)
        t1 = time.perf_counter()
        plain = lowered.compile()
        jit_s.append(time.perf_counter() - t)
        jit_phases = {"jit trace+lower": t1 - t, "jit compile": time.perf_counter() - t1}
        plain_mb = _temp_kb(plain)
        fn, args = _step(model, layers)
        jax.clear_caches()
        t = time.perf_counter()
        ov = overlap(fn, strategy=lambda p: space(p)[1], memory=memory)
        plan = ov.plan(*args)   # compiles the program the calls run (they compile nothing more)
        ov_s.append(time.perf_counter() - t)
        phases.append(jit_phases | plan.cost.as_dict())
        ov_mb = (plan.memory.overlapped_bytes or 0) / 2**10
        applied, pairs = sum(r.applied for r in plan), len(plan)
    # the programs' sizes, after the timings: StableHLO lines, compiled HLO instructions
    rewritten = ov.lower(*args)
    sizes = {"stablehlo": [_lines(lowered.as_text()), _lines(rewritten.as_text())],
             "instructions": [_instructions(plain.as_text()), _instructions(ov.compiled(*args).as_text())]}
    events = [_compile_events(lowered), _compile_events(rewritten)] if passes else []
    stages = [_stage_sizes(lowered), _stage_sizes(rewritten)] if passes else []
    return {"layers": layers, "jit_s": jit_s, "overlap_s": ov_s, "pairs": pairs, "applied": applied,
            "temp_mb_plain": plain_mb, "temp_mb_overlap": ov_mb, "phases": phases, "sizes": sizes,
            "events": events, "stages": stages, "dump": _dump_cost(ov, args, reps) if dump else {}}


def _bound(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _lines(text: str) -> int:
    return text.count("\n")


def _instructions(hlo: str) -> int:
    """Instructions of a compiled HLO module, fused computations' included."""
    from autotuner.hlo.text import parse_hlo

    return len(parse_hlo(hlo).order)


def _spread(xs: list[float]) -> str:
    """`median [min, max]` of seconds (the median alone for one)."""
    return f"{statistics.median(xs):.2f}" + (f" [{min(xs):.2f}, {max(xs):.2f}]" if len(xs) > 1 else "")


def _line(r: dict[str, object]) -> str:
    j, o = r["jit_s"], r["overlap_s"]
    assert isinstance(j, list) and isinstance(o, list)
    ratios = [b / a for a, b in zip(j, o, strict=True)]
    spread = f" [{min(ratios):.2f}, {max(ratios):.2f}]" if len(ratios) > 1 else ""
    pm, om = float(r["temp_mb_plain"]), float(r["temp_mb_overlap"])  # type: ignore[arg-type]
    return (f"| {r['layers']} | {statistics.median(j):.2f} s | {statistics.median(o):.2f} s | "
            f"{statistics.median(ratios):.2f}x{spread} | {r['applied']}/{r['pairs']} | "
            f"{pm:.0f} -> {om:.0f} KiB ({100 * (om / pm - 1):+.1f}%) |")


HEAD = ("| layers | jit compile | overlap preparation | ratio | pairs decomposed | temp memory (per device) |\n"
        "|---|---|---|---|---|---|")


PHASES = ("jit trace+lower", "jit compile", "trace", "analysis", "reading", "rewrite", "compile")
PHASE_HEAD = ("where the time goes (seconds, medians): plain jax.jit's two phases, then the pass's as plan.cost "
              "reports them\n| layers | " + " | ".join(PHASES) + " |\n|" + "---|" * (len(PHASES) + 1))


def _phase_line(r: dict[str, object]) -> str:
    got = r["phases"]
    assert isinstance(got, list)
    return f"| {r['layers']} | " + " | ".join(f"{statistics.median(p[k] for p in got):.2f}" for k in PHASES) + " |"


TOP = 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default=MODELS[0], help="the third-party training step")
    ap.add_argument("--layers", default="2,8,16", help="comma-separated depths")
    ap.add_argument("--memory", type=_bound, default=0.05, help="the memory bound (a fraction, or none)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per depth")
    ap.add_argument("--restart", action="store_true", help="time a second process on a warm persistent cache")
    ap.add_argument("--passes", action="store_true", help="also profile both compiles: XLA's passes that grow most, the module's size through the pipeline")
    ap.add_argument("--dump", action="store_true", help="also time the rewritten program's compile with the "
                    "partitioner's dump (round 1 of an Auto-layout program) and without, alternated")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)   # internal: one depth, JSON out
    a = ap.parse_args()
    if (a.passes or a.dump) and a.restart:
        ap.error("--passes and --dump time cold compiles; a restarted job compiles nothing "
                 "(JAX's cache answers): use one or the other")
    _setup()
    if a.one is not None:
        print(json.dumps(measure(a.one, a.reps, model=a.model, memory=a.memory)))
        return
    depths = [int(x) for x in a.layers.split(",")]
    bound = "none" if a.memory is None else f"+{100 * a.memory:g}%"
    print(f"{a.model}, every pair forced to its first ring, memory bound {bound}")
    print(HEAD + ("  (restarted: warm persistent cache)" if a.restart else ""), flush=True)
    results = []
    for n in depths:
        if not a.restart:
            results.append(measure(n, a.reps, a.passes, a.model, a.memory, a.dump))
            print(_line(results[-1]), flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="pass-cost-cache-") as cache:
            env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache,
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
            cmd = [sys.executable, __file__, "--one", str(n), "--reps", "1", "--model", a.model,
                   "--memory", str(a.memory).lower()]
            subprocess.run(cmd, env=env, check=True, capture_output=True)          # fills the cache
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(_line(results[-1]), flush=True)
    print("\n" + PHASE_HEAD)
    for r in results:
        print(_phase_line(r))
    print("\nprogram size, plain jit -> overlapped\n| layers | StableHLO lines | compiled HLO instructions |\n|---|---|---|")
    for r in results:
        (sp, so), (ip, io) = r["sizes"]["stablehlo"], r["sizes"]["instructions"]  # type: ignore[index]
        print(f"| {r['layers']} | {sp} -> {so} | {ip} -> {io} ({100 * (io / ip - 1):+.0f}%) |")
    if a.dump:
        print("\nthe rewritten program's compile with the partitioner's dump (as round 1 reads it) and without, "
              f"{a.reps} alternated each (seconds)\n| layers | with the dump | without | the dump costs |\n|---|---|---|---|")
        for r in results:
            w, wo = r["dump"]["with"], r["dump"]["without"]  # type: ignore[index]
            print(f"| {r['layers']} | {_spread(w)} | {_spread(wo)} | "
                  f"{statistics.median(w) - statistics.median(wo):+.2f} |")
    for r in results:
        if r.get("events"):
            plain_ev, ov_ev = r["events"]  # type: ignore[misc]
            grown = sorted(set(plain_ev) | set(ov_ev), key=lambda k: plain_ev.get(k, 0) - ov_ev.get(k, 0))[:TOP]
            print(f"\ncompile events that grow most, {r['layers']} layers (seconds, one profiled compile each)"
                  "\n| event | plain jit | overlapped |\n|---|---|---|")
            for k in grown:
                print(f"| {k[:70]} | {plain_ev.get(k, 0):.2f} | {ov_ev.get(k, 0):.2f} |")
        if r.get("stages"):
            plain_st, ov_st = r["stages"]  # type: ignore[misc]
            print(f"\nthe module through XLA's pipeline, {r['layers']} layers (instructions, fused computations' "
                  "included)\n| stage | plain jit | overlapped |\n|---|---|---|")
            for k in plain_st:
                if k in ov_st:
                    print(f"| {k} | {plain_st[k]} | {ov_st[k]} ({100 * (ov_st[k] / plain_st[k] - 1):+.0f}%) |")


if __name__ == "__main__":
    main()
