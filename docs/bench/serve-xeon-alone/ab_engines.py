"""The EAGLE pair's engine (untrained head, speculate auto) and the target alone's in one process, on one
target, the same loads alternating (A B B A), without Serve: is the head-less engine's plain path slower,
as the Serve runs of docs/benchmarks.md section 7 (the seventh session) suggest?

    .venv/bin/python docs/bench/serve-xeon-alone/ab_engines.py /tmp/randhead [target-first]

The engine built first compiles the graphs; the second reuses them (one runtime per target). With
``target-first`` the target alone's engine compiles them.
"""
import logging, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "infra" / "bench"))
from eagle.batch import BatchDecoder
from eagle.bench import load_prompts
from eagle.compile import CompileConfig
from eagle.generate import Decoder
from eagle.head import EagleHead
from eagle.runtime import use_threads
from eagle.target import load_target
from engine_load import closed_loop

logging.basicConfig(level=logging.WARNING)
use_threads(2)
target = load_target("smollm2-135m", dtype="bfloat16")
prompts = [target.encode(p.text, chat=True) for p in load_prompts(None, 16) if p.text]
engines = {}
order = (("eagle", EagleHead.from_pretrained(sys.argv[1], target)), ("target", None))
for name, head in order[::-1] if sys.argv[2:] == ["target-first"] else order:
    started = time.perf_counter()
    engines[name] = BatchDecoder(Decoder(target, head, compile=CompileConfig(mode="on", cpp_wrapper=True)), max_batch=16, graphs=(4, 8, 16))
    report = engines[name].warmup()
    print(name, "warm-up %.0f s" % (time.perf_counter() - started), "plain_ms", report.get("plain_ms"), flush=True)


def load(engine, concurrency):
    tokens, _, wall = closed_loop(engine, prompts, concurrency)
    return tokens / wall


for concurrency in (8, 1):
    for name in ("eagle", "target", "target", "eagle", "eagle", "target"):
        print(concurrency, name, "%.1f tok/s" % load(engines[name], concurrency), flush=True)
