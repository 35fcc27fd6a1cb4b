#!/usr/bin/env bash
# Issue 41's table in one run, one engine after another on this machine (a benchmark, not a test: about an
# hour on 2 cores, plus llama.cpp's build the first time):
#
#   infra/bench/eagle_pays.sh HEAD LABEL [OUT]   HEAD: a head directory or models:/<target>-eagle@<alias>
#                                                OUT:  default docs/bench/eagle-pays
#
#   1. eaglectl prompts: all 80 MT-bench first turns, the first 40 HumanEval stubs (token ids, every engine)
#   2. infra/bench/eagle_pays.py: EAGLE (default tree, --speculate auto) against our plain loop, side by side,
#      at the dtype `auto` picks here, 2 threads, compiled, 128 new tokens: MT-bench T=0, HumanEval T=0,
#      MT-bench T=1
#   3. vLLM's CPU build (plain, one request at a time) at the same dtype, and llama.cpp on the package's GGUF,
#      on both prompt sets (infra/bench/peers.sh, their own venvs)
#   4. infra/bench/combine.py: OUT/summary-LABEL.{json,md}
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
HEAD="${1:?usage: infra/bench/eagle_pays.sh HEAD LABEL [OUT]}"
LABEL="${2:?usage: infra/bench/eagle_pays.sh HEAD LABEL [OUT]}"
OUT="${3:-docs/bench/eagle-pays}"
PY=.venv/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
lscpu >"$OUT/lscpu-$LABEL.txt"
for spec in mtbench:80 humaneval:40; do
    set_name="${spec%:*}"
    [[ -f "$OUT/prompts-$set_name${spec#*:}.jsonl" ]] || .venv/bin/eaglectl prompts --set "$set_name" --limit "${spec#*:}" --out "$OUT/prompts-$set_name${spec#*:}.jsonl"
done
DTYPE="$($PY -c 'from eagle.runtime import preferred_dtype; print(str(preferred_dtype("auto")).removeprefix("torch."))')"

$PY infra/bench/eagle_pays.py --head "$HEAD" --label "$LABEL" --runs mtbench:80:0 humaneval:40:0 mtbench:80:1 --out "$OUT"
OURS=(
    "mtbench/T0=$OUT/$LABEL-default-mtbench80-T0-$DTYPE.json"
    "humaneval/T0=$OUT/$LABEL-default-humaneval40-T0-$DTYPE.json"
    "mtbench/T1=$OUT/$LABEL-default-mtbench80-T1-$DTYPE.json"
)

MODEL="$($PY -c 'from eagle.target import materialize_builtin; print(materialize_builtin("smollm2-135m")[0])')"
GGUF="$($PY -c 'from eagle.target import BUILTIN_TARGETS, _builtin_gguf_path; print(_builtin_gguf_path(BUILTIN_TARGETS["smollm2-135m"]))')"
PEERS=()
for spec in mtbench80 humaneval40; do
    set_name="${spec%%[0-9]*}"
    infra/bench/peers.sh vllm --model "$MODEL" --dtype "$DTYPE" --prompts "$OUT/prompts-$spec.jsonl" --max-tokens 128 --concurrency 1 \
        --out "$OUT/vllm-$spec-$DTYPE.json"
    infra/bench/peers.sh llamacpp --gguf "$GGUF" --prompts "$OUT/prompts-$spec.jsonl" --max-tokens 128 --threads 2 --out "$OUT/llamacpp-$spec.json"
    PEERS+=("vllm/$set_name=$OUT/vllm-$spec-$DTYPE.json" "llamacpp/$set_name=$OUT/llamacpp-$spec.json")
done
$PY infra/bench/combine.py --ours "${OURS[@]}" --peer "${PEERS[@]}" --out "$OUT/summary-$LABEL.json"
