#!/usr/bin/env bash
# Our head inside vLLM: export it (`eaglectl head export --to vllm`), decode the same prompts with vLLM's CPU
# build (method "eagle" for an eagle1 head, "eagle3" for an eagle3 head; a chain of K drafted tokens) and with
# our engine (a K-deep top-1 chain, the tree vLLM drafts), both greedy in float32, and compare acceptance
# (tokens per verification step) and outputs.
#
#   infra/bench/vllm_eagle.sh HEAD_DIR [OUT] [K] [PROMPTS]    (make bench-vllm-eagle HEAD=...)
#
# HEAD_DIR must be exportable: an eagle1 head without fc bias or input norm over the whole vocabulary (train
# it with `jobs.train_head --draft-vocab-size 0`), or any eagle3 head on a Llama target. A benchmark, not a
# test: it installs vLLM's virtualenv on first use.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
HEAD="${1:?usage: infra/bench/vllm_eagle.sh HEAD_DIR [OUT] [K] [PROMPTS]}"
OUT="${2:-docs/bench/vllm-eagle}"
K="${3:-3}"
LIMIT="${4:-20}"
PY=.venv/bin/python
EAGLECTL=.venv/bin/eaglectl
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
KIND="$($PY -c 'import sys; from eagle.head import HeadConfig; print(HeadConfig.read(sys.argv[1]).kind)' "$HEAD")"
METHOD=eagle; [[ "$KIND" == eagle3 ]] && METHOD=eagle3

EXPORTED="$(mktemp -d)/head-vllm"  # the exported head (~17 MB for SmolLM2) stays out of docs/
trap 'rm -rf "$(dirname "$EXPORTED")"' EXIT
"$EAGLECTL" head export --to vllm "$HEAD" "$EXPORTED" >/dev/null
[[ -f "$OUT/prompts-mtbench.jsonl" ]] || "$EAGLECTL" prompts --set mtbench --limit "$LIMIT" --out "$OUT/prompts-mtbench.jsonl"
MODEL="$($PY -c 'from eagle.target import materialize_builtin; print(materialize_builtin("smollm2-135m")[0])')"

echo "ours ($KIND): chain of $K, float32" >&2
"$EAGLECTL" bench --head "$HEAD" --prompts "$OUT/prompts-mtbench.jsonl" --dtype float32 --threads 2 --compile off \
    --tree dynamic --depth "$K" --top-k-draft 1 --total-tokens "$K" --max-new-tokens 128 --baselines '' \
    --out "$OUT/ours-$KIND-chain$K.json" >/dev/null

echo "vllm: method $METHOD, $K speculative tokens, float32" >&2
SPEC="{\"method\": \"$METHOD\", \"model\": \"$EXPORTED\", \"num_speculative_tokens\": $K}"
infra/bench/peers.sh vllm --model "$MODEL" --prompts "$OUT/prompts-mtbench.jsonl" --dtype float32 --max-tokens 128 \
    --concurrency 1 --speculative "$SPEC" --out "$OUT/vllm-$METHOD-chain$K.json"
infra/bench/peers.sh vllm --model "$MODEL" --prompts "$OUT/prompts-mtbench.jsonl" --dtype float32 --max-tokens 128 \
    --concurrency 1 --out "$OUT/vllm-plain.json"

"$PY" - "$OUT" "$K" "$KIND" "$METHOD" <<'EOF'
"""Side by side: acceptance, speed and output equality of the two runs (written to OUT/compare.json)."""
import json
import sys
from pathlib import Path

out, k, kind, method = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
ours = json.loads((out / f"ours-{kind}-chain{k}.json").read_text())
vllm = json.loads((out / f"vllm-{method}-chain{k}.json").read_text())
plain = json.loads((out / "vllm-plain.json").read_text())
spec = vllm["concurrency"]["1"]["spec_decode"]
eagle = ours["aggregate"]["methods"]["eagle"]
same_plain = sum(vllm["outputs"][i] == plain["outputs"][i] for i in vllm["outputs"])
record = {
    "k": int(k), "prompts": len(vllm["outputs"]), "dtype": "float32", "head_kind": kind, "vllm_method": method,
    "ours": {"tokens_per_step": round(eagle["tokens"] / eagle["steps"], 4), "tokens_per_second": round(eagle["tokens_per_second"], 2),
             "plain_tokens_per_second": round(ours["aggregate"]["methods"]["plain"]["tokens_per_second"], 2),
             "outputs_match_plain_rate": ours["aggregate"]["outputs_match_plain_rate"]},
    "vllm_eagle": {"mean_acceptance_length": spec.get("mean_acceptance_length"), "accepted_per_position": spec.get("accepted_per_position"),
                   "drafts": spec.get("num_drafts"), "tokens_per_second": vllm["concurrency"]["1"]["tokens_per_second"]},
    "vllm_plain": {"tokens_per_second": plain["concurrency"]["1"]["tokens_per_second"]},
    "vllm_eagle_outputs_equal_vllm_plain": f"{same_plain}/{len(vllm['outputs'])}",
}
(out / f"compare-{kind}.json").write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps(record, indent=1))
EOF
