"""jobs.curves: the training-curve PNG drawn from a run's MLflow metrics."""

from __future__ import annotations

import json

from eagle_platform.registry import Runs
from jobs import curves


def test_curves_plot_a_runs_metrics(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    runs = Runs(mlflow_server)
    run_id = runs.start_run("eagle-heads", "curves-test")
    for step in range(1, 21):
        runs.log_metrics(run_id, {"loss": 2.0 / step, "feature_loss": 1.0 / step, "token_loss": 9.0 / step, "acc_1": step / 40}, step=step)
        if step % 5 == 0:
            runs.log_metrics(run_id, {"eval_acc_1": step / 40, "eval_acc_2": step / 60, "eval_sim_tau": 1 + step / 20}, step=step)
        if step % 10 == 0:  # minutes come every log_every steps, evaluations at their own interval
            runs.log_metrics(run_id, {"train_minutes": step / 4}, step=step)
    runs.log_metrics(run_id, {"loss": 0.05}, step=20)  # a resumed run logs a step again: the last value wins
    out = tmp_path / "curves.png"
    assert curves.main(["--run-name", "curves-test", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    raw = json.loads(out.with_suffix(".json").read_text())
    assert raw["run_id"] == run_id
    assert raw["curves"]["eval_sim_tau"][-1] == [20, 2.0]
    assert raw["curves"]["loss"][-1] == [20, 0.05] and len(raw["curves"]["loss"]) == 20
    assert raw["tau_vs_minutes"] == [[2.5, 1.5], [5.0, 2.0]]  # only the steps that logged both


def test_unknown_run_is_one_line(mlflow_server, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    assert curves.main(["--run-name", "never-ran", "--out", "x.png"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
