"""The serving load of ``infra/bench/serve_load.py`` without Serve: one ``eagle.batch.BatchDecoder`` on the
target alone (SmolLM2 bf16, compiled), the same 16 MT-bench prompts (chat template), ``--concurrency`` at a
time (a finished request's place is taken at once), 128 new tokens, greedy. Prints tokens/s and where the
time went (prefills of admitted requests against batched steps). The engine's ceiling on this machine,
next to what the pairs serve through HTTP (docs/benchmarks.md section 7).

    .venv/bin/python infra/bench/engine_load.py --concurrency 8 --graphs 8 --threads 1 [--runs 2] [--cpp-wrapper]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eagle.batch import BatchDecoder  # noqa: E402
from eagle.compile import CompileConfig  # noqa: E402
from eagle.bench import load_prompts  # noqa: E402
from eagle.generate import Decoder, GenerationConfig  # noqa: E402
from eagle.runtime import use_threads  # noqa: E402
from eagle.target import load_target  # noqa: E402

logger = logging.getLogger("engine_load")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--graphs", type=int, nargs="*", default=[], help="batch_graphs (compiled plain steps per batch size)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--cpp-wrapper", action="store_true", help="compile with inductor's C++ wrapper, as the Serve pair does")
    parser.add_argument("--no-autotune", action="store_true", help="compile without inductor's GEMM autotuning (eagle.compile)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_threads(args.threads)
    target = load_target("smollm2-135m", dtype="bfloat16")
    prompts = [target.encode(p.text, chat=True) for p in load_prompts(None, 16) if p.text]
    engine = BatchDecoder(Decoder(target, None, compile=CompileConfig(mode="on", autotune=not args.no_autotune, cpp_wrapper=args.cpp_wrapper)), max_batch=args.max_batch, graphs=tuple(args.graphs))
    started = time.perf_counter()
    report = engine.warmup()
    logger.info("warm-up %.0f s; plain step ms by batch size: %s", time.perf_counter() - started, report.get("plain_ms"))
    spent = {"prefill": 0.0, "steps": 0.0}
    admit, advance = engine._admit, engine._advance

    def timed(name, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        return run

    engine._admit, engine._advance = timed("prefill", admit), timed("steps", advance)
    for _ in range(args.runs):
        spent.update(prefill=0.0, steps=0.0)
        queue, live, tokens, steps = list(prompts), [], 0, 0
        started = time.perf_counter()
        while queue or live:
            while queue and len(live) < args.concurrency:
                live.append(engine.submit(queue.pop(0), GenerationConfig(max_new_tokens=128)))
            engine.step()
            steps += 1
            for request in [r for r in live if r.done]:
                live.remove(request)
                tokens += sum(len(o.token_ids) for o in request.outputs)
        wall = time.perf_counter() - started
        logger.info("concurrency %d, graphs %s, %d thread(s), autotune %s: %d tokens in %.2f s = %.1f tok/s; %d steps; prefills %.2f s, batched steps %.2f s",
                    args.concurrency, args.graphs, args.threads, not args.no_autotune, tokens, wall, tokens / wall, steps, spent["prefill"], spent["steps"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
