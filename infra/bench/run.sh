#!/usr/bin/env bash
# The fast-path table of docs/benchmarks.md section 6, every engine on the same token-id prompts, one run
# after another on this machine (a benchmark, not a test: ~1 hour on 2 cores):
#
#   infra/bench/run.sh HEAD [OUT]      HEAD: a head directory or models:/<target>-eagle@<alias>
#                                      OUT:  default docs/bench/fast
#
#   1. eaglectl prompts: MT-bench first turns (40, 5 per category), HumanEval (20), the repetition set (16)
#   2. eaglectl bench (bf16, 2 threads, compiled): plain, EAGLE, HF generate and HF prompt lookup per set;
#      the hybrid and auto trees and T=1 on MT-bench; the hybrid tree on the repetition set
#   3. vLLM's CPU build and llama.cpp on MT-bench and HumanEval (infra/bench/peers.sh, their own venvs)
#   4. infra/bench/combine.py: OUT/summary.{json,md}
# Set SKIP_PEERS=1 to leave out step 3.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
HEAD="${1:?usage: infra/bench/run.sh HEAD [OUT]}"
OUT="${2:-docs/bench/fast}"
PY=.venv/bin/python
EAGLECTL=.venv/bin/eaglectl
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
for spec in mtbench:40 humaneval:20 repetition:16; do
    set_name="${spec%:*}"
    [[ -f "$OUT/prompts-$set_name.jsonl" ]] || "$EAGLECTL" prompts --set "$set_name" --limit "${spec#*:}" --out "$OUT/prompts-$set_name.jsonl"
done

bench() {  # bench SET LABEL ARGS...: one side-by-side run
    local set_name="$1" label="$2"; shift 2
    echo "bench: $set_name/$label" >&2
    "$EAGLECTL" bench --head "$HEAD" --prompts "$OUT/prompts-$set_name.jsonl" --dtype bfloat16 --threads 2 --compile on \
        --max-new-tokens 128 "$@" --out "$OUT/ours-$set_name-$label.json" >/dev/null
    OURS+=("$set_name/$label=$OUT/ours-$set_name-$label.json")
}
OURS=()
bench mtbench dynamic --tree dynamic --baselines hf,prompt-lookup
bench mtbench hybrid --tree hybrid --baselines ''
bench mtbench auto --tree auto --baselines ''
bench mtbench dynamic-T1 --tree dynamic --temperature 1 --baselines ''
bench humaneval dynamic --tree dynamic --baselines hf,prompt-lookup
bench repetition dynamic --tree dynamic --baselines prompt-lookup
bench repetition hybrid --tree hybrid --baselines ''

PEERS=()
if [[ -z "${SKIP_PEERS:-}" ]]; then
    MODEL="$($PY -c 'from eagle.target import materialize_builtin; print(materialize_builtin("smollm2-135m")[0])')"
    GGUF="$($PY -c 'from eagle.target import BUILTIN_TARGETS, _builtin_gguf_path; print(_builtin_gguf_path(BUILTIN_TARGETS["smollm2-135m"]))')"
    for set_name in mtbench humaneval; do
        infra/bench/peers.sh vllm --model "$MODEL" --prompts "$OUT/prompts-$set_name.jsonl" --max-tokens 128 --concurrency 1 8 --out "$OUT/vllm-$set_name.json"
        infra/bench/peers.sh llamacpp --gguf "$GGUF" --prompts "$OUT/prompts-$set_name.jsonl" --max-tokens 128 --threads 2 --out "$OUT/llamacpp-$set_name.json"
        PEERS+=("vllm/$set_name=$OUT/vllm-$set_name.json" "llamacpp/$set_name=$OUT/llamacpp-$set_name.json")
    done
fi
$PY infra/bench/combine.py --ours "${OURS[@]}" --peer ${PEERS[@]+"${PEERS[@]}"} --out "$OUT/summary.json"
