"""The built-in transformer suite: Megatron-style tensor + sequence parallel projections.

Per layer, sequence parallelism gathers the activations' sequence dim before the column-parallel
projections (QKV, MLP up: all-gather -> einsum) and reduce-scatters it after the row-parallel ones
(attention output, MLP down: einsum -> reduce-scatter). Sizes are chosen so that on the lab
(2 Gbit/s links, one CPU core per process) some shapes are communication-bound, some
compute-bound and some balanced; `scale` shrinks every size for quick in-process runs.
"""

from __future__ import annotations

from autotuner.problem import Problem

# name, kind, S (tokens), D (model), F (per-device width of the sharded projection), regime
_SHAPES = [
    ("mlp_up_balanced", "ag", 2048, 1024, 768, "balanced"),
    ("mlp_up_comm", "ag", 2048, 1024, 256, "comm-bound"),
    ("mlp_up_compute", "ag", 2048, 1024, 2048, "compute-bound"),
    ("qkv", "ag3", 2048, 1024, 384, "comm-bound"),
    ("attn_out", "rs", 2048, 1024, 512, "comm-bound"),
    ("mlp_down_balanced", "rs", 2048, 1024, 1536, "balanced"),
    ("mlp_down_compute", "rs", 2048, 512, 4096, "compute-bound"),
]


def suite(n: int, *, scale: float = 1.0, dtype: str = "float32", axis: str = "x") -> list[tuple[str, str, Problem]]:
    """(name, regime, Problem) for a model axis of size n."""
    out = []
    for name, kind, S, D, F, regime in _SHAPES:
        s = max(n * 8, int(S * scale) // (n * 8) * (n * 8))
        d = max(8, int(D * scale) // 8 * 8)
        f = max(8, int(F * scale) // 8 * 8) * n
        if kind == "ag":
            spec = {"equation": "sd,df->sf", "lhs": {"shape": [s, d], "spec": [axis, None]},
                    "rhs": {"shape": [d, f], "spec": [None, axis]}, "out_spec": [None, axis]}
        elif kind == "ag3":
            b = 2
            spec = {"equation": "bsd,dh->bsh", "lhs": {"shape": [b, s // b, d], "spec": [None, axis, None]},
                    "rhs": {"shape": [d, f], "spec": [None, axis]}, "out_spec": [None, None, axis]}
        else:
            spec = {"equation": "sf,fd->sd", "lhs": {"shape": [s, f], "spec": [None, axis]},
                    "rhs": {"shape": [f, d], "spec": [axis, None]}, "out_spec": [axis, None]}
        spec["dtype"] = dtype
        spec["mesh"] = {axis: n}
        out.append((name, regime, Problem.from_dict(spec)))
    return out
