"""jobs.evaluate: bench a registered head on a Ray worker, log to its training run, promote by threshold."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from eagle.head import EagleHead
from eagle_platform.registry import Registry

ROOT = Path(__file__).resolve().parents[1]


def _register_random_head(smollm2, tmp_path: Path, uri: str, revision: str | None = None) -> tuple[str, str]:
    head_dir = EagleHead.for_target(smollm2, seed=0).save_pretrained(tmp_path / "head")
    if revision is not None:
        config = json.loads((head_dir / "config.json").read_text())
        (head_dir / "config.json").write_text(json.dumps({**config, "target_revision": revision}))
    registry = Registry(uri)
    run_id = registry.runs.start_run("eagle-heads", f"eval-test-{tmp_path.name}", tags={"target": smollm2.name})
    registry.runs.log_artifact(run_id, head_dir, "head")
    target_version = registry.register_target(smollm2.name, smollm2.revision, {"name": smollm2.name}, run_id)
    version = registry.register_head(
        run_id, "head", smollm2.name, revision or smollm2.revision, alias="candidate", target_model_version=target_version
    )
    registry.runs.finish_run(run_id, "FINISHED")
    return run_id, version


def _evaluate(args: list[str], uri: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(MLFLOW_TRACKING_URI=uri, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "jobs.evaluate", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _production_version(client: MlflowClient) -> str | None:
    try:
        return client.get_model_version_by_alias("smollm2-135m-eagle", "production").version
    except Exception:  # no version holds the alias yet
        return None


def _evaluate_on_report(
    report: dict, promote_tau: float, uri: str, tmp_path: Path, monkeypatch, capsys, extra: tuple[str, ...] = ()
) -> tuple[int, dict]:
    """jobs.evaluate run in this process with its bench replaced by ``report`` (an earlier run's, its config
    given the seed the job passed): the job's promotion decision on a measured tau, without benching again.
    Returns (exit code, summary)."""
    import jobs.evaluate as job

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("RAY_ADDRESS", "")  # a private local Ray instance, as when run directly
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(job, "_bench", lambda settings: {**report, "config": {**report["config"], "seed": settings["seed"]}})  # by value
    capsys.readouterr()
    code = job.main(
        ["--head", "models:/smollm2-135m-eagle@candidate", "--dtype", "float32", "--promote-tau", repr(promote_tau),
         "--out", str(tmp_path / f"rebench-{promote_tau!r}.json"), *extra]
    )
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else {}


@pytest.mark.e2e
@pytest.mark.nightly
def test_evaluate_logs_to_the_training_run_and_promotes_only_at_the_gate(smollm2, mlflow_server, tmp_path, monkeypatch, capsys):
    """One real evaluation with a gate no head can reach (tau <= tree depth + 1): logged, not promoted, not an
    error. Its measured report then drives the job's gate twice more: just above tau (not promoted) and at tau
    (promoted, the gate is tau >= X)."""
    client = MlflowClient(mlflow_server)
    before = _production_version(client)  # the session's server: another module may have promoted a head
    run_id, version = _register_random_head(smollm2, tmp_path, mlflow_server)
    out = tmp_path / "bench.json"
    done = _evaluate(
        ["--head", "models:/smollm2-135m-eagle@candidate", "--prompts", "2", "--max-new-tokens", "8", "--dtype", "float32",
         "--compile", "off", "--promote-tau", "50.0", "--out", str(out)],  # the compiled path has its own tests
        mlflow_server,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["run_id"] == run_id and summary["version"] == version and summary["promoted"] is False
    assert "< the promotion threshold 50.00" in done.stderr
    metrics = client.get_run(run_id).data.metrics
    tau = metrics["eval/float32-T0/tau"]
    assert 1.0 <= tau < 50.0 and metrics["eval/float32-T0/outputs_match_plain"] == 1.0  # fp32: exact
    assert metrics["eval/float32-T0/prompts"] == 2
    assert _production_version(client) == before != version  # the alias did not move
    report = json.loads(out.read_text())
    assert report["aggregate"]["prompts"] == 2 and report["aggregate"]["tau_mean"] == tau
    artifacts = [a.path for a in client.list_artifacts(run_id, "eval/float32-T0-dynamic")]
    assert artifacts, "the bench report was not logged to the run"

    code, summary = _evaluate_on_report(report, math.nextafter(tau, math.inf), mlflow_server, tmp_path, monkeypatch, capsys)
    assert (code, summary.get("promoted"), summary.get("version")) == (0, False, version)
    assert _production_version(client) == before
    code, summary = _evaluate_on_report(report, tau, mlflow_server, tmp_path, monkeypatch, capsys)
    assert (code, summary.get("promoted"), summary.get("version")) == (0, True, version)
    assert _production_version(client) == version

    # another seed reaches the bench and logs under a namespace of its own, beside the default seed's metrics
    code, summary = _evaluate_on_report(report, 50.0, mlflow_server, tmp_path, monkeypatch, capsys, extra=("--seed", "7"))
    assert code == 0 and json.loads(Path(summary["report"]).read_text())["config"]["seed"] == 7
    metrics = client.get_run(run_id).data.metrics
    assert metrics["eval/float32-T0-seed7/tau"] == tau and metrics["eval/float32-T0/tau"] == tau


def test_a_head_for_another_target_revision_fails_in_one_line_and_promotes_nothing(smollm2, mlflow_server, tmp_path, monkeypatch, capsys):
    """Bad input, so the job runs in this process (``jobs.evaluate.main``): exit 2, one line, nothing promoted."""
    import jobs.evaluate as job

    client = MlflowClient(mlflow_server)
    _register_random_head(smollm2, tmp_path, mlflow_server, revision="gguf-sha256:0123456789abcdef")
    before = _production_version(client)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    capsys.readouterr()
    code = job.main(["--head", "models:/smollm2-135m-eagle@candidate", "--promote-tau", "0.0"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "revision" in err, err
    assert _production_version(client) == before


def test_the_alias_is_resolved_once_so_the_benched_version_is_the_promoted_one(smollm2, mlflow_server, tmp_path, monkeypatch):
    """The alias moves to another version right after evaluate resolved it (a concurrent registration): the
    head downloaded for the bench is still the resolved version's, the version the promotion would move."""
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))
    from jobs.evaluate import resolve_once

    _, first = _register_random_head(smollm2, tmp_path / "one", mlflow_server)
    _, second = _register_random_head(smollm2, tmp_path / "two", mlflow_server)
    registry = Registry(mlflow_server)
    client = MlflowClient(mlflow_server)
    client.set_registered_model_alias("smollm2-135m-eagle", "candidate", first)
    real = registry.head_version_info

    def then_moved(*args, **kwargs):
        info = real(*args, **kwargs)
        client.set_registered_model_alias("smollm2-135m-eagle", "candidate", second)  # moved while evaluate runs
        return info

    monkeypatch.setattr(registry, "head_version_info", then_moved)
    head_dir, info = resolve_once(registry, "models:/smollm2-135m-eagle@candidate", (smollm2.name, smollm2.revision))
    assert info["version"] == first
    assert Path(head_dir).name == str(first)  # the cache folder of the resolved version, not of the alias's new one
    assert client.get_model_version_by_alias("smollm2-135m-eagle", "candidate").version == second
