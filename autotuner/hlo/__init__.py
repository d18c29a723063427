"""Find the sharded einsums this project decomposes in a real JAX program.

`extract(fn, *example_args)` lowers and compiles `fn` with the example arguments' shardings and
reads two snapshots of the HLO module that XLA dumps around its SPMD partitioner:

- *partitioned* (after `spmd-partitioning`): per-device shapes, the collectives the partitioner
  inserted and their replica groups, every dot still in its einsum form (later passes canonicalize
  dots to rank 2 and fuse everything, so the final `compiled.as_text()` is no use here);
- *propagated* (before `spmd-partitioning`): global shapes and the sharding of every dot and its
  operands, after sharding propagation.

In the partitioned module it finds the pairs this project decomposes: an `all-gather` feeding a
`dot` (possibly through copy/convert/bitcast/reshape/transpose), a `dot` feeding a
`reduce-scatter`, and the `all-reduce` + `dynamic-slice` form XLA:CPU emits in place of a
reduce-scatter. Each pair is mapped back to a `Problem`: the dot's dimension numbers give the
einsum equation, the matching dot of the propagated module gives global shapes and specs, the
collective's replica groups (and, for the dynamic-slice, its per-device offsets) give the mesh
axis. The Problem must classify as exactly the collective the HLO shows, or the pair is skipped.

A Problem's count is how many times its pairs run per call of the program: each occurrence in the
program, times the trip count of the loops around it when the loop is a counted one (the form
`lax.scan` and `fori_loop` lower to; other loops count once). Partition ids are positions in the
mesh's flattened device array (how JAX assigns devices to an SPMD computation). Dots inside
`shard_map` (manually partitioned) are skipped.
"""

from __future__ import annotations

from autotuner.hlo.compile import extract, extract_report, partitioned_hlo
from autotuner.hlo.pairs import ExtractReport, Pair, find_pairs
from autotuner.hlo.problems import extract_from_hlo
from autotuner.hlo.shardings import MeshInfo, parse_replica_groups, parse_sharding, tiling_spec
from autotuner.hlo.text import ExtractError, HloModule, Instr, parse_hlo

__all__ = ["ExtractError", "ExtractReport", "HloModule", "Instr", "MeshInfo", "Pair", "extract",
           "extract_from_hlo", "extract_report", "find_pairs", "parse_hlo", "parse_replica_groups",
           "parse_sharding", "partitioned_hlo", "tiling_spec"]
