"""The 30 layers' 210 prepacked linears one after another at M rows: what streaming the weights costs (step-cost.txt).

    .venv/bin/python docs/bench/serve-epyc-step/cold.py
"""
import sys, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn.functional as F
from eagle.runtime import PackedLinear, use_threads
use_threads(2)
torch.manual_seed(0)
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
lins = [torch.nn.Linear(i, o, bias=False).to(torch.bfloat16) for _ in range(30) for (o, i) in shapes]
packed = [PackedLinear(l) for l in lins]
def run(m, kind):
    xs = {i: torch.randn(m, i, dtype=torch.bfloat16) for i in (576, 1536)}
    def once():
        for l, p in zip(lins, packed):
            x = xs[l.in_features]
            if kind == "packed": p(x)
            elif kind == "F": F.linear(x, l.weight)
            elif kind == "halves": p(x[: m // 2]); p(x[m // 2:])
    for _ in range(2): once()
    ts = []
    for _ in range(15):
        t = time.perf_counter(); once(); ts.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(ts), 2)
with torch.inference_mode():
    for m in (1, 2, 4, 6, 8, 12, 16):
        print(m, {k: run(m, k) for k in ("packed", "F") + (("halves",) if m >= 8 else ())}, flush=True)
