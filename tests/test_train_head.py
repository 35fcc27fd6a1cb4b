"""jobs.train_head end to end: Ray Train + DeepSpeed on 2 CPU workers, MLflow, kill-and-resume.

The job runs as its real entry point (``python -m jobs.train_head``) in a subprocess that starts its own local
Ray; the test kills one of its Ray Train workers mid-run and checks that the run finishes from its last
checkpoint, registers the head beside its target, and that rerunning the same run name resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from eagle.head import EagleHead
from eagle.runtime import native_bf16
from eagle_platform.registry import Runs
from jobs import layout
from jobs.presets import get_preset
from jobs.train_head import EXPERIMENT
from tests.feature_data import write_feature_dataset

ROOT = Path(__file__).resolve().parents[1]
DATASET = "tiny-train"


@pytest.fixture(scope="module")
def storage(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("storage")
    write_feature_dataset(str(root), smollm2, DATASET, conversations=24, max_length=96)
    return str(root)


def _env(mlflow_uri: str) -> dict[str, str]:
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_uri, HF_HUB_OFFLINE="1", RAY_ADDRESS="")
    env.pop("RAY_ADDRESS")
    return env


def _job(args: list[str], mlflow_uri: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jobs.train_head", *args], cwd=ROOT, env=_env(mlflow_uri),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


def _run(args: list[str], mlflow_uri: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jobs.train_head", *args], cwd=ROOT, env=_env(mlflow_uri), capture_output=True, text=True, timeout=timeout
    )


def _result(stdout: str) -> dict:
    """The job's result line (Ray forwards worker prints to the driver's stdout too, in any order)."""
    lines = [line for line in stdout.splitlines() if line.startswith('{"run_id"')]
    assert lines, f"no result line in the job's stdout: {stdout[-2000:]}"
    return json.loads(lines[-1])


def _is_train_worker(proc: psutil.Process) -> bool:
    return "RayTrainWorker" in proc.name() or "RayTrainWorker" in " ".join(proc.cmdline())


def _train_workers(root_pid: int) -> list[psutil.Process]:
    """The live Ray Train worker actors under ``root_pid``: not zombies, and not processes forked from a worker
    (a fork keeps the worker's process title, so only the one whose parent is no worker is the actor)."""
    workers = []
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and _is_train_worker(child) and not _is_train_worker(child.parent()):
                workers.append(child)
        except psutil.Error:
            continue
    return workers


def _registered_step(experiment_dir) -> int | None:
    """The step of the latest checkpoint Ray Train's controller has registered for the run in ``experiment_dir``
    (the metrics the workers reported with it, in its checkpoint manager's snapshot, written after each
    registration), or None."""
    try:
        snapshot = json.loads((experiment_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or read while it is being written
        return None
    latest = snapshot.get("latest_checkpoint_result")
    return int(latest["metrics"]["step"]) if latest else None


def _by_step(client: MlflowClient, run_id: str, key: str) -> dict[int, list[float]]:
    """Every value of ``key`` the run logged, by step (a step run again after a resume holds one value per run)."""
    values: dict[int, list[float]] = {}
    for metric in _history(client, run_id, key):
        values.setdefault(metric.step, []).append(metric.value)
    return values


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)  # polling for a condition with a deadline, not waiting out a race
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _history(client: MlflowClient, run_id: str, key: str) -> list:
    return sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)


def _offline_and_online(args: list[str], name: str, mlflow_uri: str) -> dict[str, dict]:
    """The job's result line for a 3-step run of ``args`` offline (stored features) and one online (the frozen
    target ZeRO-3-partitioned in the workers, every parameter: persistence threshold 0), by mode."""
    common = [*args, "--batch-tokens", "512", "--max-steps", "3", "--checkpoint-every", "100", "--no-register", "--max-failures", "0"]
    results = {}
    for mode, extra in (("offline", []), ("online", ["--online", "--target-persistence-threshold", "0"])):
        done = _run([*common, "--run-name", f"{name}-{mode}", *extra], mlflow_uri, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        results[mode] = _result(done.stdout)
    return results


@pytest.mark.e2e
def test_killed_worker_resumes_from_checkpoint_and_rerun_continues(storage, mlflow_server, tmp_path):
    """A run whose Ray Train worker is killed mid-run finishes from its last checkpoint: the steps from that
    checkpoint to the kill run twice and log the same losses (the weights and the optimizer state came back,
    not only the step counter); the head learned and is registered beside its target; rerunning the same run
    name continues it; a rerun its checkpoints cannot resume is refused in one line."""
    results = tmp_path / "ray_results"
    args = [
        "--preset", "quick", "--storage", storage, "--dataset", DATASET, "--run-name", "kill-test",
        "--results-dir", str(results), "--checkpoint-every", "10", "--batch-tokens", "512", "--max-failures", "2",
    ]
    # the quick preset logs the loss every 5 steps: a checkpoint every 10 leaves steps 15, 25 logged between two
    steps, every = 34, 10  # 6 more steps on the rerun reach the quick preset's 20 epochs of this data (40 steps)
    log_every = get_preset("quick").train.log_every
    assert every % log_every == 0 and every > log_every
    client = MlflowClient(mlflow_server)
    runs = Runs(mlflow_server, client=client)
    job = _job([*args, "--max-steps", str(steps)], mlflow_server)
    checkpoints = lambda: list((results / "kill-test").glob("checkpoint_*"))  # noqa: E731

    mlflow_run = None

    def logged_past_the_checkpoint() -> bool:
        # a checkpoint the controller has registered (its snapshot): a report completed on the workers sits in
        # their queues until the controller polls them, so folders on disk alone can restart from step 0; and a
        # loss logged after it, halfway to the next checkpoint (5 steps to go), which the resumed run repeats
        nonlocal mlflow_run
        if job.poll() is not None:
            return True
        registered = _registered_step(results / "kill-test")
        mlflow_run = mlflow_run or runs.find_run(EXPERIMENT, "kill-test")
        if registered is None or mlflow_run is None:
            return False
        return any(registered < step and step % every for step in _by_step(client, mlflow_run, "loss"))

    try:
        _wait_for(logged_past_the_checkpoint, 600, "a loss logged after a registered checkpoint", poll=0.2)
        assert job.poll() is None, f"the job ended before the kill: {job.communicate()[1][-3000:]}"
        workers = _wait_for(lambda: _train_workers(job.pid), 60, "the Ray Train workers")
        # freeze the workers, so the kill lands mid-run however fast this machine trains, then kill one
        for worker in workers:
            worker.suspend()
        assert len(checkpoints()) < math.ceil(steps / every), "the run reached its last checkpoint before the kill"
        victim = workers[-1]
        victim.kill()
        victim.wait(timeout=30)
        for worker in workers[:-1]:
            worker.resume()
        out, err = job.communicate(timeout=900)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-4000:]
    result = _result(out)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    resumed = _history(client, result["run_id"], "resumed_from_step")
    assert resumed and resumed[0].value >= every, f"the restarted workers did not resume from a checkpoint: {err[-3000:]}"
    # the steps from that checkpoint to the kill ran twice, on the same records in the same order, with the same
    # noise (seeded per step: jobs.train_head.micro_batch_seed), from the checkpoint's weights and optimizer
    # state: rank 0 logged the loss of each logged one twice, equal to the bit. (Measured before the per-step
    # seed: a resume that restarted the optimizer state from scratch was 15 % apart 5 steps on, one that
    # restarted the weights 67 %.)
    losses = _by_step(client, result["run_id"], "loss")
    repeated = {step: values for step, values in losses.items() if len(values) > 1}
    assert repeated, f"no logged step ran twice (resumed from step {resumed[0].value:.0f}): {sorted(losses)}"
    assert all(resumed[0].value < step < steps and len(values) == 2 for step, values in repeated.items()), (resumed[0].value, repeated)
    assert all(values[0] == values[1] for values in repeated.values()), repeated
    loss = _history(client, result["run_id"], "loss")
    assert loss[0].step == 1 and loss[-1].step == steps
    eval_tau = _history(client, result["run_id"], "eval_sim_tau")
    assert eval_tau and 1.0 <= eval_tau[-1].value <= 6.0
    assert {f"eval_acc_{d}" for d in range(1, 6)} <= set(run.data.metrics)

    # the head learned: the training loss fell from the untrained head's (step 1, before any update), and the
    # held-out top-1 and simulated acceptance at the end beat the first evaluation's (the first checkpoint)
    curves = {k: [(m.step, round(m.value, 4)) for m in _history(client, result["run_id"], k)] for k in ("loss", "eval_acc_1", "eval_sim_tau")}
    assert loss[-1].value < 0.8 * loss[0].value, curves
    eval_acc = _history(client, result["run_id"], "eval_acc_1")
    assert eval_acc[0].step < eval_acc[-1].step == steps and eval_acc[-1].value > eval_acc[0].value, curves
    assert eval_tau[-1].value > eval_tau[0].value, curves

    # the ZeRO stage DeepSpeed's engine ran, as rank 0 read it from the engine (not the job's echo of the preset)
    configured = get_preset("quick").train.zero_stage
    assert configured > 0 and run.data.params["train.zero_stage"] == str(configured)  # 0 is also what "no ZeRO" reads
    assert run.data.tags["deepspeed.zero_stage"] == str(configured)
    assert run.data.tags["deepspeed.optimizer"] == ("DeepSpeedZeroOptimizer_Stage3" if configured == 3 else "DeepSpeedZeroOptimizer")
    # the preset leaves the precision to the machine: the run records the one that ran
    assert get_preset("quick").train.autocast_bf16 is None and run.data.params["train.autocast_bf16"] == str(native_bf16())

    # registered beside its target, alias candidate, loadable as a head of that target
    version = client.get_model_version_by_alias("smollm2-135m-eagle", "candidate")
    assert version.version == result["version"] and version.run_id == result["run_id"]
    assert version.tags["target_revision"] == run.data.tags["target_revision"]
    target_version = client.get_model_version("smollm2-135m", version.tags["target_model_version"])
    assert target_version.tags["target_revision"] == version.tags["target_revision"]
    from eagle import load_target

    head = EagleHead.from_pretrained(result["head_dir"], load_target("smollm2-135m", dtype="float32"))
    assert head.config.draft_vocab_size == 16384

    # the same run name resumes: from its last step to 6 more, same MLflow run, a new head version
    again = _run([*args, "--max-steps", str(steps + 6)], mlflow_server, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    second = _result(again.stdout)
    assert second["run_id"] == result["run_id"]
    assert _history(client, result["run_id"], "resumed_from_step")[-1].value == steps
    assert _history(client, result["run_id"], "loss")[-1].step == steps + 6
    assert int(second["version"]) == int(result["version"]) + 1

    # a rerun whose checkpoints cannot resume (another DeepSpeed world size) is refused in one line before any
    # worker starts, and the finished run and its registered heads stay as they were
    other = _run([*args, "--max-steps", str(steps + 12), "--workers", "1"], mlflow_server)
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and len(lines) == 1 and "train.workers 2 -> 1" in lines[0] and "--run-name" in lines[0], other.stderr[-3000:]
    assert client.get_run(result["run_id"]).info.status == "FINISHED"
    assert client.get_model_version_by_alias("smollm2-135m-eagle", "candidate").version == second["version"]


@pytest.mark.e2e
def test_an_eagle3_head_trains_offline_and_online_alike(mlflow_server, tmp_path, smollm2):
    """The EAGLE-3 kind through the job: offline from shards holding the low / middle / high layers, online
    from the target's own capture of them while it lives in the 2 workers partitioned by ZeRO-3 (every
    parameter: persistence threshold 0), each holding half of it after real forwards; the head saved is an
    eagle3 head reading the default layers, and both modes start on the same loss curve (online features
    come from a bf16 forward, offline ones are the fp32 target's cast to bf16: close, not equal).
    (One test for both: a separate EAGLE-1 online run cost ~70 s of the suite for the same ZeRO-3 path.)"""
    from eagle.head import HeadConfig, default_aux_layers

    write_feature_dataset(str(tmp_path / "s"), smollm2, "tiny-eagle3", conversations=16, max_length=96, aux_layers=True)
    results = _offline_and_online(
        ["--preset", "quick-eagle3", "--storage", str(tmp_path / "s"), "--dataset", "tiny-eagle3", "--results-dir", str(tmp_path / "r"),
         "--rollout-depth", "3"], "eagle3", mlflow_server,
    )
    for result in results.values():
        config = HeadConfig.read(result["head_dir"])
        assert config.kind == "eagle3" and config.aux_layers == list(default_aux_layers(smollm2.config.num_hidden_layers))
        assert not config.fc_bias
    runs = {mode: result["run_id"] for mode, result in results.items()}
    client = MlflowClient(mlflow_server)
    online = client.get_run(runs["online"])
    held = json.loads(online.data.tags["target.resident_numel_per_rank"])
    total = int(online.data.tags["target.numel"])
    assert total == sum(p.numel() for p in smollm2.model.parameters())
    assert len(held) == 2 and all(abs(h - total / 2) <= 0.01 * total for h in held), (held, total)
    # besides its half, each rank keeps the borrowed embedding (SmolLM2 ties it to the LM head): vocab x hidden
    assert int(online.data.tags["target.borrowed_numel"]) == smollm2.vocab_size * smollm2.hidden_size
    curves = {mode: [m.value for m in _history(client, run_id, "loss")] for mode, run_id in runs.items()}
    assert len(curves["online"]) == len(curves["offline"]) == 2, curves
    for on, off in zip(curves["online"], curves["offline"]):
        assert abs(on - off) <= 0.05 * off, curves
    # EAGLE-3's loss has no feature term (it is logged as 0) and counts acceptance at every depth of the test
    assert all(m.value == 0.0 for m in _history(client, runs["offline"], "feature_loss"))
    assert _history(client, runs["offline"], "acc_3")


@pytest.mark.e2e
@pytest.mark.nightly
def test_a_run_that_fails_is_marked_failed_and_registers_nothing(storage, mlflow_server, tmp_path, smollm2):
    broken = tmp_path / "broken"
    write_feature_dataset(str(broken), smollm2, DATASET, conversations=8, max_length=32)
    shard = layout.dataset_storage(str(broken), "smollm2-135m", DATASET).path(layout.FEATURES, "train", layout.shard_name(0))
    Path(shard).write_bytes(b"not a safetensors file")
    client = MlflowClient(mlflow_server)
    before = {m.name: len(client.search_model_versions(f"name='{m.name}'")) for m in client.search_registered_models()}
    done = _run(
        ["--preset", "quick", "--storage", str(broken), "--dataset", DATASET, "--run-name", "broken-run",
         "--results-dir", str(tmp_path / "results"), "--max-steps", "3", "--max-failures", "0"],
        mlflow_server, timeout=600,
    )
    assert done.returncode == 1
    runs = client.search_runs([client.get_experiment_by_name("eagle-heads").experiment_id], "attributes.run_name = 'broken-run'")
    assert [r.info.status for r in runs] == ["FAILED"]
    after = {m.name: len(client.search_model_versions(f"name='{m.name}'")) for m in client.search_registered_models()}
    assert after == before


def test_bad_input_fails_in_one_line_before_any_work(storage, mlflow_server, tmp_path, smollm2, monkeypatch, capsys):
    """Each bad input is exit code 2 and one line on stderr, before Ray starts or a run is made. Called
    in-process (``jobs.train_head.main``, what ``python -m jobs.train_head`` runs): tests/tiers.py fails this
    test if any case started Ray or a process."""
    from jobs.train_head import main

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # the job's logging set-up replaces them
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def job(args: list[str]) -> tuple[int, str]:
        capsys.readouterr()
        code = main(args)
        return code, capsys.readouterr().err.strip()

    base = ["--preset", "quick", "--storage", storage, "--results-dir", str(tmp_path / "r")]
    cases = {
        "unknown target": (["--target", "no-such-model", "--dataset", DATASET], "no-such-model"),
        "missing features": (["--dataset", "never-made"], "jobs.featurize"),
        "bad number": (["--dataset", DATASET, "--workers", "0"], "--workers"),
        "bad share": (["--dataset", DATASET, "--ce-fraction", "0"], "--ce-fraction"),
        "dataset out of the storage": (["--dataset", "../../etc"], "bad dataset name '../../etc'"),  # a path, not a name
        "run name out of the results": (["--dataset", DATASET, "--run-name", "x/../../y"], "bad run name"),
        "eagle3 on features without its layers": (["--dataset", DATASET, "--head-kind", "eagle3"], "--aux-layers"),
    }
    for name, (extra, expected) in cases.items():
        code, err = job([*base, *extra])
        assert code == 2, (name, err[-2000:])
        assert len(err.splitlines()) == 1 and expected in err, (name, err)

    stale = tmp_path / "stale"
    write_feature_dataset(str(stale), smollm2, DATASET, conversations=4, max_length=32)
    store = layout.dataset_storage(str(stale), "smollm2-135m", DATASET)
    manifest = store.read_json(f"{layout.FEATURES}/{layout.MANIFEST}")
    store.write_json(f"{layout.FEATURES}/{layout.MANIFEST}", {**manifest, "target_revision": "gguf-sha256:0000000000000000"})
    code, err = job(["--preset", "quick", "--storage", str(stale), "--dataset", DATASET])
    assert code == 2 and len(err.splitlines()) == 1 and "revision" in err, err

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on the discard port
    code, err = job([*base, "--dataset", DATASET])
    assert code == 2 and len(err.splitlines()) == 1 and "MLflow" in err, err


def test_concurrent_jobs_of_one_preset_never_share_a_run_name(tmp_path):
    """Two live jobs with the default run name get different names (so different MLflow runs and results
    folders); an explicit --run-name held by a live job is refused; a name whose job ended is reused (resume)."""
    from eagle.errors import EagleError
    from jobs.train_head import lease_run_name

    first, first_lease = lease_run_name("tiny-sharegpt-quick", explicit=False, folder=tmp_path)
    second, second_lease = lease_run_name("tiny-sharegpt-quick", explicit=False, folder=tmp_path)
    assert (first, second) == ("tiny-sharegpt-quick", "tiny-sharegpt-quick-2")
    with pytest.raises(EagleError, match="held by another running training job"):
        lease_run_name("tiny-sharegpt-quick", explicit=True, folder=tmp_path)
    first_lease.close()  # that job ended (or died: the OS drops the lock either way)
    again, again_lease = lease_run_name("tiny-sharegpt-quick", explicit=True, folder=tmp_path)
    assert again == "tiny-sharegpt-quick"
    for lease in (second_lease, again_lease):
        lease.close()


def test_the_learning_rate_follows_steps_or_the_deadline_whichever_is_further_and_survives_a_resume():
    from jobs.train_head import Progress, learning_rate

    train = get_preset("quick").with_overrides(train={"lr": 1e-3, "warmup_steps": 10, "max_minutes": 10.0}).train
    assert learning_rate(train, Progress(0, 0.0), 110) == pytest.approx(1e-4)  # warmup: (0 + 1) / 10
    assert learning_rate(train, Progress(10, 0.0), 110) == pytest.approx(1e-3)
    by_steps = learning_rate(train, Progress(60, 60.0), 110)  # half the steps, a tenth of the deadline
    assert by_steps == pytest.approx(1e-3 * (1 - 0.9 * 0.5))
    assert learning_rate(train, Progress(60, 540.0), 110) == pytest.approx(1e-3 * (1 - 0.9 * 0.9))  # the deadline is further
    assert learning_rate(train, Progress(60, 900.0), 110) == pytest.approx(1e-4)  # past it: the floor
    untimed = dataclasses.replace(train, max_minutes=None)
    assert learning_rate(untimed, Progress(60, 900.0), 110) == pytest.approx(by_steps)
    saved = Progress(60, 540.0)
    assert Progress.from_json(saved.to_json()) == saved


def test_a_run_resumes_only_with_the_checkpoint_shaping_params_it_was_trained_with():
    from eagle.errors import EagleError
    from jobs.train_head import RESUME_KEYS, _flatten, check_resumable

    def params(**train):
        preset = get_preset("quick").with_overrides(train=train)
        return _flatten({"preset": preset.name, "dataset": preset.dataset, "train": dataclasses.asdict(preset.train)})

    first = params()
    assert {"train.workers", "train.zero_stage", "train.head_kind", "train.draft_vocab_size"} <= set(RESUME_KEYS) <= set(first)
    check_resumable(first, params(lr=5e-4, max_minutes=40.0, epochs=3.0), "r")  # what a longer or gentler resume changes
    with pytest.raises(EagleError, match=r"'r' exists .*train\.workers 2 -> 1; train\.zero_stage 2 -> 0.*--run-name"):
        check_resumable(first, params(workers=1, zero_stage=0), "r")
    with pytest.raises(EagleError, match=r"train\.draft_vocab_size 16384 -> 8192"):
        check_resumable(first, params(draft_vocab_size=8192), "r")
    check_resumable({k: v for k, v in first.items() if k != "train.workers"}, params(workers=1), "r")  # not logged: nothing to compare
