"""An analytic cost model of every strategy of `space`, calibrated by measurement on the target.

What it models, per device of the collective axis (all devices run the same program):

- compute: a partial einsum of F flops touching B bytes takes max(T_mm(F), B / mem_bw) plus a
  per-einsum overhead, T_mm a smooth fit (a power law, constant rate beyond the sweep)
  to a matmul-rate sweep run on the target with every process computing at once (so the cores
  they share are in it);
- the baseline's collectives: all-gather and reduce-scatter alone, a + b * bytes, fitted on the
  target (they are gloo's / NCCL's algorithms, not ours; a may be negative: a shaper's burst);
- the ring's point-to-point transfers: the data holds its direction's link for bytes * beta
  (beta_uni when one direction is busy, beta_bidi per direction when both are: on a `ring`
  topology the two directions have their own links, on a `shared` one they share one bucket;
  both measured, not assumed), and each message holds one per-process message resource for
  alpha (handshakes, the partner being scheduled), so small chunks pay alpha each while a big
  message's data time hides it;
- each strategy's overlap structure, simulated as a schedule of tasks on the cpu, one link per
  direction and the message resource: the ring's steps, the chunks of each step (each its own
  transfer and partial einsum, which is what shortens the fill and drain), the dependencies
  between them (a block is sent on only once it has arrived; a reduce-scatter accumulator only
  once this device has added its partial), the rolled loop (`unroll` 1 or 2: an iteration
  starts when the previous one is done, plus a per-iteration overhead; optionally its body
  serial), `fuse=after`'s assembly copy after the loop, and the cpu running every ready einsum
  at once (straight-line reduce-scatter code computes all its partials together, late for the
  ring's chain);
- contention: while a transfer is in flight the cpu runs slower by 1 + kappa, a transfer by
  1 + kappa_x while the cpu computes (gloo, the TCP stack and the shaping need cycles too).

Calibration (`calibrate(ts)`, `autotuner calibrate --target T`) measures synthetic problems
that are not the suite's, through the ordinary harness (`measure.run_session`, the same barrier
and max-over-processes discipline): a matmul sweep (local einsums), a transfer sweep (all-gather
and reduce-scatter rings whose einsums are negligible, 256 KiB to 4 MiB, 1, 2 and 4 chunks, one
and both directions: alpha, beta_uni, beta_bidi), and four overlap sessions (all-gather and reduce-scatter,
balanced and compute-heavy shapes)
(sized from the sweeps) from which kappa, kappa_x, the overheads and the copy rate are fitted.
The parameters (`Params`) are stored per device in the database (`save_params` /
`load_params`).

Uses: `ranker(params, problem)` is an `order` for `search.tune_problem` (likely winners first;
`order_for(database, device, problem)` loads the device's calibration), and
`predict(problem, device, params) -> (strategy, speedup)` for the service's `source: "model"`
answers (`model_answer(database)` builds the function it calls).
"""

from __future__ import annotations

from autotuner.costmodel.calibrate import calibrate, collect, fit
from autotuner.costmodel.calibrated import load_params, model_answer, order_for, save_params
from autotuner.costmodel.params import VERSION, CostModelError, Params
from autotuner.costmodel.simulate import Geometry, geometry, predict, predict_all, ranker, simulate

__all__ = ["VERSION", "CostModelError", "Geometry", "Params", "calibrate", "collect", "fit", "geometry",
           "load_params", "model_answer", "order_for", "predict", "predict_all", "ranker", "save_params",
           "simulate"]
