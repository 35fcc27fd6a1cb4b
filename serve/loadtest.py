"""A bounded load generator for the OpenAI endpoints: ``python -m serve.loadtest`` (``make loadtest``).

For each model and each concurrency level, ``concurrency`` loopback clients send the same fixed list of
MT-bench first-turn prompts as streamed chat completions (each prompt once per level, so every cell of the
table does the same work) and record per request: time to first token (first content chunk), latency,
completion tokens and tau (the ``eagle`` object of the final chunk). Each request has a client timeout; the
whole run is bounded by prompts x levels x models. Writes a JSON with every request and a summary, a
markdown table on stdout, and a PNG (tokens/s and p50 latency against concurrency).

Example (after ``make serve`` in another terminal)::

    python -m serve.loadtest --models smollm2-135m-eagle smollm2-135m --concurrency 1 4 8 --prompts 16 \
        --max-tokens 128 --out docs/bench/loadtest.json --png docs/bench/loadtest.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

logger = logging.getLogger(__name__)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    record: dict[str, Any] = {"status": None, "tokens": 0, "tau": None, "error": None}
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout_s) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                record["error"] = (await response.aread()).decode()[:300]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        record["error"] = chunk["error"]["message"]
                        continue
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and first is None:
                        first = time.perf_counter() - started
                    if "eagle" in chunk:
                        record["tau"] = chunk["eagle"]["tau"]
                    if chunk.get("usage"):
                        record["tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as err:
        record["error"] = f"{type(err).__name__}: {err}"
    record["latency_s"] = time.perf_counter() - started
    record["ttft_s"] = first
    return record


async def run_level(base: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    records: list[dict[str, Any]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records.append(await one_request(client, base, model, prompt, max_tokens, timeout_s))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return summarize(model, concurrency, records, wall)


def summarize(model: str, concurrency: int, records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One cell of the table from its requests and the wall-clock seconds they took together."""
    ok = [r for r in records if r["status"] == 200 and r["error"] is None]
    latencies = [r["latency_s"] for r in ok]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    taus = [r["tau"] for r in ok if r["tau"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "model": model, "concurrency": concurrency, "requests": len(records), "ok": len(ok),
        "errors": len(records) - len(ok), "wall_s": round(wall, 3),
        "tokens": tokens, "tokens_per_s": round(tokens / wall, 2) if wall else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "latency_p50_s": _round(percentile(latencies, 0.5)), "latency_p99_s": _round(percentile(latencies, 0.99)),
        "ttft_p50_s": _round(percentile(ttfts, 0.5)), "ttft_p99_s": _round(percentile(ttfts, 0.99)),
        "tau_mean": _round(statistics.fmean(taus) if taus else None),
        "records": records,
    }


def pool_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one cell (same model and concurrency) as one: every request pooled, tokens/s over the
    summed wall-clock time; each round's tokens/s kept in ``tokens_per_s_rounds`` (their spread is the
    run-to-run noise a single round would hide)."""
    cell = summarize(rounds[0]["model"], rounds[0]["concurrency"], [r for level in rounds for r in level["records"]],
                     sum(level["wall_s"] for level in rounds))
    cell["tokens_per_s_rounds"] = [level["tokens_per_s"] for level in rounds]
    return cell


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def table(levels: list[dict[str, Any]]) -> str:
    lines = [
        "| model | concurrency | ok/requests | tokens/s | requests/s | p50 latency (s) | p99 latency (s) | p50 TTFT (s) | p99 TTFT (s) | tau |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        lines.append(
            f"| {level['model']} | {level['concurrency']} | {level['ok']}/{level['requests']} | {_throughput(level)} | "
            f"{level['requests_per_s']} | {level['latency_p50_s']} | {level['latency_p99_s']} | {level['ttft_p50_s']} | "
            f"{level['ttft_p99_s']} | {level['tau_mean'] if level['tau_mean'] is not None else '-'} |"
        )
    return "\n".join(lines)


def ratio_table(runs: list[list[dict[str, Any]]], comparisons: list[tuple[str, str]]) -> str:
    """Tokens/s of one model over another's, per concurrency, for each ``(model, reference)`` in
    ``comparisons``, over one run or several (each a list of levels, as ``infra/bench/serve_load.py`` writes
    them). Per run, the pooled cells' ratio; per round, round i of one model against round i of the other
    (when the models alternate A B B A ... in one run those ran next to each other, so the machine's drift
    between rounds cancels out of them); the geometric mean of all runs' round ratios with its 95 %
    t-interval, and the lowest round ratio: what a goal must survive."""
    from scipy import stats

    lines = ["| model / reference | concurrency | pooled ratio (per run) | round ratios | geometric mean (95 %) | lowest |",
             "|---|---|---|---|---|---|"]
    cells_by_run = [{(level["model"], level["concurrency"]): level for level in run} for run in runs]
    for model, reference in comparisons:
        for concurrency in sorted({c for cells in cells_by_run for m, c in cells if m == model}):
            pooled, rounds = [], []
            for cells in cells_by_run:
                ours, theirs = cells.get((model, concurrency)), cells.get((reference, concurrency))
                if ours is None or theirs is None or not ours["tokens_per_s"] or not theirs["tokens_per_s"]:
                    continue
                pooled.append(ours["tokens_per_s"] / theirs["tokens_per_s"])
                rounds += [a / b for a, b in zip(ours.get("tokens_per_s_rounds") or [ours["tokens_per_s"]],
                                                 theirs.get("tokens_per_s_rounds") or [theirs["tokens_per_s"]]) if a and b]
            if not rounds:
                continue
            logs = [math.log(r) for r in rounds]
            mean = statistics.fmean(logs)
            interval = ""
            if len(logs) > 1:
                half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
                interval = f" ({math.exp(mean - half):.2f}-{math.exp(mean + half):.2f})"
            lines.append(f"| {model} / {reference} | {concurrency} | {' / '.join(f'{r:.2f}' for r in pooled)} | "
                         f"{' / '.join(f'{r:.2f}' for r in rounds)} | {math.exp(mean):.2f}{interval} | {min(rounds):.2f} |")
    return "\n".join(lines)


def _throughput(level: dict[str, Any]) -> str:
    rounds = level.get("tokens_per_s_rounds")
    return f"{level['tokens_per_s']}" + (f" ({' / '.join(str(r) for r in rounds)})" if rounds and len(rounds) > 1 else "")


def plot(levels: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for model in dict.fromkeys(level["model"] for level in levels):
        rows = [level for level in levels if level["model"] == model]
        x = [row["concurrency"] for row in rows]
        throughput.plot(x, [row["tokens_per_s"] for row in rows], marker="o", label=model)
        latency.plot(x, [row["latency_p50_s"] for row in rows], marker="o", label=f"{model} p50")
        latency.plot(x, [row["latency_p99_s"] for row in rows], marker="x", linestyle="--", label=f"{model} p99")
    throughput.set(xlabel="concurrent clients", ylabel="generated tokens/s", title="Throughput")
    latency.set(xlabel="concurrent clients", ylabel="seconds per request", title="Latency")
    for axes in (throughput, latency):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serve.loadtest", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-eagle", "smollm2-135m"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--prompts", type=int, default=16, help="MT-bench questions (first turn), sent once per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    parser.add_argument("--out", default="results/loadtest.json")
    parser.add_argument("--png", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.prompts < 1 or args.max_tokens < 1 or any(c < 1 for c in args.concurrency):
        sys.stderr.write("loadtest: error: --prompts, --max-tokens and --concurrency must be positive\n")
        return 2
    from eagle.bench import load_prompts
    from eagle.errors import EagleError

    try:
        prompts = [p.text for p in load_prompts(None, args.prompts) if p.text]
        httpx.get(f"{args.base_url}/v1/models", timeout=10).raise_for_status()
    except (EagleError, httpx.HTTPError) as err:
        sys.stderr.write(f"loadtest: error: {str(err).splitlines()[0]}\n")
        return 2
    levels = []
    for concurrency in args.concurrency:
        for model in args.models:  # models alternate within a level: drift on a shared host hits both alike
            logger.info("%s: %d prompts at concurrency %d", model, len(prompts), concurrency)
            level = asyncio.run(run_level(args.base_url, model, prompts, concurrency, args.max_tokens, args.timeout))
            logger.info("%s c=%d: %.1f tok/s, p50 %.2f s, %d errors", model, concurrency, level["tokens_per_s"] or 0,
                        level["latency_p50_s"] or 0, level["errors"])
            levels.append(level)
    levels.sort(key=lambda level: (args.models.index(level["model"]), level["concurrency"]))
    result = {
        "command": "python -m serve.loadtest " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "settings": {"models": args.models, "concurrency": args.concurrency, "prompts": len(prompts), "max_tokens": args.max_tokens,
                     "temperature": 0, "base_url": args.base_url},
        "levels": levels,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.png:
        plot(levels, Path(args.png))
    sys.stdout.write(table(levels) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
