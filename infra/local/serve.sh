#!/usr/bin/env bash
# `make serve`: the default pairs (serve/config.yaml) on http://127.0.0.1:8000 in the foreground.
#
#   infra/local/serve.sh [CONFIG]      (default serve/config.yaml)
#
# Starts the local stack (Ray head + MLflow, infra/local/stack.sh) when it is not running, checks the config
# (python -m serve.preflight: every pair's target and registry head resolve), then `serve run` against the
# stack's Ray head. Ctrl-C removes the Serve application, and stops the stack if this script started it.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
CONFIG="${1:-serve/config.yaml}"
source "$REPO_ROOT/infra/local/venv.sh"
started_stack=0
if ! infra/local/stack.sh status >/dev/null 2>&1; then
    infra/local/stack.sh up >/dev/null
    started_stack=1
fi
cleanup() {
    if [[ $started_stack == 1 ]]; then
        infra/local/stack.sh down || true
    fi
}
trap cleanup EXIT
eval "$(infra/local/stack.sh env)"
export HF_HUB_OFFLINE=1
python -m serve.preflight "$CONFIG"
echo "serve: http://127.0.0.1:8000/v1 (OpenAI API; GET /v1/models lists the pairs); Ctrl-C stops" >&2
serve run "$CONFIG" --address "$RAY_ADDRESS"
