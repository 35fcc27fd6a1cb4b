"""Training curves of a head-training run, drawn from its MLflow metrics into a PNG (and the raw JSON).

    python -m jobs.curves --run-name smollm2-135m-sharegpt-quick-quick --out docs/bench/train_quick.png

Panels: the loss and its parts, depth-1 top-1 accuracy on training batches, held-out per-depth top-1
accuracy (``eval_acc_k``: P(depth k right | depths < k right)) against the optimizer step, and the simulated
acceptance length of a chain (``eval_sim_tau``) against the training minutes (the optimizer steps' own
time, ``train_minutes``; against the step when a run logged no minutes). The JSON beside the PNG holds the
raw curves and ``tau_vs_minutes``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from eagle.errors import EagleError
from eagle_platform.registry import Runs
from jobs.common import JobParser, run_job

KEYS = ("loss", "feature_loss", "token_loss", "acc_1", "eval_sim_tau", "train_tokens_per_s", "lr", "train_minutes") + tuple(f"eval_acc_{d}" for d in range(1, 9))


def history(runs: Runs, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = runs.client
    curves: dict[str, list[tuple[int, float]]] = {}
    for key in KEYS:
        points = client.get_metric_history(run_id, key)
        if points:
            by_step = {m.step: m.value for m in sorted(points, key=lambda m: m.timestamp)}  # a resumed step: last value
            curves[key] = sorted(by_step.items())
    return curves


def tau_by_minutes(curves: dict[str, list]) -> list[tuple[float, float]]:
    """(training minutes, held-out simulated tau) at every step that logged both, in step order; takes the
    curves of ``history`` or the same read back from JSON."""
    minutes = {int(step): value for step, value in curves.get("train_minutes", [])}
    return [(minutes[int(step)], tau) for step, tau in curves.get("eval_sim_tau", []) if int(step) in minutes]


def plot(curves: dict[str, list[tuple[int, float]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, style in (("loss", "-"), ("feature_loss", "--"), ("token_loss", ":")):
        if key in curves:
            steps, values = zip(*curves[key])
            axes[0].plot(steps, values, style, label=key)
    axes[0].set_title("training loss")
    axes[0].set_yscale("log")
    for key in ["acc_1"] + [k for k in curves if k.startswith("eval_acc_")]:
        if key in curves:
            steps, values = zip(*curves[key])
            axes[1].plot(steps, values, "-" if key.startswith("eval") else ":", marker="o" if key.startswith("eval") else None, ms=3, label=key)
    axes[1].set_title("top-1 accuracy (eval: per depth, given the earlier depths right)")
    axes[1].set_ylim(0, 1)
    by_minutes = tau_by_minutes(curves)
    if by_minutes or "eval_sim_tau" in curves:
        axes[2].plot(*zip(*(by_minutes or curves["eval_sim_tau"])), marker="o", ms=3, color="#d62728")
    axes[2].set_title("held-out simulated acceptance length (chain, T=0)")
    for axis in axes:
        axis.set_xlabel("optimizer step")
    if by_minutes:
        axes[2].set_xlabel("training minutes (optimizer steps only)")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _main(args: argparse.Namespace) -> int:
    runs = Runs()
    run_id = args.run_id or runs.find_run("eagle-heads", args.run_name)
    if not run_id:
        raise EagleError(f"no run named {args.run_name!r} in experiment eagle-heads")
    curves = history(runs, run_id)
    if not curves:
        raise EagleError(f"run {run_id} has no training metrics")
    out = Path(args.out)
    plot(curves, out, args.title or f"run {args.run_name or run_id}")
    out.with_suffix(".json").write_text(json.dumps({"run_id": run_id, "curves": curves, "tau_vs_minutes": tau_by_minutes(curves)}, indent=1) + "\n")
    sys.stdout.write(f"{out}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = JobParser(prog="jobs.curves", description="Plot a training run's MLflow metrics.")
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--run-id")
    who.add_argument("--run-name")
    parser.add_argument("--out", required=True, help="PNG path (a .json with the raw curves is written beside it)")
    parser.add_argument("--title", default=None)
    return run_job("jobs.curves", _main, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
