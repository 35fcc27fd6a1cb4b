"""Answer regeneration throughput, side by side in one process: HF ``generate`` in length-sorted batches (the
default, ``regen_engine="hf"``) against this engine's continuous batching (``regen_engine="eagle"``), on the
same ShareGPT first turns, the same target and dtype. Writes JSON (answer tokens/s, wasted row-steps).

    .venv/bin/python infra/bench/regen.py --prompts 48 --max-new-tokens 256 --batch-size 16 --out docs/bench/regen/regen.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch

from eagle.data import load_sharegpt
from eagle.target import load_target
from jobs.prepare_data import chat_prompt, generate_answers

logger = logging.getLogger("regen_bench")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    conversations = [c for c in load_sharegpt(limit=4 * args.prompts) if c.turns and c.turns[0][0] == "user"]
    prompts = [chat_prompt(target.tokenizer, [{"role": "user", "content": c.turns[0][1]}]) for c in conversations]
    prompts = [p for p in prompts if len(p) < args.max_length // 2][: args.prompts]
    result = {
        "target": args.target, "dtype": args.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "engines": {},
    }
    for engine in ("hf", "eagle"):
        started = time.perf_counter()
        answers = generate_answers(
            target, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, max_length=args.max_length, engine=engine,
        )
        seconds = time.perf_counter() - started
        tokens = sum(len(a) for a in answers)
        result["engines"][engine] = {
            "answer_tokens": tokens, "seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 2),
            "finished_answers": sum(1 for a in answers if a and a[-1] in target.eos_token_ids),
            "answers": answers,
        }
        logger.info("%s: %d answer tokens in %.1f s = %.1f tok/s", engine, tokens, seconds, tokens / seconds)
    hf, ours = result["engines"]["hf"], result["engines"]["eagle"]
    result["speedup_eagle_vs_hf"] = round(ours["tokens_per_second"] / hf["tokens_per_second"], 3)
    result["answers_equal"] = sum(a == b for a, b in zip(hf["answers"], ours["answers"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    logger.info("eagle / hf = %.2fx; %d of %d answers equal (bf16 ties may differ)", result["speedup_eagle_vs_hf"], result["answers_equal"], len(prompts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
