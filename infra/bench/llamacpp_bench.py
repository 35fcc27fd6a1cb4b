"""llama.cpp (llama-cpp-python) on the prompts our bench uses, one request at a time: the absolute speed
reference for the same GGUF file on this CPU. Runs in its own virtualenv (``infra/bench/peers.sh llamacpp
...``), reads the token-id prompt file ``eaglectl prompts`` writes (SmolLM2's GGUF vocabulary has the same
ids), writes JSON. No import from this project.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("llamacpp_bench")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import llama_cpp

    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, seed=0, verbose=False)
    eos = llm.token_eos()

    def run(ids: list[int]) -> tuple[list[int], float]:
        llm.reset()  # no prefix reuse across prompts
        began = time.perf_counter()
        out = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token == eos:
                out.append(token)
                break
            out.append(token)
            if len(out) >= args.max_tokens:
                break
        return out, time.perf_counter() - began

    run(prompts[0]["token_ids"])  # warm-up
    tokens, seconds, outputs = 0, 0.0, {}
    for prompt in prompts:
        out, took = run(prompt["token_ids"])
        tokens += len(out)
        seconds += took
        outputs[prompt["id"]] = out
    result = {
        "engine": "llama.cpp", "version": llama_cpp.__version__, "gguf": args.gguf, "threads": args.threads, "prompts": len(prompts),
        "max_tokens": args.max_tokens, "concurrency": {"1": {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)}},
        "outputs": outputs,
    }
    logger.info("%d tokens in %.1f s = %.1f tok/s", tokens, seconds, tokens / seconds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
