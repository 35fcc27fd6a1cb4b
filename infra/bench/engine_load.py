"""The serving load of ``infra/bench/serve_load.py`` without Serve: one ``eagle.batch.BatchDecoder`` on the
target alone (SmolLM2 bf16, compiled), the same 16 MT-bench prompts (chat template), ``--concurrency`` at a
time (a finished request's place is taken at once), 128 new tokens, greedy. Prints tokens/s and where the
time went (prefills of admitted requests against batched steps). The engine's ceiling on this machine,
next to what the pairs serve through HTTP (docs/benchmarks.md section 7).

    .venv/bin/python infra/bench/engine_load.py --concurrency 8 --graphs 8 --threads 1 [--runs 2] [--cpp-wrapper] [--head DIR]
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
from eagle.head import EagleHead  # noqa: E402
from eagle.runtime import use_threads  # noqa: E402
from eagle.target import load_target  # noqa: E402

logger = logging.getLogger("engine_load")


def closed_loop(engine: BatchDecoder, prompts: list[list[int]], concurrency: int, step=None,
                max_new_tokens: int = 128) -> tuple[int, int, float]:
    """``prompts`` through ``engine``, ``concurrency`` at a time (a finished request's place is taken at
    once), greedy; ``step`` (default ``engine.step``) advances the engine by one step. Returns the tokens
    made, the steps taken and the wall-clock seconds."""
    queue, live, tokens, steps = list(prompts), [], 0, 0
    started = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            live.append(engine.submit(queue.pop(0), GenerationConfig(max_new_tokens=max_new_tokens)))
        (step or engine.step)()
        steps += 1
        for request in [r for r in live if r.done]:
            live.remove(request)
            tokens += sum(len(o.token_ids) for o in request.outputs)
    return tokens, steps, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8], help="one or more client counts, each run --runs times on the same engine")
    parser.add_argument("--graphs", type=int, nargs="*", default=[], help="batch_graphs (compiled plain steps per batch size)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--cpp-wrapper", action="store_true", help="compile with inductor's C++ wrapper, as the Serve pair does")
    parser.add_argument("--head", default=None, help="a head folder (save_pretrained): the EAGLE pair's engine, speculate auto; default the target alone")
    parser.add_argument("--no-autotune", action="store_true", help="compile without inductor's GEMM autotuning (eagle.compile)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_threads(args.threads)
    target = load_target("smollm2-135m", dtype="bfloat16")
    prompts = [target.encode(p.text, chat=True) for p in load_prompts(None, 16) if p.text]
    head = EagleHead.from_pretrained(args.head, target) if args.head else None
    engine = BatchDecoder(Decoder(target, head, compile=CompileConfig(mode="on", autotune=not args.no_autotune, cpp_wrapper=args.cpp_wrapper)), max_batch=args.max_batch, graphs=tuple(args.graphs))
    started = time.perf_counter()
    report = engine.warmup()
    logger.info("warm-up %.0f s; plain step ms by batch size: %s", time.perf_counter() - started, report.get("plain_ms"))
    spent = dict.fromkeys(("prefill", "head_prefill", "steps", "plain", "explore", "draft"), 0.0)
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
    if engine.heads is not None:
        engine.heads.prefill = timed("head_prefill", engine.heads.prefill)
    choose = engine.policy.choose

    def chosen(batch):  # time each step by the policy's decision (the step runs until the next choose or step end)
        decision = choose(batch)
        chosen.last = decision
        return decision
    engine.policy.choose = chosen

    def step():
        chosen.last = "plain"
        t = time.perf_counter()
        engine.step()
        spent[chosen.last] += time.perf_counter() - t  # includes any prefill of this step

    for concurrency in [c for c in args.concurrency for _ in range(args.runs)]:
        spent.update(dict.fromkeys(spent, 0.0))
        decisions = dict(engine.policy.decisions)
        tokens, steps, wall = closed_loop(engine, prompts, concurrency, step)
        # the target alone never asks the policy: every step is plain
        made = {k: v - decisions.get(k, 0) for k, v in engine.policy.decisions.items()} if head else {"plain": steps}
        logger.info("%s, concurrency %d, graphs %s, %d thread(s), autotune %s: %d tokens in %.2f s = %.1f tok/s; %d steps; prefills %.2f s (the head's %.2f), batched steps %.2f s; "
                    "by decision (s, prefills included): plain %.2f, explore %.2f, draft %.2f; decisions %s",
                    "EAGLE pair" if head else "target alone", concurrency, args.graphs, args.threads, not args.no_autotune, tokens, wall, tokens / wall, steps,
                    spent["prefill"], spent["head_prefill"], spent["steps"], spent["plain"], spent["explore"], spent["draft"], made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
