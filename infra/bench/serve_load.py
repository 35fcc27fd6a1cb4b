"""The serving load table of docs/benchmarks.md section 7: our EAGLE pair and target-alone pair behind Ray
Serve, and vLLM's CPU build (its OpenAI server, in its own virtualenv) as the reference, measured one after
another in one run with the same client (``serve.loadtest``), prompts and settings.

    .venv/bin/python infra/bench/serve_load.py --head HEAD [--concurrency 1 4 8 16] [--out docs/bench/serve]
    .venv/bin/python infra/bench/serve_load.py --ratios RUN1/load.json [RUN2/load.json ...]   # ratios over runs

1. a private local Ray instance; ``serve.app.build_app`` with two pairs (``--replicas`` each, default one,
   ``--dtype`` (bf16 by default; vLLM gets the same), compiled, ``max_batch_size`` 16, ``--batch-graphs``, ``--threads`` or the pairs' default): ``smollm2-135m-eagle``
   (target + HEAD) and ``smollm2-135m``; with ``--alone`` each pair in a Serve start of its own, by itself on the
   machine (the EAGLE pair's start, then the target alone's; ``--alone target-first`` the other way round), as vLLM's server runs;
2. ``serve.loadtest`` levels at each concurrency, the models served together alternating within a level, ``--rounds``
   times (A B B A ...; the rounds of a cell pooled, each round's tokens/s kept);
3. Serve shut down; ``infra/bench/peers.sh vllm-serve`` starts ``vllm serve`` on the same target folder;
   the same levels against it; the server stopped; with ``--vllm-head``, again with that head exported for
   vLLM (``eagle.formats.export_head``) as its speculative model (``smollm2-135m-vllm-eagle``: method
   ``eagle`` or ``eagle3`` by the head's kind, ``--vllm-spec-tokens`` drafted tokens a step);
4. OUT/load.json (every request; with ``--cpu-seconds`` each level's CPU seconds per process), OUT/serve-models.json
   (our last Serve start's ``/v1/models`` after its levels: each pair's speculation policy) and OUT/load.md
   (the table, then each cell's tokens/s over another's: EAGLE pair / target alone, EAGLE pair / vLLM,
   target alone / vLLM, pooled, round by round, and the round ratios' geometric mean with its 95 % interval).

With ``--together`` steps 1 and 3 run at once instead: our Serve app (both pairs) and vLLM's server are up
at the same time and the three alternate within every level (A B C C B A ...), so the machine's drift over
the run falls on all of them and each round's ratios compare measurements taken next to each other.

A benchmark, not a test: 11-15 minutes on 2 cores with one round a cell; 20-35 with ``--together --rounds 4``
(7-13 of them the Serve start, compiling the graphs). Without ``--together`` each side runs alone: our
pairs are shut down before vLLM starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from eagle_platform.ports import free_port  # noqa: E402
from serve.loadtest import pool_rounds, ratio_table, run_level, table  # noqa: E402

logger = logging.getLogger("serve_load")
EAGLE_MODEL, TARGET_MODEL, VLLM_MODEL = "smollm2-135m-eagle", "smollm2-135m", "smollm2-135m-vllm"
COMPARISONS = [(EAGLE_MODEL, TARGET_MODEL), (EAGLE_MODEL, VLLM_MODEL), (TARGET_MODEL, VLLM_MODEL)]  # OUT/load.md's ratio table


def wait_ready(base: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{base} did not answer within {timeout_s:.0f} s")


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Per process on this machine: (its command line's first 60 characters, CPU seconds used so far, user +
    system). Ray renames a worker when it takes on an actor (``ray::ServeReplica:<app>:<deployment>``)."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            name = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:60]
        except OSError:  # the process ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 0, utime 11, stime 12
        used[int(entry.name)] = (name or stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick)
    return used


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], top: int = 8) -> dict[str, float]:
    """CPU seconds each process used between two ``cpu_seconds`` snapshots (by pid, so a renamed worker
    counts only its new seconds), summed by name; the ``top`` largest."""
    spent: dict[str, float] = {}
    for pid, (name, total) in after.items():
        spent[name] = spent.get(name, 0.0) + total - before.get(pid, ("", 0.0))[1]
    return {name: round(t, 2) for name, t in sorted(spent.items(), key=lambda item: -item[1])[:top]}


def levels_for(servers: list[tuple[str, str]], prompts: list[str], concurrency: list[int], max_tokens: int,
               measure_cpu: bool = False, rounds: int = 1) -> list[dict]:
    """Each server ``(base URL, model)`` at each concurrency, ``rounds`` times in a row with the servers' order
    reversed every other round (A B B A ..., or A B C C B A ...), pooled into one cell per model and
    concurrency (``serve.loadtest.pool_rounds``); with ``measure_cpu`` each round also records ``cpu_s``: the
    CPU seconds each process used during it (the 8 largest; only meaningful on a machine running nothing
    else; with servers up together it shows what the idle ones took)."""
    levels = []
    for c in concurrency:
        runs: dict[str, list[dict]] = {model: [] for _, model in servers}
        for round_ in range(rounds):
            for base, model in servers if round_ % 2 == 0 else servers[::-1]:
                # one warm-up request per model and round keeps a cold first request out of the figures
                asyncio.run(run_level(base, model, prompts[:1], 1, 8, 600))
                before = cpu_seconds() if measure_cpu else {}
                level = asyncio.run(run_level(base, model, prompts, c, max_tokens, 1200))
                if measure_cpu:
                    level["cpu_s"] = cpu_spent(before, cpu_seconds())
                    logger.info("%s c=%d CPU seconds over %.1f s: %s", model, c, level["wall_s"], level["cpu_s"])
                logger.info("%s c=%d round %d: %.1f tok/s, p50 %.2f s, %d errors", model, c, round_ + 1, level["tokens_per_s"] or 0,
                            level["latency_p50_s"] or 0, level["errors"])
                runs[model].append(level)
        for _, model in servers:
            if rounds == 1:
                levels.append(runs[model][0])
                continue
            cell = pool_rounds(runs[model])
            cell["rounds"] = [{k: v for k, v in level.items() if k != "records"} for level in runs[model]]
            levels.append(cell)
    return levels


def our_pairs(args) -> list[tuple[str, str | None]]:
    """Our two pairs, (model, head or None): the EAGLE pair on ``--head``, the target alone."""
    return [(EAGLE_MODEL, args.head), (TARGET_MODEL, None)]


def ours(args, prompts: list[str]) -> list[dict]:
    """Our two pairs' levels: both deployed in one Serve app and alternating within each level, or with
    ``--alone`` each deployed by itself in a Serve start of its own (the EAGLE pair's, then the target
    alone's; ``--alone target-first`` the other way round), as vLLM's server runs alone."""
    pairs = our_pairs(args)
    if not args.alone:
        return serve_levels(args, prompts, pairs)
    if args.alone == "target-first":
        pairs.reverse()
    return [level for pair in pairs for level in serve_levels(args, prompts, [pair])]


@contextlib.contextmanager
def serve_pairs(args, pairs: list[tuple[str, str | None]]) -> Iterator[str]:
    """A private Ray instance serving ``pairs`` ((model, head or None)) in one Serve app, every replica up;
    yields its base URL, then writes what ``/v1/models`` reports (each pair's speculation policy, its
    decisions and measured costs) to OUT/serve-models.json and shuts it all down."""
    import ray
    from ray import serve

    from jobs.common import init_ray
    from serve.app import build_app
    port = free_port()
    common = {"target": "smollm2-135m", "dtype": args.dtype, "compile": "on", "threads": args.threads, "num_cpus": 0.5,
              "max_batch_size": args.max_batch, "batch_graphs": args.batch_graphs, "stream_interval_s": args.stream_interval, "stream_chunks_per_s": args.stream_chunks_per_s, "max_ongoing_requests": args.max_batch, "max_queued_requests": 64,
              "max_context": 1024, "watch_s": None, "autoscaling": {"min_replicas": args.replicas, "max_replicas": args.replicas}}
    specs = [{"model": model, "head": head, **({"tree": {"kind": args.tree}} if head else {}), **common} for model, head in pairs]
    init_ray(num_cpus=os.cpu_count())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        started = time.perf_counter()
        serve.run(build_app({"pairs": specs}), name="bench", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 3600)
        while True:  # /v1/models answers before every replica is up: wait until all report their info
            models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
            if all("error" not in m["eagle"] for m in models):
                break
            time.sleep(5)
        logger.info("%s up in %.0f s", ", ".join(model for model, _ in pairs), time.perf_counter() - started)
        yield base
        # each pair's state after the levels: its speculation policy's decisions and measured costs
        (Path(args.out) / "serve-models.json").write_text(json.dumps(httpx.get(base + "/v1/models", timeout=30).json(), indent=2))
    finally:
        serve.shutdown()
        ray.shutdown()


def serve_levels(args, prompts: list[str], pairs: list[tuple[str, str | None]]) -> list[dict]:
    """``pairs`` in one Serve app (``serve_pairs``); their levels."""
    with serve_pairs(args, pairs) as base:
        return levels_for([(base, model) for model, _ in pairs], prompts, args.concurrency, args.max_tokens, args.cpu_seconds, args.rounds)


@contextlib.contextmanager
def vllm_server(args, name: str = VLLM_MODEL, speculative: dict | None = None) -> Iterator[str]:
    """vLLM's server on the target (and ``speculative``: its ``--speculative-config``), served as ``name``;
    yields its base URL once it answers, stops it after."""
    from eagle.target import materialize_builtin

    model_dir = materialize_builtin("smollm2-135m")[0]
    port = free_port()
    log = open(Path(args.out) / f"{name}-serve.log", "w")
    env = dict(os.environ, VLLM_DTYPE=args.dtype)
    if speculative is not None:  # peers.sh splits VLLM_SERVE_ARGS on spaces: the JSON has none
        env["VLLM_SERVE_ARGS"] = f"--served-model-name {name} --speculative-config {json.dumps(speculative, separators=(',', ':'))}"
    process = subprocess.Popen([str(REPO / "infra/bench/peers.sh"), "vllm-serve", str(model_dir), str(port), str(args.max_batch)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, 1800, process)
        yield base
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 15)
            process.wait(60)
        log.close()


def vllm(args, prompts: list[str], name: str = VLLM_MODEL, speculative: dict | None = None) -> list[dict]:
    """vLLM's server by itself (``vllm_server``); its levels."""
    with vllm_server(args, name, speculative) as base:
        return levels_for([(base, name)], prompts, args.concurrency, args.max_tokens, args.cpu_seconds, args.rounds)


def together(args, prompts: list[str]) -> list[dict]:
    """Our two pairs (one Serve app) and vLLM's server up at the same time, the three alternating within
    every level (A B C C B A ...): whatever the machine drifts by over the run falls on all three, and
    each round's ratios compare measurements taken next to each other (``serve.loadtest.ratio_table``)."""
    pairs = our_pairs(args)
    with serve_pairs(args, pairs) as ours_base, vllm_server(args) as vllm_base:
        servers = [(ours_base, model) for model, _ in pairs] + [(vllm_base, VLLM_MODEL)]
        return levels_for(servers, prompts, args.concurrency, args.max_tokens, args.cpu_seconds, args.rounds)


def vllm_speculative(args) -> dict:
    """``--vllm-head`` exported into OUT/vllm-head (replaced), and vLLM's speculative config for it."""
    import shutil

    from eagle.formats import export_head
    from eagle.head import HeadConfig

    dest = Path(args.out).resolve() / "vllm-head"
    shutil.rmtree(dest, ignore_errors=True)
    export_head(args.vllm_head, dest, "vllm")
    method = "eagle3" if HeadConfig.read(args.vllm_head).kind == "eagle3" else "eagle"
    return {"method": method, "model": str(dest), "num_speculative_tokens": args.vllm_spec_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", help="a head directory (or models:/<target>-eagle@<alias> with MLFLOW_TRACKING_URI set)")
    parser.add_argument("--tree", default="dynamic")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="our pairs' and vLLM's dtype")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: the pair's, all cores but one)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per pair (each decodes its own batch at --threads)")
    parser.add_argument("--batch-graphs", type=int, nargs="*", default=[], help="the pairs' batch_graphs (compiled plain steps per batch size)")
    parser.add_argument("--stream-chunks-per-s", type=float, default=None, help="the pairs' stream_chunks_per_s (a replica's chunk budget, shared by its open streams)")
    parser.add_argument("--stream-interval", type=float, default=0.0, help="the pairs' stream_interval_s (shortest time between two chunks of a stream)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every cell, pooled (models alternate A B B A)")
    parser.add_argument("--cpu-seconds", action="store_true", help="record each process's CPU seconds per level (cpu_s)")
    parser.add_argument("--alone", nargs="?", const="eagle-first", choices=["eagle-first", "target-first"], default=None,
                        help="deploy each of our pairs by itself, one Serve start each (as vLLM runs), not both in one app; "
                             "the EAGLE pair's start first unless 'target-first'")
    parser.add_argument("--together", action="store_true",
                        help="our pairs and vLLM's server up at the same time, alternating within every level (A B C C B A ...)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-head", default=None, help="also serve vLLM with this head directory (ours) exported for it")
    parser.add_argument("--vllm-spec-tokens", type=int, default=3, help="vLLM's num_speculative_tokens with --vllm-head")
    parser.add_argument("--skip-ours", action="store_true", help="reuse OUT/load-ours.json from an earlier run")
    parser.add_argument("--out", default="docs/bench/serve")
    parser.add_argument("--ratios", nargs="+", metavar="LOAD_JSON", default=None,
                        help="start nothing: print the ratio table over these runs' load.json (round ratios of all runs pooled)")
    args = parser.parse_args()
    if args.ratios:
        runs = []
        for path in args.ratios:
            try:
                runs.append(json.loads(Path(path).read_text())["levels"])
            except (OSError, ValueError, KeyError) as error:
                parser.error(f"{path}: not a serve_load.py load.json ({error})")
        sys.stdout.write(ratio_table(runs, COMPARISONS) + "\n")
        return 0
    if args.head is None:
        parser.error("--head is required (except with --ratios)")
    if args.together and (args.alone or args.skip_vllm or args.skip_ours or args.vllm_head):
        parser.error("--together runs our pairs and vLLM plain in one run: drop --alone, --skip-vllm, --skip-ours and --vllm-head")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from eagle.bench import load_prompts

    prompts = [p.text for p in load_prompts(None, args.prompts) if p.text]
    levels = []
    if args.together:
        levels += together(args, prompts)
    elif not args.skip_ours:
        levels += ours(args, prompts)
        (Path(args.out) / "load-ours.json").write_text(json.dumps(levels, indent=2))  # for --skip-ours if the vLLM side fails
    elif (Path(args.out) / "load-ours.json").exists():
        levels += json.loads((Path(args.out) / "load-ours.json").read_text())
    if not args.skip_vllm and not args.together:
        levels += vllm(args, prompts)
        if args.vllm_head:
            levels += vllm(args, prompts, "smollm2-135m-vllm-eagle", vllm_speculative(args))
    result = {
        "command": "infra/bench/serve_load.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), None)},
        "settings": {"concurrency": args.concurrency, "prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": 0,
                     "max_batch_size": args.max_batch, "threads": args.threads, "replicas": args.replicas, "batch_graphs": args.batch_graphs, "stream_interval_s": args.stream_interval, "stream_chunks_per_s": args.stream_chunks_per_s, "rounds": args.rounds, "alone": args.alone, "together": args.together, "cpu_seconds": args.cpu_seconds, "tree": args.tree, "vllm_head": args.vllm_head, "vllm_spec_tokens": args.vllm_spec_tokens, "head": args.head, "dtype": args.dtype, "stream": True},
        "levels": levels,
    }
    (Path(args.out) / "load.json").write_text(json.dumps(result, indent=2))
    report = table(levels) + "\n\n" + ratio_table([levels], COMPARISONS) + "\n"
    (Path(args.out) / "load.md").write_text(report)
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
