"""The runs in one-pair.txt (docs/benchmarks.md section 7, 2026-12-05): one target-alone pair behind Serve
(2 or 1 threads, the listed batch graphs, 0.1 s stream chunks), the same client and prompts as
infra/bench/serve_load.py, and the decode step's time inside the replica: the responses' ``eagle.verify_s``
summed over requests is the time the replica spent in batched steps (each step's time is split over its rows).

``--budget B`` (docs/benchmarks.md section 7, 'A chunk budget per replica', two-pairs.txt in
docs/bench/serve-epyc-budget/): a second target-alone pair, "budget", alike but for ``stream_chunks_per_s``
B, and each concurrency measured in ``--order`` (A: the first pair, B: "budget").

    RAY_worker_niceness=0 (the nice-0 run only) .venv/bin/python docs/bench/serve-epyc/one_pair.py \
        --threads 2 --graphs 4 8 16 --conc 8 1 4 16
    .venv/bin/python docs/bench/serve-epyc/one_pair.py --threads 2 --graphs 4 8 16 --conc 8 4 --budget 16 --order ABBA
"""
import asyncio, json, os, sys, time, argparse, logging
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "infra/bench"))
import httpx
import serve.loadtest as lt
from serve_load import cpu_seconds, cpu_spent, wait_ready
from eagle.bench import load_prompts

async def one_request(client, base, model, prompt, max_tokens, timeout_s):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter(); first = None
    rec = {"status": None, "tokens": 0, "tau": None, "error": None}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout_s) as r:
        rec["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]": continue
            ch = json.loads(line[6:])
            if ch.get("choices") and ch["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - started
            if "eagle" in ch: rec["eagle"] = ch["eagle"]
            if ch.get("usage"): rec["tokens"] = ch["usage"]["completion_tokens"]
    rec["latency_s"] = time.perf_counter() - started; rec["ttft_s"] = first
    return rec
lt.one_request = one_request

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2); p.add_argument("--graphs", type=int, nargs="*", default=[16])
p.add_argument("--interval", type=float, default=0.1); p.add_argument("--conc", type=int, nargs="+", default=[8, 1])
p.add_argument("--spy", action="store_true")
p.add_argument("--budget", type=float, default=None); p.add_argument("--order", default="A")
a = p.parse_args()
logging.basicConfig(level=logging.INFO)
import ray
from ray import serve
from jobs.common import init_ray
from serve.app import build_app
from eagle_platform.ports import free_port
prompts = [q.text for q in load_prompts(None, 16) if q.text]
common = {"target": "smollm2-135m", "dtype": "bfloat16", "compile": "on", "threads": a.threads, "num_cpus": 0.5,
          "max_batch_size": 16, "batch_graphs": a.graphs, "stream_interval_s": a.interval, "max_ongoing_requests": 16, "max_queued_requests": 64,
          "max_context": 1024, "watch_s": None, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
pairs = [{"model": "smollm2-135m", "head": None, **common}]
if a.budget:
    pairs.append({"model": "budget", "head": None, **common, "stream_chunks_per_s": a.budget})
init_ray(num_cpus=os.cpu_count())
port = free_port()
serve.start(http_options={"host": "127.0.0.1", "port": port})
t0 = time.perf_counter()
serve.run(build_app({"pairs": pairs}), name="bench", route_prefix="/", blocking=False)
base = f"http://127.0.0.1:{port}"
wait_ready(base, 3600)
while True:
    models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
    if all("error" not in m["eagle"] for m in models): break
    time.sleep(5)
logging.info("pair up in %.0f s", time.perf_counter() - t0)
out = []
for c in a.conc:
    for which in a.order:
        model = "smollm2-135m" if which == "A" else "budget"
        asyncio.run(lt.run_level(base, model, prompts[:1], 1, 8, 600))
        before = cpu_seconds()
        if a.spy:
            import subprocess
            pid = [pid for pid, (name, _) in before.items() if "ServeReplica:bench:pair" in name][0]
            spy = subprocess.Popen(["py-spy", "record", "--native", "--threads", "--idle", "-r", "50", "-d", "6", "-p", str(pid), "--format", "raw", "-o", f"spy-c{c}.txt"])
        lv = asyncio.run(lt.run_level(base, model, prompts, c, 128, 1200))
        cpu = cpu_spent(before, cpu_seconds())
        recs = lv["records"]
        steps = sum(r["eagle"]["target_forwards"] - 1 for r in recs)
        vs = sum(r["eagle"]["verify_s"] for r in recs)
        bm = sum(r["eagle"]["batch_size_mean"] * (r["eagle"]["target_forwards"] - 1) for r in recs) / steps
        # per-row verify time summed over rows = sum over steps of step time; steps counted per row
        step_time = vs / (steps / bm)
        print(json.dumps({"model": model, "c": c, "tok_s": lv["tokens_per_s"], "wall": lv["wall_s"], "ttft_p50": lv["ttft_p50_s"], "lat_p50": lv["latency_p50_s"],
               "batch_mean": round(bm, 2), "step_ms_in_replica": round(1000 * step_time, 2),
               "prefill_ms_mean": round(1000 * sum(r["eagle"].get("prefill_s") or 0 for r in recs) / len(recs), 1),
               "queue_ms_p50": round(1000 * sorted(r["eagle"].get("queue_s") or 0 for r in recs)[len(recs) // 2], 1),
               "cpu": cpu}), flush=True)
serve.shutdown(); ray.shutdown()
