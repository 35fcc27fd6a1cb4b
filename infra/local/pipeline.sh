#!/usr/bin/env bash
# The head-training pipeline on the local stack, every stage through `ray job submit` (what a user runs
# against a real cluster): data -> features -> training (registers <target>-eagle@candidate) -> evaluation
# (logs tau and speedup to the training run; promotes to @production when the preset's threshold is met).
#
#   infra/local/pipeline.sh [--preset quick] [--target smollm2-135m] [extra args for every job...]
#
# Needs the stack (`make stack-up`); reads its env from infra/local/stack.sh.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
source "$REPO_ROOT/infra/local/venv.sh"
PRESET=quick
ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --preset) PRESET="$2"; shift 2 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
eval "$(infra/local/stack.sh env)"
export RAY_AUTH_MODE=token
# the preset name travels as an argument, never pasted into code; an unknown one fails here in one line
PROMOTE_TAU="$(python -c '
import sys
from eagle.errors import EagleError
from jobs.presets import get_preset
try:
    tau = get_preset(sys.argv[1]).eval.promote_tau
except EagleError as err:
    sys.exit(f"pipeline: error: {err}")
print("" if tau is None else tau)' "$PRESET")"

submit() {
    local started=$SECONDS
    echo "pipeline: $* (preset $PRESET)" >&2
    ray job submit --address "$RAY_API_SERVER_ADDRESS" --working-dir . \
        --runtime-env-json "{\"env_vars\": {\"MLFLOW_TRACKING_URI\": \"$MLFLOW_TRACKING_URI\", \"HF_HUB_OFFLINE\": \"1\"}}" \
        -- python -m "$@" --preset "$PRESET" ${ARGS[@]+"${ARGS[@]}"}
    echo "pipeline: $1 took $((SECONDS - started)) s" >&2
}

submit jobs.prepare_data
submit jobs.featurize
submit jobs.train_head
if [[ -n "$PROMOTE_TAU" ]]; then
    submit jobs.evaluate --promote-tau "$PROMOTE_TAU"
else
    submit jobs.evaluate
fi
