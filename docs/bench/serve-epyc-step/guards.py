"""Each compiled step with and without skip_guard_eval_unsafe: what dynamo's guards cost a call (step-cost.txt).

    .venv/bin/python docs/bench/serve-epyc-step/guards.py
"""
import sys, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch
from eagle.compile import CompileConfig
from eagle.runtime import TargetRuntime, step_inputs, use_threads
from eagle.target import load_target
use_threads(2)
target = load_target("smollm2-135m", dtype="bfloat16")
rt = TargetRuntime(target, CompileConfig(mode="on", autotune=False, cpp_wrapper=True))
setups = {}
for b in (4, 8, 16):
    cache = rt.new_cache(512, rows=b)
    ids, pos, slots, mask = step_inputs(1, 128, target.device)
    rows = lambda t: t.expand(b, *t.shape[1:]).contiguous()
    setups[b] = (rt.rows_step(b), (rows(ids), rows(pos), rows(slots[None]), rows(mask), cache.keys, cache.values))
    setups[b][0](*setups[b][1])
one_cache = rt.new_cache(512, rows=1)
ids, pos, slots, mask = step_inputs(1, 128, target.device)
setups[1] = (rt.step(1), (ids, pos, slots, mask, one_cache.keys, one_cache.values))
setups[1][0](*setups[1][1])
for rep in range(2):
    for skip in (False, True):
        res = {}
        for b, (f, args) in setups.items():
            ts = []
            for _ in range(30):
                t = time.perf_counter()
                with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=skip):
                    f._compiled(*args)
                ts.append((time.perf_counter() - t) * 1e3)
            res[b] = round(statistics.median(ts), 2)
        print("skip" if skip else "guards", res, flush=True)
