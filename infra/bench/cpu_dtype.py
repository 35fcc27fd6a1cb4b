"""bf16 against fp32 on this CPU, side by side in one process: what ``"auto"`` precision decides from
(``eagle.runtime.native_bf16``). docs/benchmarks.md section 12.

1. GEMM throughput of SmolLM2's MLP shape ([M, 576] x [576, 1536], ``F.linear``) at M = 1 .. 256 rows, bf16
   and fp32 (M is the batch rows of a decode step, or the tokens of a prefill or a feature batch);
2. answer regeneration as ``jobs.prepare_data`` runs it (``generate_answers(engine="eagle")``, the batch
   decoder) on the same ShareGPT first turns, target loaded in bf16 and in fp32.

    .venv/bin/python infra/bench/cpu_dtype.py --prompts 48 --batch-size 48 --out docs/bench/cpu-dtype/cpu-dtype.json

A benchmark, not a test (a few minutes on 2 cores; bf16 regeneration is the slow half on CPUs without
native bf16).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle.data import load_sharegpt
from eagle.profile import machine
from eagle.runtime import native_bf16, preferred_dtype, use_threads
from eagle.target import load_target
from jobs.prepare_data import chat_prompt, generate_answers

logger = logging.getLogger("cpu_dtype")
ROWS = (1, 8, 16, 32, 64, 128, 256)


def gemm_gflops(rows: int, dtype: torch.dtype, repeats: int = 20) -> float:
    weight = torch.randn(1536, 576).to(dtype)
    x = torch.randn(rows, 576).to(dtype)
    F.linear(x, weight)
    started = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, weight)
    seconds = (time.perf_counter() - started) / repeats
    return round(2 * rows * 576 * 1536 / seconds / 1e9, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--max-length", type=int, default=640)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = use_threads(args.threads)
    result = {
        "command": "infra/bench/cpu_dtype.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "machine": {**machine(), "threads": threads, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "platform": platform.platform()},
        "native_bf16": native_bf16(), "auto_dtype": preferred_dtype("auto"),
        "gemm_gflops": {name: {rows: gemm_gflops(rows, dtype) for rows in ROWS} for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))},
        "regeneration": {},
    }
    logger.info("GEMM GFLOPS: %s", result["gemm_gflops"])
    tokenizer = load_target("smollm2-135m", dtype="float32").tokenizer
    conversations = [c for c in load_sharegpt(limit=4 * args.prompts) if c.turns and c.turns[0][0] == "user"]
    prompts = [chat_prompt(tokenizer, [{"role": "user", "content": c.turns[0][1]}]) for c in conversations]
    prompts = [p for p in prompts if len(p) < args.max_length][: args.prompts]
    for dtype in ("float32", "bfloat16"):
        target = load_target("smollm2-135m", dtype=dtype)
        started = time.perf_counter()
        answers = generate_answers(target, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   max_length=args.max_length, engine="eagle")
        seconds = time.perf_counter() - started
        tokens = sum(len(a) for a in answers)
        result["regeneration"][dtype] = {"prompts": len(prompts), "answer_tokens": tokens, "seconds": round(seconds, 1),
                                         "tokens_per_second": round(tokens / seconds, 1)}
        logger.info("regeneration in %s: %d answer tokens in %.1f s = %.1f tok/s", dtype, tokens, seconds, tokens / seconds)
    regen = result["regeneration"]
    result["regeneration_fp32_vs_bf16"] = round(regen["float32"]["tokens_per_second"] / regen["bfloat16"]["tokens_per_second"], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    logger.info("fp32 / bf16 regeneration: %.2fx; auto picks %s", result["regeneration_fp32_vs_bf16"], result["auto_dtype"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
