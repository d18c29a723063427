#!/usr/bin/env bash
# A training step tuned in its program, then benchmarked with attribution: `tune-model` (extract ->
# tune each problem alone -> refinement in the step, stored as in-program evidence) and
# `bench-model --attribute` (plain vs the plan, each decomposed problem alone in the step and the
# plan without it, interleaved). Needs root (the lab's network namespaces).
#   bench/tune_model.sh [PROG] [TARGET] [WORKDIR]
#   bench/tune_model.sh tests.models.keras_hub_llama:train_step_sp      keras-hub's Llama (README)
#   TOL=0.005 bench/tune_model.sh tests.models.penzai_llama:train_step_sp   penzai's (AdamW's first
#                                               step amplifies rounding: see --tolerance)
# KW: the factory's kwargs (default: the third-party models at a size whose collectives move
# enough to time on the lab); MESH: the mesh; AXES: --auto or --explicit; TUNE_ARGS: more
# tune-model options (e.g. --skip-tune to refine the winners WORKDIR's database already holds).
set -euo pipefail
PROG=${1:-tests.models.keras_hub_llama:train_step_sp}
TARGET=${2:-lab:shared:2:2gbit}
WORK=${3:-$(mktemp -d)}
AT=${AT:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/autotuner}
KW=${KW:-'{"hidden": 512, "heads": 8, "mlp": 1024, "batch": 2, "seq": 192}'}
MESH=${MESH:-'{"data": 1, "model": 2}'}
AXES=${AXES:---auto}
TOL=${TOL:+--tolerance $TOL}
export KERAS_BACKEND=${KERAS_BACKEND:-jax}
DB="sqlite:///$WORK/step.db"
echo "# $PROG on $TARGET, workdir $WORK, load: $(cut -d' ' -f1-3 /proc/loadavg)"
# shellcheck disable=SC2086
time "$AT" tune-model "$PROG" --target "$TARGET" --db "$DB" --mesh "$MESH" --kwargs "$KW" "$AXES" \
    --trials 6 --tune-reps 5 --reps 15 $TOL ${TUNE_ARGS:-}
echo "# load: $(cut -d' ' -f1-3 /proc/loadavg)"
# shellcheck disable=SC2086
time "$AT" bench-model "$PROG" --target "$TARGET" --db "$DB" --mesh "$MESH" --kwargs "$KW" "$AXES" \
    --reps 30 --attribute $TOL
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
