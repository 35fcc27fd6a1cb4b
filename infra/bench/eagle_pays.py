"""Issue 41's benchmark: EAGLE against our plain loop at batch 1, default settings, side by side.

One process, so the target's graphs compile once for every run: MT-bench's first turns (chat template) and
HumanEval's stubs, 128 new tokens, the dtype ``auto`` picks on this machine, 2 threads, the default tree (or
``--trees``) and ``--speculate auto`` (the policy decides per step), one report per (head, tree, prompt set,
temperature) under ``--out`` (JSON + markdown + PNG, as ``eaglectl bench`` writes them).

    .venv/bin/python infra/bench/eagle_pays.py --head HEAD_DIR_OR_URI --label quick \
        --trees default 2,1,2 --runs mtbench:80:0 humaneval:40:0 mtbench:40:1 --out docs/bench/eagle-pays
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from eagle import bench
from eagle.cli import resolve_head_spec
from eagle.head import EagleHead
from eagle.runtime import preferred_dtype, use_threads
from eagle.target import load_target
from eagle.tree import build_tree
from eagle.verify import SamplingConfig

logger = logging.getLogger("eagle_pays")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True, help="a head directory, a models:/ URI, or 'random' (untrained)")
    parser.add_argument("--label", required=True, help="names the head in the report files")
    parser.add_argument("--runs", nargs="+", default=["mtbench:80:0", "humaneval:40:0", "mtbench:40:1"],
                        help="prompt-set:count:temperature, each a report")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speculate", default="auto")
    parser.add_argument("--trees", nargs="+", default=["default"],
                        help="'default' (the engine's default tree) or DEPTH,TOP_K,TOTAL_TOKENS of a dynamic tree; each runs every --runs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_threads(args.threads)
    dtype = preferred_dtype("auto")
    target = load_target("smollm2-135m", dtype=dtype)
    head = EagleHead.for_target(target, seed=0) if args.head == "random" else EagleHead.from_pretrained(resolve_head_spec(args.head), target)
    for spec in args.trees:
        tree, tree_label = None, "default"
        if spec != "default":
            depth, top_k, total = (int(v) for v in spec.split(","))
            tree, tree_label = build_tree("dynamic", depth=depth, top_k=top_k, total_tokens=total), f"d{depth}k{top_k}t{total}"
        for run in args.runs:
            name, count, temperature = run.split(":")
            prompts = bench.prompt_set(name, target, int(count))
            result = bench.run_bench(target, head, prompts, max_new_tokens=args.max_new_tokens,
                                     sampling=SamplingConfig(temperature=float(temperature)), tree=tree, baselines=(),
                                     head_label=args.label, compile="on", speculate=args.speculate)
            result["config"]["command"] = "infra/bench/eagle_pays.py " + " ".join(argv or sys.argv[1:])
            out = Path(args.out) / f"{args.label}-{tree_label}-{name}{count}-T{temperature}-{dtype}.json"
            bench.write_report(result, out)
            aggregate = result["aggregate"]
            logger.info("%s: eagle/plain %.3f, tau %s, drafted %.3f of steps, policy %s", out.name,
                        aggregate["speedup"]["eagle_vs_plain"], aggregate["tau_mean"], aggregate["drafted_share"] or 0.0,
                        result["config"]["policy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
