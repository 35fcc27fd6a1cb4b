"""The reconciler's own logic (eagle_platform.pipeline), fast: a real MLflow server, and in place of Ray's Jobs
API a fake client that plays what each job leaves behind (the data stage's revision claim, the training run
and its registered head, the evaluation's metrics). The real jobs on a real Ray: tests/test_platform.py.

Covered here: a crash between writing a stage's state and submitting its job (the same submission id is
submitted after the restart, never a second job), a duplicate submission refused by "Ray" and adopted, one
pipeline per target and a global cap with a queue, the gate (tau below it, outputs that differ), rollback
order, retire, sources outside the allowed roots, the webhook signature against MLflow's own signer.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from eagle_platform.pipeline import EVAL_PREFIX, TRAINING_EXPERIMENT, PipelineError, Reconciler, Settings, claim_revision, submission_id
from eagle_platform.registry import RegistryError
from eagle_platform.registry import PRODUCTION, Registry


class FakeJobs:
    """``JobSubmissionClient``'s calls the reconciler makes. ``finish(sid)`` plays the job's side effects and
    marks it SUCCEEDED; ``fail(sid)`` marks it FAILED with a one-line error in its log."""

    def __init__(self, registry: Registry, scratch: Path, tau: float = 2.0, match: bool = True):
        self.registry = registry
        self.scratch = scratch
        self.jobs: dict[str, dict] = {}
        self.submitted: list[str] = []
        self.tau = tau
        self.match = match

    def submit_job(self, *, entrypoint, submission_id, runtime_env, metadata):
        self.submitted.append(submission_id)
        if submission_id in self.jobs:
            raise RuntimeError(f"Request failed with status code 400: Job with submission_id {submission_id} already exists.")
        self.jobs[submission_id] = {"status": "RUNNING", "entrypoint": entrypoint.split(), "metadata": metadata, "log": ""}
        return submission_id

    def get_job_info(self, sid):
        if sid not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: Job {sid} does not exist.")
        job = self.jobs[sid]
        return types.SimpleNamespace(status=types.SimpleNamespace(value=job["status"]), message="")

    def get_job_logs(self, sid):
        return self.jobs[sid]["log"]

    def stop_job(self, sid):
        self.jobs[sid]["status"] = "STOPPED"

    def running(self) -> list[str]:
        return sorted(sid for sid, job in self.jobs.items() if job["status"] == "RUNNING")

    def fail(self, sid: str, line: str = "jobs.featurize: error: the target has no weights") -> None:
        self.jobs[sid].update(status="FAILED", log=f"some progress\n{line}\n")

    def finish(self, sid: str) -> None:
        job = self.jobs[sid]
        args = job["entrypoint"]
        value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
        name = job["metadata"]["eagle_target"]
        stage = job["metadata"]["eagle_stage"]
        if stage == "preparing":
            claim_revision(self.registry, name, value("--claim-version"), f"rev-{name}")
        elif stage == "training":
            runs = self.registry.runs
            run_id = runs.start_run(TRAINING_EXPERIMENT, value("--run-name"))
            folder = self.scratch / run_id / "head"
            folder.mkdir(parents=True)
            (folder / "config.json").write_text("{}")
            (folder / "model.safetensors").write_bytes(b"x")
            runs.log_artifact(run_id, str(folder), "head")
            runs.finish_run(run_id)
            self.registry.register_head(run_id, "head", name, f"rev-{name}")
        elif stage == "evaluating":
            head_name, version = value("--head").removeprefix("models:/").split("/")
            run_id = self.registry.head_version_info(head_name, None, version=version)["run_id"]
            self.registry.runs.log_metrics(run_id, {f"{EVAL_PREFIX}/tau": self.tau, f"{EVAL_PREFIX}/outputs_match_plain": float(self.match),
                                                    f"{EVAL_PREFIX}/speedup_vs_plain": 1.5})
        job["status"] = "SUCCEEDED"


@pytest.fixture()
def world(mlflow_server, tmp_path, request):
    """A reconciler on a fresh namespace of targets (names carry the test's name: the server is shared)."""
    registry = Registry(mlflow_server)
    jobs = FakeJobs(registry, tmp_path / "heads")
    (tmp_path / "allowed" / "model").mkdir(parents=True)
    model = tmp_path / "allowed" / "model"
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"weights")
    settings = Settings(state_dir=tmp_path / "state", allowed_roots=(tmp_path / "allowed",), presets=("smoke", "quick"),
                        preset_gates={"quick": 1.4}, default_preset="smoke", max_concurrent=1)
    ready = []
    reconciler = Reconciler(registry, jobs, settings, on_ready=ready.append)
    prefix = request.node.name.replace("_", "-")[5:30].strip("-")
    yield types.SimpleNamespace(registry=registry, jobs=jobs, reconciler=reconciler, model=model, prefix=prefix, ready=ready, tmp=tmp_path)
    for name in reconciler.targets():  # the server is shared: leave no running pipeline to count against the cap
        if name.startswith(prefix):
            reconciler.retire(name)


def run_pipeline(world, name: str, *, stop_before: str | None = None) -> None:
    """Reconcile and finish each job in turn until the version is ready or failed (or ``stop_before`` runs)."""
    for _ in range(12):
        world.reconciler.reconcile_once()
        status = world.reconciler.status(name)
        if status["state"] in ("ready", "failed") or status["state"] == stop_before:
            return
        for sid in world.jobs.running():
            if world.jobs.jobs[sid]["metadata"]["eagle_target"] == name:
                world.jobs.finish(sid)
    raise AssertionError(world.reconciler.status(name))


def test_a_pipeline_runs_its_four_jobs_once_and_promotes(world):
    name = f"{world.prefix}-a"
    status = world.reconciler.onboard(name, str(world.model))
    assert status["state"] == "registered" and status["version"] == "1" and status["tau_gate"] == 1.0
    assert world.reconciler.onboard(name, str(world.model))["version"] == "1"  # the same source again: the same version
    run_pipeline(world, name)
    status = world.reconciler.status(name)
    assert status["state"] == "ready" and status["tau"] == 2.0 and status["outputs_match_plain"] is True
    stages = ("preparing", "featurizing", "training", "evaluating")
    assert world.jobs.submitted == [submission_id(name, "1", stage, 1) for stage in stages]
    assert status["production_head"] == status["head_version"] == "1"
    assert world.ready == [name]
    assert world.registry.alias_version(f"{name}-eagle", PRODUCTION) == "1"


def test_a_reader_who_sees_the_alias_move_also_sees_the_gate_results(world, monkeypatch):
    """The alias moves between two tag writes (results, then the state); a status read in that window must
    show the results that passed the gate, not a promoted head beside an empty gate (CI saw that race)."""
    name = f"{world.prefix}-r"
    seen = []
    promote = world.registry.promote

    def promote_and_look(*args, **kwargs):
        promote(*args, **kwargs)
        seen.append(world.reconciler.status(name))

    monkeypatch.setattr(world.registry, "promote", promote_and_look)
    world.reconciler.onboard(name, str(world.model))
    run_pipeline(world, name)
    (status,) = seen
    assert status["state"] == "evaluating" and status["production_head"] == status["head_version"] == "1"
    assert status["tau"] == 2.0 and status["tau"] >= status["tau_gate"] and status["outputs_match_plain"] is True
    assert world.reconciler.status(name)["state"] == "ready"


def test_a_revision_registered_outside_the_service_moves_to_the_onboarded_version(world):
    name = f"{world.prefix}-x"
    external = world.registry.register_target(name, f"rev-{name}", {"by": "infra/local/pipeline.sh"})
    world.reconciler.reconcile_once()
    assert world.reconciler.status(name)["state"] == "external"  # not the service's to train
    world.reconciler.onboard(name, str(world.model))
    run_pipeline(world, name)
    status = world.reconciler.status(name)
    assert status["state"] == "ready" and status["version"] == "2"
    assert world.registry.target_version(name, f"rev-{name}") == "2"
    old = world.registry.versions(name)[0]
    assert old["version"] == external and old["tags"]["superseded_revision"] == f"rev-{name}"
    # a queued or running pipeline keeps its revision
    world.registry.set_version_tags(name, "2", {"eagle.state": "training"})
    with pytest.raises(RegistryError):
        claim_revision(world.registry, name, external, f"rev-{name}")


def test_a_crash_between_state_and_submission_submits_the_same_id_once(world):
    name = f"{world.prefix}-b"
    world.reconciler.onboard(name, str(world.model))
    world.reconciler.reconcile_once()
    first = submission_id(name, "1", "preparing", 1)
    assert world.jobs.running() == [first]
    # the state says "preparing" but the job never reached Ray (the service died in between)
    del world.jobs.jobs[first]
    restarted = Reconciler(world.registry, world.jobs, world.reconciler.settings)
    restarted.reconcile_once()
    assert world.jobs.running() == [first] and world.jobs.submitted == [first, first]
    # and a service that submits an id Ray has already seen adopts the existing job
    restarted._submit(name, restarted.versions(name)[-1], "preparing")
    assert list(world.jobs.jobs) == [first]
    world.jobs.finish(first)
    restarted.reconcile_once()
    assert restarted.status(name)["state"] == "featurizing"


def test_one_pipeline_per_target_and_a_global_cap(world):
    """The queue (module docstring, "Scheduling"), with a cap of 2: versions onboarded in an order unlike their
    names' (c1, c2, a1, b1) start oldest first, a target that runs one already skipped (c2 lets a1 pass); each
    slot a pipeline frees, by failing (c1) or by becoming ready (a1), goes to the oldest version that may start;
    never more than 2 pipelines run, nor 2 of one target, and the queue drains."""
    world.reconciler.settings.max_concurrent = 2
    a, b, c = (f"{world.prefix}-{letter}" for letter in "abc")
    other = world.tmp / "allowed" / "other"  # a second source: a second version of c
    other.mkdir()
    for path in world.model.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    onboarded = [(c, "1", world.model), (c, "2", other), (a, "1", world.model), (b, "1", world.model)]
    for name, number, source in onboarded:
        assert world.reconciler.onboard(name, str(source))["version"] == number

    def versions() -> list[dict]:
        return [next(v for v in world.reconciler.versions(name) if v["version"] == number) for name, number, _ in onboarded]

    def reconcile() -> list[str]:
        """One pass, the invariants checked after it, and the states of c1, c2, a1, b1."""
        world.reconciler.reconcile_once()
        running = world.jobs.running()
        assert len({world.jobs.jobs[sid]["metadata"]["eagle_target"] for sid in running}) == len(running) <= 2, running
        return [v["pipeline"]["state"] for v in versions()]

    created = [v["created_ms"] for v in versions()]
    assert created == sorted(set(created))  # the registration times, which order the queue, follow the onboarding
    assert reconcile() == ["preparing", "registered", "preparing", "registered"]  # c2 waits for c1, b1 for the cap
    world.jobs.fail(submission_id(c, "1", "preparing", 1))
    assert reconcile() == ["failed", "preparing", "preparing", "registered"]  # c1's slot: c2 is older than b1
    stages = ("preparing", "featurizing", "training", "evaluating", "ready")
    for stage, following in zip(stages, stages[1:]):  # a1 runs to the end; b1 waits for its slot
        world.jobs.finish(submission_id(a, "1", stage, 1))
        assert reconcile() == ["failed", "preparing", following, "registered" if following != "ready" else "preparing"]
    started = [sid for sid in world.jobs.submitted if "-preparing-" in sid]
    assert started == [submission_id(name, number, "preparing", 1) for name, number in ((c, "1"), (a, "1"), (c, "2"), (b, "1"))]
    assert len(world.jobs.submitted) == len(set(world.jobs.submitted))  # every job once


def test_the_gate_keeps_production_when_tau_is_low_or_outputs_differ(world):
    name = f"{world.prefix}-g"
    world.reconciler.onboard(name, str(world.model))
    run_pipeline(world, name)
    assert world.reconciler.status(name)["production_head"] == "1"
    world.registry.set_version_tags(name, "1", {"eagle.tau_gate": "1.5"})
    world.jobs.tau = 1.1
    world.reconciler.retrain(name)
    run_pipeline(world, name)
    status = world.reconciler.status(name)
    assert status["state"] == "failed" and status["reason"] == "gate: tau 1.100 < 1.50", status
    assert (status["head_version"], status["production_head"]) == ("2", "1")
    world.jobs.tau, world.jobs.match = 3.0, False
    world.reconciler.retrain(name)
    run_pipeline(world, name)
    status = world.reconciler.status(name)
    assert status["state"] == "failed" and status["reason"] == "gate: fp32 outputs differ from plain decoding"
    assert (status["head_version"], status["production_head"]) == ("3", "1")
    assert status["jobs"]["training"] == submission_id(name, "1", "training", 3)
    assert world.ready == [name]  # only the first attempt rolled out


def test_a_failed_job_fails_the_version_with_its_one_line_error(world):
    name = f"{world.prefix}-f"
    world.reconciler.onboard(name, str(world.model))
    world.reconciler.reconcile_once()
    world.jobs.finish(submission_id(name, "1", "preparing", 1))
    world.reconciler.reconcile_once()
    world.jobs.fail(submission_id(name, "1", "featurizing", 1))
    world.reconciler.reconcile_once()
    status = world.reconciler.status(name)
    assert status["state"] == "failed"
    assert status["reason"] == f"featurizing: job {submission_id(name, '1', 'featurizing', 1)} failed: jobs.featurize: error: the target has no weights"
    assert status["production_head"] is None and world.ready == []


def test_rollback_promote_and_retire(world):
    name = f"{world.prefix}-r"
    world.reconciler.onboard(name, str(world.model))
    run_pipeline(world, name)
    with pytest.raises(PipelineError) as err:
        world.reconciler.rollback(name)
    assert err.value.status == 409
    world.reconciler.retrain(name)
    run_pipeline(world, name)
    assert world.reconciler.status(name)["production_head"] == "2"
    assert world.reconciler.rollback(name)["production_head"] == "1"
    with pytest.raises(PipelineError):
        world.reconciler.rollback(name)  # 2 was rolled back, nothing before 1
    assert world.reconciler.promote(name, "2")["production_head"] == "2"
    with pytest.raises(PipelineError) as err:
        world.reconciler.promote(name, "9")
    assert err.value.status == 404 and err.value.field == "version"
    world.reconciler.retrain(name)
    world.reconciler.reconcile_once()
    running = world.jobs.running()
    assert running == [submission_id(name, "1", "preparing", 3)]
    status = world.reconciler.retire(name)
    assert status["retired"] and status["state"] == "failed" and status["reason"] == "retired"
    assert world.jobs.jobs[running[0]]["status"] == "STOPPED"
    world.reconciler.reconcile_once()
    assert world.jobs.running() == []


def test_bad_sources_and_names_are_refused(world, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (outside / "model.safetensors").write_bytes(b"x")
    link = world.tmp / "allowed" / "sneaky"
    link.symlink_to(outside)
    remote = world.tmp / "allowed" / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "x.Model"}}))
    (remote / "model.safetensors").write_bytes(b"x")
    pickled = world.tmp / "allowed" / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"x")
    cases = [
        ("ok-name", str(outside), 403, "source"),
        ("ok-name", str(link), 403, "source"),
        ("ok-name", str(remote), 400, "source"),
        ("ok-name", str(pickled), 400, "source"),
        ("ok-name", "relative/dir", 400, "source"),
        ("ok-name", "builtin:nope", 400, "source"),
        ("other", "builtin:smollm2-135m", 400, "name"),
        ("UPPER", str(world.model), 400, "name"),
        ("../x", str(world.model), 400, "name"),
        ("a-eagle", str(world.model), 400, "name"),
    ]
    for name, source, status, field in cases:
        with pytest.raises(PipelineError) as err:
            world.reconciler.onboard(name, source)
        assert (err.value.status, err.value.field) == (status, field), (name, source, err.value)
    with pytest.raises(PipelineError) as err:
        world.reconciler.onboard("ok-name", str(world.model), preset="nope")
    assert err.value.field == "preset"
    assert world.jobs.submitted == []


def test_the_webhook_signature_is_mlflows():
    from mlflow.webhooks.delivery import _generate_hmac_signature

    from eagle_platform.service import webhook_signature

    payload = json.dumps({"entity": "model_version", "action": "created", "data": {"name": "m", "version": "1"}})
    assert webhook_signature("s3cret", "d-1", "1700000000", payload.encode()) == _generate_hmac_signature("s3cret", "d-1", "1700000000", payload)
    assert webhook_signature("other", "d-1", "1700000000", payload.encode()) != _generate_hmac_signature("s3cret", "d-1", "1700000000", payload)


def test_the_api_wants_its_token_and_mlflows_signature(world):
    import time

    from fastapi.testclient import TestClient

    from eagle_platform.service import Loop, create_app, webhook_signature

    loop = Loop(world.reconciler, 3600)  # not started: the test drives the reconciler itself
    client = TestClient(create_app(world.reconciler, loop, token="right", webhook_secret="hook-secret"))
    body = {"name": f"{world.prefix}-api", "source": str(world.model)}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic right"}):
        response = client.post("/v1/targets", json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["field"] == "authorization"
    response = client.post("/v1/targets", json={**body, "bogus": 1}, headers={"Authorization": "Bearer right"})
    assert response.status_code == 422 and response.json()["error"]["field"] == "bogus"
    response = client.post("/v1/targets", json=body, headers={"Authorization": "Bearer right"})
    assert response.status_code == 202 and response.json()["state"] == "registered"
    assert client.get(f"/v1/targets/{body['name']}").json()["version"] == "1"
    assert client.get("/v1/targets/Bad!").status_code == 400

    payload = json.dumps({"entity": "model_version", "action": "created", "data": {}}).encode()
    stamp = str(int(time.time()))
    good = {"X-MLflow-Delivery-Id": "d1", "X-MLflow-Timestamp": stamp, "X-MLflow-Signature": webhook_signature("hook-secret", "d1", stamp, payload)}
    assert client.post("/v1/webhooks/mlflow", content=payload, headers=good).status_code == 200
    assert loop.webhooks == 1
    forged = {**good, "X-MLflow-Signature": webhook_signature("guess", "d1", stamp, payload)}
    assert client.post("/v1/webhooks/mlflow", content=payload, headers=forged).status_code == 401
    old = str(int(time.time()) - 3600)
    stale = {**good, "X-MLflow-Timestamp": old, "X-MLflow-Signature": webhook_signature("hook-secret", "d1", old, payload)}
    assert client.post("/v1/webhooks/mlflow", content=payload, headers=stale).status_code == 401
    assert client.post("/v1/webhooks/mlflow", content=payload + b" ", headers=good).status_code == 401  # body changed
    assert loop.webhooks == 1
    assert client.get("/health").json()["webhooks"] == 1
