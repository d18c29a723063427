"""Can XLA:CPU on the lab run a collective beside independent compute at all? (docs/lab.md, "Can
the lab overlap?"; issue 40.) Run in every lab process:

    autotuner lab run lab:shared:2:2gbit -- .venv/bin/python bench/lab_micro.py
    MICRO_PAD=10 autotuner lab run lab:shared:2:2gbit -- .venv/bin/python bench/lab_micro.py
    MICRO_PAD=10 MICRO_CHAIN=1 autotuner lab run lab:shared:2:2gbit -- .venv/bin/python bench/lab_micro.py

Process 0 prints one JSON line: each program's median ms over MICRO_REPS (11) interleaved
repetitions and, from XLA's thunk timings (5 profiled steps), the ms per step a collective and
compute ran side by side ("both"). MICRO_PAD adds that many independent 64x64 dots (MICRO_CHAIN:
the same dots in one chain), MICRO_SPLIT splits the matmul into that many row-chunk dots.
Programs (shard_map over 2 processes): comm = ppermute of a 4 MiB shard; comp = a matmul;
both = the two, independent, in one program (either order in the program text);
ring = dot(local) + dot(ppermute(x)) (the 2-process ring shape)."""
import glob
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                           int(os.environ["JAX_PROCESS_ID"]))
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from autotuner.measure.profile import COMPILE_OPTIONS, profile_steps  # noqa: E402

pid = jax.process_index()
n = jax.process_count()
mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
M, K, N = int(os.environ.get("MICRO_M", 1024)), 1024, int(os.environ.get("MICRO_N", 1024))
perm = [(i, (i + 1) % n) for i in range(n)]


def sm(f, ins, outs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs))


def comm(x, a, w):
    return jax.lax.ppermute(x, "x", perm)


SPLIT = int(os.environ.get("MICRO_SPLIT", 1))


def _mm(a, w):
    """a @ w, as SPLIT independent row-chunk dots when SPLIT > 1."""
    if SPLIT == 1:
        return a @ w
    return jnp.concatenate([c @ w for c in jnp.split(a, SPLIT, axis=0)], axis=0)


def comp(x, a, w):
    return _mm(a, w)


def both_send_first(x, a, w):
    return jax.lax.ppermute(x, "x", perm), _mm(a, w)


def both_dot_first(x, a, w):
    y = _mm(a, w)
    return jax.lax.ppermute(x, "x", perm), y


def ring(x, a, w):
    r = jax.lax.ppermute(x, "x", perm)
    return jnp.concatenate([_mm(x, w), _mm(r, w)], axis=0)


PAD = int(os.environ.get("MICRO_PAD", 0))


def padded(f):
    """f plus PAD independent small dots (so that the program has more than 8 thunks)."""
    def g(x, a, w):
        out = f(x, a, w)
        b = a[:64, :64]
        if os.environ.get("MICRO_CHAIN"):   # PAD dots in one chain: more than 8 thunks, few ready at once
            extra = b
            for _ in range(PAD):
                extra = jnp.tanh(extra @ b)
        else:
            extra = sum((b * (i + 1)) @ (b * (i + 2)) for i in range(PAD)) if PAD else None
        return out if extra is None else (out, extra)
    return g


S = P("x")
if PAD:
    comm, comp, both_send_first, both_dot_first, ring = map(padded, (comm, comp, both_send_first, both_dot_first, ring))
    _o = lambda spec: (spec, S)  # noqa: E731
else:
    _o = lambda spec: spec  # noqa: E731
progs = {"comm": sm(comm, (S, S, S), _o(S)), "comp": sm(comp, (S, S, S), _o(S)),
         "both_send_first": sm(both_send_first, (S, S, S), _o((S, S))),
         "both_dot_first": sm(both_dot_first, (S, S, S), _o((S, S))),
         "ring": sm(ring, (S, S, S), _o(S))}
sh = NamedSharding(mesh, S)
x = jax.device_put(jnp.ones((n * M, K), jnp.float32), sh)
a = jax.device_put(jnp.ones((n * M, K), jnp.float32), sh)
w = jax.device_put(jnp.ones((n * K, N), jnp.float32), sh)
compiled = {k: p.lower(x, a, w).compile(COMPILE_OPTIONS) for k, p in progs.items()}
for c in compiled.values():
    for _ in range(2):
        jax.block_until_ready(c(x, a, w))
reps = int(os.environ.get("MICRO_REPS", 11))
times = {k: [] for k in compiled}
for _ in range(reps):
    for k, c in compiled.items():
        t0 = time.perf_counter()
        jax.block_until_ready(c(x, a, w))
        times[k].append(time.perf_counter() - t0)
prof = {}
for k in ("both_send_first", "both_dot_first", "ring"):
    c = compiled[k]
    got = profile_steps(lambda c=c: c(x, a, w), 5, trace=pid == 0)
    if got is not None:
        prof[k] = {"step": round(got.step_ms, 2), "coll": round(got.collective_ms, 2),
                   "comp": round(got.compute_ms, 2), "both": round(got.overlap_ms, 2)}
threads = {}
for t in glob.glob("/proc/self/task/*/comm"):
    name = open(t).read().strip()
    threads[name] = threads.get(name, 0) + 1
if pid == 0:
    med = {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}
    rng = {k: [round(1e3 * min(v), 1), round(1e3 * max(v), 1)] for k, v in times.items()}
    print(json.dumps({"tag": os.environ.get("MICRO_TAG", ""), "median_ms": med, "range_ms": rng, "profile": prof,
                      "affinity": sorted(os.sched_getaffinity(0)), "threads": threads,
                      "xla_flags": os.environ.get("XLA_FLAGS")}), flush=True)
sys.stdout.flush()
