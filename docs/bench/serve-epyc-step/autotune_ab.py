"""Both compiles (autotune on / off) of the plain step at the given row counts in one process, timed alternately (step-cost.txt).

    .venv/bin/python docs/bench/serve-epyc-step/autotune_ab.py 8 16 4
"""
import sys, time, logging, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch
from eagle.compile import CompileConfig
from eagle.runtime import TargetRuntime, step_inputs, use_threads
from eagle.target import load_target
logging.basicConfig(level=logging.INFO)
use_threads(2)
sizes = [int(x) for x in sys.argv[1:]] or [8]
target = load_target("smollm2-135m", dtype="bfloat16")
rts = {a: TargetRuntime(target, CompileConfig(mode="on", autotune=a, cpp_wrapper=True)) for a in (True, False)}
ctx = 128
for b in sizes:
    cache = rts[True].new_cache(512, rows=b)
    ids, pos, slots, mask = step_inputs(1, ctx, target.device)
    rows = lambda t: t.expand(b, *t.shape[1:]).contiguous()
    args = (rows(ids), rows(pos), rows(slots[None]), rows(mask))
    fns = {"autotune": rts[True].rows_step(b), "no-autotune": rts[False].rows_step(b), "eager-packed": rts[True].rows_model.step_rows}
    for f in fns.values():
        with torch.inference_mode():
            f(*args, cache.keys, cache.values)
    times = {k: [] for k in fns}
    for r in range(40):
        for k, f in fns.items():
            t = time.perf_counter()
            with torch.inference_mode():
                f(*args, cache.keys, cache.values)
            times[k].append((time.perf_counter() - t) * 1e3)
    print("batch", b, {k: round(statistics.median(v), 2) for k, v in times.items()}, flush=True)
