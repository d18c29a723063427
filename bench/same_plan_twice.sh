#!/usr/bin/env bash
# The same plan twice (issue 40): extract -> tune -> bench-model on one training step, run twice
# into two fresh databases, then bench/compare_runs.py says whether the runs agree — the same
# winner on every problem whose effect lies outside the noise, and step speedups inside each
# other's intervals. Needs root (the lab's network namespaces).
#   bench/same_plan_twice.sh [PROG] [TARGET] [WORKDIR]
#   bench/same_plan_twice.sh tests.models.keras_hub_llama:train_step_sp    keras-hub's Llama (docs/lab.md)
# KW, MESH, AXES as in bench/tune_model.sh; TRIALS (6), REPS (tune's, 5), STEP_REPS (bench-model's, 30).
# BENCH_ARGS: more bench-model options (default --profile 10: where the step time goes, the overlap share).
set -euo pipefail
PROG=${1:-tests.models.keras_hub_llama:train_step_sp}
TARGET=${2:-lab:shared:2:2gbit}
WORK=${3:-$(mktemp -d)}
HERE=$(cd "$(dirname "$0")/.." && pwd)
AT=${AT:-$HERE/.venv/bin/autotuner}
PY=${PY:-$HERE/.venv/bin/python}
KW=${KW:-'{"hidden": 512, "heads": 8, "mlp": 1024, "batch": 2, "seq": 192}'}
MESH=${MESH:-'{"data": 1, "model": 2}'}
AXES=${AXES:---auto}
TRIALS=${TRIALS:-6}
REPS=${REPS:-5}
STEP_REPS=${STEP_REPS:-30}
BENCH_ARGS=${BENCH_ARGS:---profile 10}
export KERAS_BACKEND=${KERAS_BACKEND:-jax}
echo "# $PROG on $TARGET, workdir $WORK, load: $(cut -d' ' -f1-3 /proc/loadavg)"
"$AT" extract "$PROG" --mesh "$MESH" "$AXES" --kwargs "$KW" -o "$WORK/step.json" -q
for run in 1 2; do
    mkdir -p "$WORK/run$run"
    DB="sqlite:///$WORK/run$run/step.db"
    echo "# run $run: tune, load: $(cut -d' ' -f1-3 /proc/loadavg)"
    start=$(date +%s)
    "$AT" tune --problems "$WORK/step.json" --target "$TARGET" --trials "$TRIALS" --reps "$REPS" --db "$DB" \
        --json > "$WORK/run$run/tune.jsonl"
    echo "# run $run: tuned in $(( $(date +%s) - start )) s; bench-model, load: $(cut -d' ' -f1-3 /proc/loadavg)"
    # shellcheck disable=SC2086
    "$AT" bench-model "$PROG" --mesh "$MESH" "$AXES" --kwargs "$KW" --target "$TARGET" --db "$DB" \
        --reps "$STEP_REPS" $BENCH_ARGS --json > "$WORK/run$run/bench.json"
    echo "# run $run: done in $(( $(date +%s) - start )) s, load: $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$PY" "$HERE/bench/compare_runs.py" "$WORK/run1" "$WORK/run2"
