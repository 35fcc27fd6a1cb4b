"""The registry adapter (platform/eagle_platform/registry.py) against a real MLflow server, and
``eaglectl --head models:/...`` through the ``eagle.head_resolvers`` plug-in."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from eagle_platform import registry
from eagle_platform.registry import Registry, RegistryError, Runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def mlflow_env(mlflow_server, monkeypatch, tmp_path):
    """Point the registry at the session's server and its head cache at this test's folder."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))
    return mlflow_server


@pytest.fixture
def reg(mlflow_env) -> Registry:
    """A ``Registry`` at the session's server (from ``$MLFLOW_TRACKING_URI``, as the jobs build theirs)."""
    return Registry()


def fake_head(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "eagle-head", "hidden_size": 4}))
    save_file({"fc.weight": np.arange(32, dtype=np.float32).reshape(4, 8)}, str(directory / "model.safetensors"))
    return directory


def train_run(runs: Runs, head_dir: Path, run_name: str = "train") -> str:
    run_id = runs.start_run("eagle-test-training", run_name, {"target_name": "smollm2-135m"})
    runs.log_params(run_id, {"lr": 1e-3, "preset": "quick"})
    runs.log_metrics(run_id, {"loss": 1.5, "top1": 0.4}, step=3)
    runs.log_artifact(run_id, head_dir, "head")
    return run_id


def one_line(err: BaseException) -> str:
    text = str(err)
    assert text and "\n" not in text, repr(text)
    return text


# ----------------------------------------------------------------------------------------- no server


def test_registry_imports_no_torch():
    code = "import sys, eagle_platform.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT / "platform", check=True, timeout=120)


def test_tracking_uri_defaults_to_the_local_stack(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert registry.tracking_uri() == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:80")
    assert registry.tracking_uri() == "http://mlflow.example:80"


def test_names_and_model_uris():
    assert registry.head_model_name("smollm2-135m") == "smollm2-135m-eagle"
    assert registry.target_model_name("smollm2-135m") == "smollm2-135m"
    assert registry.head_uri("smollm2-135m") == "models:/smollm2-135m-eagle@production"
    assert registry.parse_models_uri("models:/smollm2-135m-eagle@production") == ("smollm2-135m-eagle", "production", None)
    assert registry.parse_models_uri("models:/smollm2-135m-eagle/3") == ("smollm2-135m-eagle", None, "3")
    for bad in ("models:/", "models:/a/b/c", "runs:/abc/head", "models:/a@"):
        with pytest.raises(RegistryError):
            registry.parse_models_uri(bad)
    with pytest.raises(RegistryError):
        registry.head_model_name("org/model")


def test_unreachable_server_fails_fast_in_one_line(monkeypatch):
    from mlflow_server import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    start = time.monotonic()
    for call in (lambda: registry.resolve_head("models:/smollm2-135m-eagle@production"), lambda: Runs().start_run("e", "r")):
        with pytest.raises(RegistryError) as err:
            call()
        message = one_line(err.value)
        assert message.startswith("no MLflow tracking server at http://127.0.0.1:") and "make stack-up" in message
    assert time.monotonic() - start < 5


# ----------------------------------------------------------------------------------- with a server


def test_runs_log_and_resume(mlflow_env):
    runs = Runs(mlflow_env)
    run_id = runs.start_run("eagle-test-runs", "resumable", {"job": "train-1"})
    runs.log_params(run_id, {"lr": 0.001, "layers": [1, 2]})
    runs.log_metrics(run_id, {"loss": 2.0}, step=1)
    runs.log_metrics(run_id, {"loss": 1.0}, step=2)
    runs.log_dict(run_id, {"a": 1}, "config/train.json")
    runs.finish_run(run_id, "FAILED")
    assert runs.find_run("eagle-test-runs", "resumable", tags={"job": "train-1"}) == run_id
    assert runs.find_run("eagle-test-runs", "resumable", tags={"job": "other"}) is None
    assert runs.find_run("no-such-experiment", "resumable") is None

    resumed = runs.start_run("eagle-test-runs", "resumable", {"job": "train-1"}, resume=True)
    assert resumed == run_id
    info = runs.run_info(run_id)
    assert info["status"] == "RUNNING" and info["params"] == {"lr": "0.001", "layers": "[1, 2]"}
    assert info["metrics"] == {"loss": 1.0} and info["tags"] == {"job": "train-1"}
    runs.finish_run(run_id)
    assert runs.run_info(run_id)["status"] == "FINISHED"
    # a finished run is not reopened: resuming starts a new one
    assert runs.start_run("eagle-test-runs", "resumable", {"job": "train-1"}, resume=True) != run_id
    with pytest.raises(RegistryError):
        runs.finish_run(run_id, "DONE")


def test_register_target_is_idempotent_and_keeps_a_card(reg):
    card = {"spec": "smollm2-135m", "architecture": "LlamaForCausalLM", "hidden_size": 576}
    version = reg.register_target("smollm2-135m", "q4_1-v1", card)
    assert reg.register_target("smollm2-135m", "q4_1-v1", card) == version
    assert reg.target_version("smollm2-135m", "q4_1-v1") == version
    assert reg.target_version("smollm2-135m", "never") is None
    assert reg.target_card("smollm2-135m", version) == {**card, "name": "smollm2-135m", "revision": "q4_1-v1"}
    other = reg.register_target("smollm2-135m", "q4_1-v2", card)
    assert int(other) > int(version)


def test_register_promote_and_resolve_a_head(reg, tmp_path):
    target_version = reg.register_target("smollm2-135m", "q4_1-v1", {"architecture": "LlamaForCausalLM"})
    run_id = train_run(reg.runs, fake_head(tmp_path / "head"))
    version = reg.register_head(run_id, "head", "smollm2-135m", "q4_1-v1", tags={"tau": "1.8"})

    candidate = reg.head_version_info("smollm2-135m-eagle", "candidate")
    assert candidate["version"] == version and candidate["run_id"] == run_id and "candidate" in candidate["aliases"]
    assert candidate["tags"]["target_name"] == "smollm2-135m"
    assert candidate["tags"]["target_revision"] == "q4_1-v1"
    assert candidate["tags"]["target_model_version"] == target_version
    assert candidate["tags"]["tau"] == "1.8"

    reg.promote("smollm2-135m", version)
    production = reg.head_version_info("smollm2-135m-eagle", "production")
    assert production["version"] == version and {"candidate", "production"} <= set(production["aliases"])

    local = Path(reg.resolve_head("models:/smollm2-135m-eagle@production"))
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["config.json", "model.safetensors"]
    assert (local / "model.safetensors").read_bytes() == (tmp_path / "head" / "model.safetensors").read_bytes()
    assert local.is_relative_to(tmp_path / "cache" / "heads" / "smollm2-135m-eagle")
    stamp = (local / "model.safetensors").stat().st_mtime_ns
    # the entry point's function (a Registry at $MLFLOW_TRACKING_URI) finds it cached, not downloaded again
    assert registry.resolve_head(f"models:/smollm2-135m-eagle/{version}") == str(local)
    assert (local / "model.safetensors").stat().st_mtime_ns == stamp


def test_unknown_model_alias_or_version_is_one_line(reg, tmp_path):
    reg.register_target("smollm2-135m", "q4_1-v1", {})
    reg.register_head(train_run(reg.runs, fake_head(tmp_path / "head")), "head", "smollm2-135m", "q4_1-v1")
    cases = {
        "models:/smollm2-135m-eagle@no-such-alias": "has no alias 'no-such-alias'",
        "models:/smollm2-135m-eagle/9999": "has no version 9999",
        "models:/no-such-target-eagle@production": "no registered model 'no-such-target-eagle'",
    }
    for uri, expected in cases.items():
        with pytest.raises(RegistryError) as err:
            reg.resolve_head(uri)
        assert expected in one_line(err.value)
    with pytest.raises(RegistryError, match="has no version 9999"):
        reg.promote("smollm2-135m", 9999)


def test_failed_registration_leaves_nothing_behind(reg, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    reg.register_target("tiny-x", "r1", {})
    run_id = train_run(reg.runs, fake_head(tmp_path / "head"))
    # the head's files must be logged before it is registered
    with pytest.raises(RegistryError, match="missing config.json, model.safetensors"):
        reg.register_head(run_id, "not-there", "tiny-x", "r1")
    # the target must be registered at that revision
    with pytest.raises(RegistryError, match="not registered"):
        reg.register_head(run_id, "head", "tiny-x", "r2")

    def broken(self, *args, **kwargs):
        raise MlflowException("registry store is read-only")

    with monkeypatch.context() as patch:
        patch.setattr(MlflowClient, "create_model_version", broken)
        with pytest.raises(RegistryError, match="read-only"):
            reg.register_head(run_id, "head", "tiny-x", "r1")
    mlflow_client = MlflowClient(tracking_uri=reg.uri, registry_uri=reg.uri)
    assert mlflow_client.search_model_versions("name = 'tiny-x-eagle'") == []  # no version; the (empty) model may stay

    # an alias that cannot be set removes the version it would have named; the model itself stays
    first = reg.register_head(run_id, "head", "tiny-x", "r1")
    with monkeypatch.context() as patch:
        patch.setattr(MlflowClient, "set_registered_model_alias", broken)
        with pytest.raises(RegistryError, match="read-only"):
            reg.register_head(run_id, "head", "tiny-x", "r1")
    versions = mlflow_client.search_model_versions("name = 'tiny-x-eagle'")
    assert [v.version for v in versions] == [first]


# ----------------------------------------------------------------- versions, tags and aliases of a model


def _heads(reg: Registry, target: str, tmp_path: Path, count: int) -> tuple[str, list[str]]:
    """``count`` head versions of ``target``: the first tagged ``tau`` and @candidate, the rest bare."""
    reg.register_target(target, "r1", {})
    run_id = train_run(reg.runs, fake_head(tmp_path / "head"))
    versions = [reg.register_head(run_id, "head", target, "r1", tags={"tau": "1.5"})]
    versions += [reg.register_head(run_id, "head", target, "r1", alias=None) for _ in range(count - 1)]
    return run_id, versions


def test_versions_are_every_version_oldest_first(reg, tmp_path):
    assert reg.versions("no-such-model-eagle") == []
    run_id, registered = _heads(reg, "tiny-versions", tmp_path, 11)  # 11: "10" sorts after "9", not before "2"
    reg.promote("tiny-versions", registered[1])
    versions = reg.versions("tiny-versions-eagle")
    assert [v["version"] for v in versions] == registered == [str(int(registered[0]) + i) for i in range(11)]
    first, second = versions[0], versions[1]
    assert first["aliases"] == ["candidate"] and second["aliases"] == ["production"] and versions[2]["aliases"] == []
    assert first["tags"]["tau"] == "1.5" and first["tags"]["target_revision"] == "r1" and "tau" not in second["tags"]
    assert first["run_id"] == run_id and first["source"].endswith("/head")
    assert [v["created_ms"] for v in versions] == sorted(v["created_ms"] for v in versions)
    assert [v["version"] for v in reg.versions("tiny-versions")] == [reg.target_version("tiny-versions", "r1")]


def test_version_tags_are_set_and_deleted(reg, tmp_path):
    _, (version,) = _heads(reg, "tiny-tags", tmp_path, 1)
    reg.set_version_tags("tiny-tags-eagle", version, {"gate": "passed", "tau": 2.25})
    tags = reg.versions("tiny-tags-eagle")[0]["tags"]
    assert tags["gate"] == "passed" and tags["tau"] == "2.25" and tags["target_name"] == "tiny-tags"
    reg.delete_version_tag("tiny-tags-eagle", version, "gate")
    reg.delete_version_tag("tiny-tags-eagle", version, "gate")  # already gone: no error
    assert "gate" not in reg.versions("tiny-tags-eagle")[0]["tags"]
    with pytest.raises(RegistryError) as err:
        reg.set_version_tags("tiny-tags-eagle", "9999", {"gate": "passed"})
    assert "has no version 9999" in one_line(err.value)
    with pytest.raises(RegistryError) as err:
        reg.delete_version_tag("no-such-model-eagle", "1", "gate")
    assert "no registered model 'no-such-model-eagle'" in one_line(err.value)


def test_aliases_are_read_and_deleted(reg, tmp_path):
    _, (version,) = _heads(reg, "tiny-alias", tmp_path, 1)
    assert reg.alias_version("tiny-alias-eagle", "candidate") == version
    assert reg.alias_version("tiny-alias-eagle", "production") is None  # never set
    assert reg.alias_version("no-such-model-eagle", "candidate") is None
    reg.delete_alias("tiny-alias-eagle", "candidate")
    assert reg.alias_version("tiny-alias-eagle", "candidate") is None
    reg.delete_alias("tiny-alias-eagle", "candidate")  # absent: no error
    reg.delete_alias("no-such-model-eagle", "candidate")
    assert reg.versions("tiny-alias-eagle")[0]["aliases"] == []


def test_models_lists_every_registered_model(reg, tmp_path):
    _, (version,) = _heads(reg, "tiny-models", tmp_path, 1)
    models = reg.models()
    names = [m["name"] for m in models]
    assert names == sorted(names) and {"tiny-models", "tiny-models-eagle"} <= set(names)
    by_name = {m["name"]: m for m in models}
    assert by_name["tiny-models-eagle"]["aliases"] == {"candidate": version}
    assert by_name["tiny-models"]["aliases"] == {} and by_name["tiny-models"]["tags"] == {}


# --------------------------------------------------------------------------------- eaglectl --head


def test_eaglectl_unknown_alias_or_scheme_exits_2_in_one_line(mlflow_env, capsys):
    from eagle.cli import main

    for head, expected in (
        ("models:/smollm2-135m-eagle@no-such-alias", "has no alias 'no-such-alias'"),
        ("s3://bucket/head", "no head resolver for s3: URIs"),
    ):
        code = main(["generate", "--target", "smollm2-135m", "--head", head, "--prompt", "hi", "--max-new-tokens", "4"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert err[-1].startswith("eaglectl generate: error:") and expected in err[-1], err
        assert not any("Traceback" in line for line in err)


def test_eaglectl_generates_with_a_registered_head(reg, smollm2, tmp_path, capsys):
    from eagle.cli import main
    from eagle.head import EagleHead

    EagleHead.for_target(smollm2, seed=0).save_pretrained(tmp_path / "head")
    reg.register_target("smollm2-135m", "q4_1-v1", {"architecture": "LlamaForCausalLM"})
    run_id = reg.runs.start_run("eagle-test-training", "real-head")
    reg.runs.log_artifact(run_id, tmp_path / "head", "head")
    reg.runs.finish_run(run_id)
    version = reg.register_head(run_id, "head", "smollm2-135m", "q4_1-v1")
    reg.promote("smollm2-135m", version)
    capsys.readouterr()

    code = main([
        "generate", "--target", "smollm2-135m", "--head", "models:/smollm2-135m-eagle@production",
        "--prompt", "hi", "--max-new-tokens", "4", "--json", "--compile", "off",  # the registry is the subject, not compiling
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    accepted = record["accepted_per_step"]  # the prefill's token, then accepted + 1 per step, the last step cut to the budget
    assert accepted and 1 + sum(a + 1 for a in accepted[:-1]) < record["completion_tokens"] <= min(4, 1 + sum(a + 1 for a in accepted))
    assert record["tau"] == round(sum(a + 1 for a in accepted) / len(accepted), 4)


def test_a_tracking_server_restart_is_waited_out_and_a_dead_one_is_not_bad_input(tmp_path, monkeypatch):
    """Issue 13: an MLflow restart while a job logs is retried (bounded) instead of failing the worker; a run
    whose registry died mid-run fails as a job failure (``RunFailedError``, exit 1), never as bad input, and
    marking it FAILED never hides its own error."""
    import threading

    from mlflow_server import free_port, start_mlflow_server, stop_mlflow_server

    from eagle_platform.registry import RegistryUnavailableError, with_retries
    from jobs.train_head import RunFailedError, failed_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # our retry loop, not MLflow's, is under test
    port = free_port()
    uri, process = start_mlflow_server(tmp_path / "mlflow", port=port)
    runs = Runs(uri)
    run_id = runs.start_run("restart", "restart")
    stop_mlflow_server(process)
    registry._REACHABLE.clear()
    with pytest.raises(RegistryUnavailableError):
        runs.log_metrics(run_id, {"loss": 1.0}, step=1)

    retried = threading.Event()
    outcome: dict = {}

    def log() -> None:
        try:
            with_retries(lambda: runs.log_metrics(run_id, {"loss": 2.0}, step=2), within_s=120,
                         on_retry=lambda err, wait: retried.set())
            outcome["ok"] = True
        except Exception as err:  # noqa: BLE001 - reported to the test thread
            outcome["error"] = err

    thread = threading.Thread(target=log)
    thread.start()
    assert retried.wait(60), "with_retries never retried"
    _, process = start_mlflow_server(tmp_path / "mlflow", port=port)  # the same server, back on its port
    try:
        thread.join(180)
        assert outcome == {"ok": True}, outcome
        assert runs.run_info(run_id)["metrics"]["loss"] == 2.0
    finally:
        stop_mlflow_server(process)
    registry._REACHABLE.clear()
    original = RegistryUnavailableError("logging metrics: the server went away")
    raised = failed_run(runs, run_id, original, retry_s=0.5)  # the server is down: the run cannot be marked
    assert isinstance(raised, RunFailedError) and not isinstance(raised, ValueError)
    assert "went away" in str(raised)
    bug = ZeroDivisionError("the job's own error")
    assert failed_run(runs, run_id, bug, retry_s=0.5) is bug
    with pytest.raises(RegistryError):  # outside a run, an error the user can act on is still one line
        with_retries(lambda: (_ for _ in ()).throw(RegistryError("unknown model")), within_s=5)


def test_a_registration_killed_half_way_leaves_no_usable_orphan(reg, tmp_path):
    """SIGKILL right after MLflow created the version (no cleanup can run): the version stays tagged
    ``registration=pending``, every reader refuses it, pipelines skip it, and the next registration works."""
    from eagle_platform.registry import head_model_name, is_complete

    reg.register_target("tiny-k", "r1", {})
    run_id = train_run(reg.runs, fake_head(tmp_path / "head"))
    script = (
        "import os, sys\n"
        "from mlflow import MlflowClient\n"
        "from eagle_platform.registry import Registry\n"
        "real = MlflowClient.create_model_version\n"
        "def then_killed(self, *a, **k):\n"
        "    real(self, *a, **k)\n"
        "    os._exit(9)  # what SIGKILL does: no except, no finally\n"
        "MlflowClient.create_model_version = then_killed\n"
        f"Registry({reg.uri!r}).register_head({run_id!r}, 'head', 'tiny-k', 'r1')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr[-2000:]
    name = head_model_name("tiny-k")
    [orphan] = reg.versions(name)
    assert orphan["tags"]["registration"] == "pending" and not is_complete(orphan)
    assert reg.alias_version(name, "candidate") is None
    for read in (lambda: reg.resolve_head(f"models:/{name}/{orphan['version']}"),
                 lambda: reg.head_version_info(name, version=orphan["version"])):
        with pytest.raises(RegistryError, match="registration did not finish"):
            read()
    good = reg.register_head(run_id, "head", "tiny-k", "r1")
    assert reg.alias_version(name, "candidate") == good
    assert [v["version"] for v in reg.versions(name) if is_complete(v)] == [good]
    assert reg.head_version_info(name, "candidate")["tags"]["registration"] == "complete"


def test_a_failed_registration_never_deletes_versions_another_job_added(reg, tmp_path, monkeypatch):
    """Our registration creates the head model, another job registers a version into it, then ours fails:
    undoing ours deletes only our own version (the old undo deleted the whole model, the other job's too)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    reg.register_target("tiny-c", "r1", {})
    run_id = train_run(reg.runs, fake_head(tmp_path / "head"))
    other = Registry(reg.uri)
    theirs: list[str] = []
    real_create, real_version = MlflowClient.create_registered_model, MlflowClient.create_model_version

    def create_then_other_job(self, name, *args, **kwargs):
        model = real_create(self, name, *args, **kwargs)
        with monkeypatch.context() as inner:  # the other job runs the real calls
            inner.setattr(MlflowClient, "create_model_version", real_version)
            theirs.append(other.register_head(run_id, "head", "tiny-c", "r1", alias="other"))
        return model

    def broken(self, *args, **kwargs):
        raise MlflowException("registry store is read-only")

    monkeypatch.setattr(MlflowClient, "create_registered_model", create_then_other_job)
    monkeypatch.setattr(MlflowClient, "create_model_version", broken)
    with pytest.raises(RegistryError, match="read-only"):
        reg.register_head(run_id, "head", "tiny-c", "r1")
    monkeypatch.undo()
    assert [v["version"] for v in reg.versions("tiny-c-eagle")] == theirs
    assert reg.alias_version("tiny-c-eagle", "other") == theirs[0]
