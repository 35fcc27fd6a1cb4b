"""jobs.evaluate: bench a registered head on a Ray worker, log to its training run, promote by threshold."""

from __future__ import annotations

import json
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


@pytest.mark.slow
def test_evaluate_logs_to_the_training_run_and_promotes(smollm2, mlflow_server, tmp_path):
    run_id, version = _register_random_head(smollm2, tmp_path, mlflow_server)
    out = tmp_path / "bench.json"
    done = _evaluate(
        ["--head", "models:/smollm2-135m-eagle@candidate", "--prompts", "2", "--max-new-tokens", "8", "--dtype", "float32",
         "--compile", "off", "--promote-tau", "1.0", "--out", str(out)],  # the compiled path has its own tests
        mlflow_server,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["run_id"] == run_id and summary["version"] == version and summary["promoted"] is True
    client = MlflowClient(mlflow_server)
    metrics = client.get_run(run_id).data.metrics
    assert metrics["eval/float32-T0/tau"] >= 1.0 and metrics["eval/float32-T0/outputs_match_plain"] == 1.0  # fp32: exact
    assert metrics["eval/float32-T0/prompts"] == 2
    assert client.get_model_version_by_alias("smollm2-135m-eagle", "production").version == version
    report = json.loads(out.read_text())
    assert report["aggregate"]["prompts"] == 2
    artifacts = [a.path for a in client.list_artifacts(run_id, "eval/float32-T0-dynamic")]
    assert artifacts, "the bench report was not logged to the run"


def test_a_head_for_another_target_revision_fails_in_one_line_and_promotes_nothing(smollm2, mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    _register_random_head(smollm2, tmp_path, mlflow_server, revision="gguf-sha256:0123456789abcdef")
    try:
        before = client.get_model_version_by_alias("smollm2-135m-eagle", "production").version
    except Exception:
        before = None
    done = _evaluate(["--head", "models:/smollm2-135m-eagle@candidate", "--promote-tau", "0.0"], mlflow_server, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "revision" in lines[0], done.stderr
    try:
        after = client.get_model_version_by_alias("smollm2-135m-eagle", "production").version
    except Exception:
        after = None
    assert after == before


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
