"""The table and the curve of infra/bench/heads.sh: EAGLE-1 against EAGLE-3 at an equal CPU budget.

    python infra/bench/heads_summary.py docs/bench/heads

Reads what the script wrote there (train-<kind>.json: the training job's result line; curves-<kind>.json: its
MLflow metrics; bench-<kind>-bf16.json: ``eaglectl bench``) and writes summary.md and tau_vs_minutes.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jobs.curves import tau_by_minutes  # noqa: E402

KINDS = ("eagle1", "eagle3")


def _curve(curves: dict, key: str) -> dict[int, float]:
    return {int(step): value for step, value in curves.get(key, [])}


def summarise(folder: Path) -> str:
    rows, series = [], {}
    for kind in KINDS:
        curves = json.loads((folder / f"curves-{kind}.json").read_text())["curves"]
        bench = json.loads((folder / f"bench-{kind}-bf16.json").read_text())["aggregate"]
        minutes = _curve(curves, "train_minutes")
        series[kind] = tau_by_minutes(curves)
        steps = max(_curve(curves, "loss"), default=0)
        speed = _curve(curves, "train_tokens_per_s")
        methods = bench["methods"]
        rows.append(
            f"| {kind} | {max(minutes.values(), default=0):.1f} | {steps} | {sum(speed.values()) / max(len(speed), 1):,.0f} | "
            f"{series[kind][-1][1] if series[kind] else float('nan'):.2f} | **{bench['tau_mean']:.2f}** / {bench['tau_pooled']:.2f} | "
            f"{', '.join('-' if a is None else f'{a:.2f}' for a in bench['n_alpha_pooled'])} | "
            f"{bench['speedup']['eagle_vs_plain']:.2f}x ({methods['eagle']['tokens_per_second']:.1f} vs {methods['plain']['tokens_per_second']:.1f} tok/s) |"
        )
    _plot(series, folder / "tau_vs_minutes.png")
    (folder / "tau_vs_minutes.json").write_text(json.dumps(series, indent=1) + "\n")
    header = (
        "| head | training minutes | optimizer steps | train tok/s (2 ranks) | held-out sim. tau (chain of 5) | "
        "MT-bench tau (mean / pooled) | alpha by depth (pooled) | EAGLE / plain, bf16 |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    return header + "\n" + "\n".join(rows) + "\n"


def _plot(series: dict[str, list[tuple[float, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6.5, 4))
    for kind, points in series.items():
        if points:
            axis.plot(*zip(*points), marker="o", ms=3, label=kind)
    axis.set_xlabel("training minutes (optimizer steps only)")
    axis.set_ylabel("held-out simulated tau (chain of 5, T=0)")
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    (folder / "summary.md").write_text(summarise(folder))
    sys.stdout.write((folder / "summary.md").read_text())
