#!/usr/bin/env bash
# A training step end to end on the lab: extract its problems, tune them, show the plan, then
# plain jit vs autotuner.overlap interleaved in one run (bench-model, with the per-pair breakdown).
# Needs root (the lab's network namespaces).
#   bench/train_step.sh [TARGET] [WORKDIR]            the built-in example (README quotes it)
#   PROG=tests.models.keras_hub_llama:train_step_sp MESH='{"data": 2, "model": 2}' KW='{}' AXES=--auto \
#     bench/train_step.sh lab:shared:4:2gbit         a real model of the test extra
#   MEMORY=none bench/train_step.sh                   without the pass's memory bound (default 0.05)
#   BENCH_ARGS=--attribute bench/train_step.sh        each decomposed problem's saving in the step too
set -euo pipefail
TARGET=${1:-lab:shared:2:2gbit}
WORK=${2:-$(mktemp -d)}
AT=${AT:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/autotuner}
PROG=${PROG:-autotuner.examples.transformer:train_step}
MESH=${MESH:-'{"model": 2}'}
KW=${KW:-'{"layers": 1, "batch": 8, "seq": 128, "d_model": 512, "heads": 8, "d_head": 16, "d_ff": 512}'}
AXES=${AXES:---explicit}
TRIALS=${TRIALS:-6}
MEMORY=${MEMORY:-0.05}
BENCH_ARGS=${BENCH_ARGS:-}
export KERAS_BACKEND=${KERAS_BACKEND:-jax}
DB="sqlite:///$WORK/step.db"
echo "# $PROG on $TARGET, workdir $WORK, load: $(cut -d' ' -f1-3 /proc/loadavg)"
"$AT" extract "$PROG" --mesh "$MESH" "$AXES" --kwargs "$KW" -o "$WORK/step.json" -q
time "$AT" tune --problems "$WORK/step.json" --target "$TARGET" --trials "$TRIALS" --reps 5 --db "$DB"
"$AT" plan "$PROG" --mesh "$MESH" "$AXES" --kwargs "$KW" --db "$DB" --memory "$MEMORY"
"$AT" bench-model "$PROG" --mesh "$MESH" "$AXES" --kwargs "$KW" --target "$TARGET" --db "$DB" --reps 30 \
    --memory "$MEMORY" $BENCH_ARGS
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
