#!/usr/bin/env bash
# The CUDA path on one GPU, in one bounded run from the repository root, on any machine with one NVIDIA GPU
# and the package index at hand. At most 9 minutes: the steps' limits add up to 540 s (install 150, GPU 30,
# losslessness 60, stack 45 + 15, training 180, bench 60); a step past its limit is recorded as timed_out;
# not yet run on a GPU: no GPU was lent to the sessions that wrote it (docs/benchmarks.md says so).
#
#   infra/gpu/check.sh [OUT_DIR]        # default results/gpu-check
#
# 1. install: `make install` (the lock's torch==2.13.0 from the package index is a CUDA build on Linux),
#    unless EAGLE_PYTHON names a Python that already holds the project's dependencies (then the repository
#    is put on its PYTHONPATH).
# 2. losslessness on CUDA: tests/test_lossless_greedy.py and tests/test_lossless_sampling.py (fast cases)
#    with their tiny targets on the GPU (EAGLE_TEST_DEVICE=cuda, tests/tiny.py).
# 3. a short SmolLM2 head training on the GPU: the local stack (Ray head + MLflow on 127.0.0.1), then preset
#    `gpu-smoke` through infra/local/pipeline.sh: answers regenerated on the GPU (data.regen_gpus), features
#    and training by one Ray Train worker each on it (NCCL), the gated evaluation on it; the stack stopped.
# 4. the bench on the GPU: `eaglectl bench --device cuda`, bf16, plain vs EAGLE (the head step 3 registered)
#    vs HF generate, 5 MT-bench prompts x 64 tokens.
#
# Writes OUT_DIR/check.json (each step: status, seconds, log file) beside the logs and OUT_DIR/bench.json.
# Exit code: 0 when every step passed, 1 otherwise (the steps after a failed one still run where they can).
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
OUT_DIR="${1:-results/gpu-check}"
mkdir -p "$OUT_DIR"
STEPS="$OUT_DIR/steps.jsonl"
: > "$STEPS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME LIMIT_S command...: run with a time limit, log to OUT_DIR/NAME.log, record the outcome
    local name="$1" limit="$2"; shift 2
    local started=$SECONDS status
    echo "gpu-check: $name (limit ${limit} s)" >&2
    timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    if [[ $rc -eq 0 ]]; then status=passed; elif [[ $rc -eq 124 || $rc -eq 137 ]]; then status=timed_out; else status=failed; fi
    printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %d, "log": "%s.log"}\n' "$name" "$status" "$rc" $((SECONDS - started)) "$name" >> "$STEPS"
    echo "gpu-check: $name $status in $((SECONDS - started)) s" >&2
    return $rc
}

finish() {  # write OUT_DIR/check.json from the steps recorded so far, print it, exit 0 if every step passed
    "$PY" - "$STEPS" "$OUT_DIR/check.json" "$OUT_DIR/gpu.log" <<'PY'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
gpu_ok = any(s["step"] == "gpu" and s["status"] == "passed" for s in steps)
result = {"gpu": json.loads(open(sys.argv[3]).read().strip().splitlines()[-1]) if gpu_ok else None,
          "steps": steps, "passed": all(s["status"] == "passed" for s in steps)}
json.dump(result, open(sys.argv[2], "w"), indent=2)
print(json.dumps(result, indent=2))
sys.exit(0 if result["passed"] else 1)
PY
    exit $?
}

if [[ -n "${EAGLE_PYTHON:-}" ]]; then
    PY="$EAGLE_PYTHON"
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    BIN_DIR="$(dirname "$(command -v "$PY")")"
else
    step install 150 make install
    PY="$REPO_ROOT/.venv/bin/python"
    BIN_DIR="$REPO_ROOT/.venv/bin"
fi
export PATH="$BIN_DIR:$PATH"

step gpu 30 "$PY" -c '
import json, sys, torch
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU is visible to torch " + torch.__version__)
props = torch.cuda.get_device_properties(0)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}))
' || finish  # no GPU: nothing after this can run

step lossless 60 env EAGLE_TEST_DEVICE=cuda "$PY" -m pytest -q -x -m "not slow" -p no:cacheprovider \
    tests/test_lossless_greedy.py tests/test_lossless_sampling.py --junitxml "$OUT_DIR/lossless.xml"

# the head training: the local stack, the gpu-smoke pipeline, the stack stopped again (whatever happened)
step stack-up 45 infra/local/stack.sh up
step train 180 infra/local/pipeline.sh --preset gpu-smoke
eval "$(infra/local/stack.sh env)"
step bench 60 "$BIN_DIR/eaglectl" bench --device cuda --dtype bfloat16 --head "models:/smollm2-135m-eagle@candidate" \
    --limit 5 --max-new-tokens 64 --baselines hf --out "$OUT_DIR/bench.json"
step stack-down 15 infra/local/stack.sh down

finish
