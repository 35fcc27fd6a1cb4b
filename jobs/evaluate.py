"""Evaluate a head as a Ray job: the side-by-side bench on held-out prompts, logged to the head's training run.

    ray job submit --working-dir . -- python -m jobs.evaluate --target smollm2-135m --preset quick \\
        --head models:/smollm2-135m-eagle@candidate --promote-tau 1.4

The prompts are MT-bench's first turns (never in the ShareGPT training data), spread evenly over its 8
categories (``--prompts 40``: the first 5 of each). The bench (``eagle.bench``:
plain decoding, EAGLE and, optionally, Hugging Face ``generate`` / prompt lookup, in one process) runs on one
Ray worker that holds the node's CPUs (or a GPU). Its tau, speedup, tokens/s and exactness flags are logged
as ``eval/<dtype>-T<temperature>/*`` metrics to the run that trained the head, with the bench JSON,
table and plot as artifacts.
With ``--promote-tau X`` the registry alias ``production`` moves to this head version when tau >= X.

A head built for another target revision fails in one line (exit 2) before anything is logged or promoted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from eagle.errors import EagleError
from eagle.compile import COMPILE_MODES
from eagle.policy import SPECULATE_MODES
from eagle.tree import TREE_KINDS
from jobs.common import init_ray, job_parser, run_job, worker_env
from jobs.presets import get_preset

logger = logging.getLogger("jobs.evaluate")


def _bench(settings: dict[str, Any]) -> dict[str, Any]:
    """Runs on the Ray worker: load the pair, bench it, return the report."""
    from eagle.bench import load_prompts, run_bench
    from eagle.head import EagleHead
    from eagle.runtime import use_threads
    from eagle.target import load_target
    from eagle.tree import build_tree
    from eagle.verify import SamplingConfig
    from jobs.common import setup_logging

    worker_env()
    setup_logging()
    if settings.get("threads"):
        use_threads(settings["threads"])
    target = load_target(settings["target"], dtype=settings["dtype"], device=settings.get("device", "cpu"))
    head = EagleHead.from_pretrained(settings["head_dir"], target)
    prompts = load_prompts(limit=settings["prompts"], spread=True)
    return run_bench(
        target, head, prompts, max_new_tokens=settings["max_new_tokens"], sampling=SamplingConfig(temperature=settings["temperature"]),
        tree=build_tree(settings["tree"]), baselines=settings["baselines"], seed=settings["seed"], progress=True, head_label=settings["head_label"],
        compile=settings["compile"], speculate=settings.get("speculate", "auto"),
    )


def _head_config(head_dir: str):
    from eagle.head import HeadConfig

    return HeadConfig.read(head_dir)


def resolve_once(reg, head_spec: str, target: tuple[str, str]) -> tuple[str, dict[str, Any] | None]:
    """The head to bench as (local directory, registry version info or None for a directory).

    A ``models:/...@alias`` spec is resolved once: the download, the bench and the promotion all use that
    exact version, even if the alias moves meanwhile (a head that was never benched is never promoted).
    The version's ``target_revision`` tag is checked against ``target`` before the download."""
    from eagle.cli import resolve_head_spec
    from eagle.head import check_revision
    from eagle_platform.registry import parse_models_uri

    if not head_spec.startswith("models:/"):
        return resolve_head_spec(head_spec), None
    model_name, alias, version = parse_models_uri(head_spec)
    version_info = reg.head_version_info(model_name, alias, version=version)
    check_revision(head_spec, version_info["tags"].get("target_revision"), target)
    return reg.resolve_head(f"models:/{model_name}/{version_info['version']}"), version_info


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from eagle.head import check_revision
    from eagle.target import resolve_target
    from eagle_platform.registry import Registry, head_uri

    reg = Registry()
    preset = get_preset(args.preset)
    target_spec = args.target or preset.target
    _, target_name, revision = resolve_target(target_spec)  # once: a built-in target's revision hashes its GGUF
    head_spec = args.head or head_uri(target_name, "candidate")
    if not head_spec.startswith("models:/") and args.promote_tau is not None:
        raise EagleError("--promote-tau needs a registered head (--head models:/<target>-eagle@<alias>)")
    head_dir, version_info = resolve_once(reg, head_spec, (target_name, revision))
    config = _head_config(head_dir)
    check_revision(head_dir, config.target_revision, (target_name, revision))  # before any worker starts
    run_id = args.run_id or (version_info or {}).get("run_id")

    settings = {
        "target": target_spec, "head_dir": head_dir, "head_label": head_spec,
        "dtype": args.dtype or preset.eval.dtype, "tree": args.tree, "compile": args.compile or preset.eval.compile,
        "prompts": args.prompts or preset.eval.prompts, "max_new_tokens": args.max_new_tokens or preset.eval.max_new_tokens,
        "temperature": preset.eval.temperature if args.temperature is None else args.temperature,
        "baselines": [b for b in (args.baselines or "").split(",") if b],
        "seed": args.seed,
        "speculate": args.speculate,
        "device": "cuda" if args.gpu or preset.eval.use_gpu else "cpu",  # the task reserves the GPU it runs on
    }
    init_ray()
    cpus = max(1, int(ray.available_resources().get("CPU", 1)))
    settings["threads"] = cpus
    task = ray.remote(num_cpus=cpus, num_gpus=1 if settings["device"] == "cuda" else 0)(_bench)
    report = ray.get(task.remote(settings))

    aggregate = report["aggregate"]
    # one namespace per setting (runs get several); another seed gets its own, not the default seed's
    prefix = f"eval/{settings['dtype']}-T{settings['temperature']:g}" + (f"-seed{args.seed}" if args.seed else "")
    metrics = {
        f"{prefix}/tau": aggregate["tau_mean"],
        f"{prefix}/tau_pooled": aggregate["tau_pooled"],
        f"{prefix}/speedup_vs_plain": aggregate["speedup"]["eagle_vs_plain"],
        f"{prefix}/eagle_tokens_per_s": aggregate["methods"]["eagle"]["tokens_per_second"],
        f"{prefix}/plain_tokens_per_s": aggregate["methods"]["plain"]["tokens_per_second"],
        f"{prefix}/outputs_match_plain": float(bool(aggregate["all_outputs_match_plain"])),
        f"{prefix}/prompts": aggregate["prompts"],
    }
    promoted = False
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="eagle-eval-")) / "bench.json"
    from eagle.bench import write_report

    paths = write_report(report, out)
    if run_id:
        reg.runs.log_metrics(run_id, {k: v for k, v in metrics.items() if v is not None})
        for path in paths.values():
            reg.runs.log_artifact(run_id, str(path), f"{prefix}-{settings['tree']}")
    if args.promote_tau is not None and version_info is not None:
        tau = aggregate["tau_mean"] or 0.0
        if tau >= args.promote_tau:
            reg.promote(target_name, version_info["version"], "production")
            promoted = True
        logger.info("tau %.3f %s the promotion threshold %.2f", tau, ">=" if promoted else "<", args.promote_tau)
    summary = {"head": head_spec, "version": (version_info or {}).get("version"), "run_id": run_id, "promoted": promoted, "report": str(out), **metrics}
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = job_parser("jobs.evaluate", "Bench a head on held-out MT-bench prompts and log tau/speedup to its MLflow run.")
    parser.add_argument("--head", default=None, help="head directory or models:/<target>-eagle@<alias> (default @candidate)")
    parser.add_argument("--run-id", default=None, help="MLflow run to log to (default: the run that trained the head)")
    parser.add_argument("--prompts", type=int, default=None, help="MT-bench questions, spread over its 8 categories (default: the preset's)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--tree", choices=list(TREE_KINDS), default="dynamic")
    parser.add_argument("--compile", choices=list(COMPILE_MODES), default=None, help="torch.compile the decoders (eagle.compile; default: the preset's, on)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--baselines", default="", help="comma-separated: hf,prompt-lookup (default none)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i (T > 0; default 0)")
    parser.add_argument("--promote-tau", type=float, default=None, help="promote to production when tau >= this")
    parser.add_argument("--speculate", choices=list(SPECULATE_MODES), default="auto",
                        help="auto (default): EAGLE drafts where this machine's measured costs say it pays, as served; "
                             "always: every step drafts (the head's acceptance on every step, as a gate measures it)")
    parser.add_argument("--gpu", action="store_true", help="run the bench task on one GPU (it reserves it; target and head load there)")
    parser.add_argument("--out", default=None, help="where to write bench.json (+ .md, .png)")
    return parser


def _main(args: argparse.Namespace) -> int:
    for flag in ("prompts", "max_new_tokens"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise EagleError(f"--{flag.replace('_', '-')} must be > 0")
    if args.seed < 0:
        raise EagleError("--seed must be >= 0")
    if args.temperature is not None and args.temperature < 0:
        raise EagleError("--temperature must be >= 0")
    summary = evaluate(args)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job("jobs.evaluate", _main, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
