"""The control-plane service end to end (eagle_platform.service): a real local stack (Ray head with the Jobs
API and token auth, MLflow server with auth; infra/local/stack.sh on free ports), the service as its own
process, tiny random targets through the real jobs (``smoke`` preset sizes), Ray Serve over HTTP for the
rollout.

One stack and one service for the module. ``tiny`` onboards the target ``tiny-chat`` once (two concurrent
onboard calls, the service SIGKILLed while the pipeline trains, then restarted) for every test that needs a
ready target; each test runs alone or in any order, and a test that adds a version of ``tiny-chat`` deletes
it afterwards (``scratch_tiny_versions``), so the target's newest version is always the fixture's.

``make test`` keeps the one real path through the service (all ``e2e``): bad input (seconds, no pipeline),
the crash during training then served, the gate refusing a head, and retrain while serving. Nightly
(``make test-all``): a corrupt version registered in MLflow, and a new target registered in MLflow.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from mlflow_server import free_port
from serve_helpers import plain_text, tiny_chat_target_dir
from stack_helpers import BIN, client_env, mlflow_credentials, stack, stack_env

pytestmark = pytest.mark.e2e

TINY = "tiny-chat"
PIPELINE_TIMEOUT_S = 900
EVAL_TAU = "eval/float32-T0/tau"  # what the gate's evaluation logs to the head's run (eagle_platform.pipeline.EVAL_PREFIX)
PROMOTED_TAG = "eagle.promoted_ms"  # on a head version: when it became production
# The largest gate the API takes: out of any head's reach (the smoke evaluation decodes 16 tokens per prompt,
# and tau counts the tokens of one decode step), so the gate refuses whatever the training made.
GATE_OUT_OF_REACH = 64.0


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """The stack, an allowed root with the tiny target, and a started service; yields a handle."""
    root = tmp_path_factory.mktemp("platform")
    stack_dir = root / "stack"
    env, _ = stack_env(stack_dir, num_cpus=2)
    up = stack("up", env, timeout=600)
    assert up.returncode == 0, up.stderr[-3000:]
    env = client_env(env, stack_dir)
    env["EAGLE_CACHE_DIR"] = str(root / "cache")
    env["EAGLE_PLATFORM_DIR"] = str(root / "state")
    env.pop("EAGLE_PLATFORM_TOKEN", None)
    allowed = root / "models"
    tiny_chat_target_dir(allowed / TINY)
    handle = Platform(env, allowed, root)
    handle.start()
    try:
        with mlflow_credentials(env):  # the test's own MLflow calls (what a user does by hand) authenticate too
            yield handle
    finally:
        handle.stop()
        stack("down", env, timeout=300)


class Platform:
    def __init__(self, env: dict, allowed: Path, root: Path):
        self.env = env
        self.allowed = allowed
        self.root = root
        self.port = free_port()
        self.serve_port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.serve_base = f"http://127.0.0.1:{self.serve_port}"
        self.process: subprocess.Popen | None = None
        self.log = open(root / "service.log", "a")

    def start(self) -> None:
        """The service with its own defaults for the gate (the smoke preset names none: tau >= 1, fp32
        exactness decides) unless an onboarding names one."""
        command = [
            sys.executable, "-m", "eagle_platform.service", "--port", str(self.port), "--allowed-root", str(self.allowed),
            "--poll-s", "1", "--default-preset", "smoke", "--eval-compile", "off",
            "--storage", str(self.root / "storage"), "--serve", "--serve-port", str(self.serve_port),
            "--serve-compile", "off", "--serve-dtype", "float32", "--serve-watch-s", "2",
            "--webhook-url", f"{self.base}/v1/webhooks/mlflow",
        ]
        self.process = subprocess.Popen(command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.tail()
            try:
                if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError("the service did not start\n" + self.tail())

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        self.log.flush()
        return (self.root / "service.log").read_text()[-4000:]

    @property
    def token(self) -> str:
        return (Path(self.env["EAGLE_PLATFORM_DIR"]) / "token").read_text().strip()

    def post(self, path: str, body: dict | None = None, *, token: str | None = "default") -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {self.token if token == 'default' else token}"}
        return httpx.post(self.base + path, json=body, headers=headers, timeout=60)

    def status(self, name: str) -> dict:
        response = httpx.get(f"{self.base}/v1/targets/{name}", timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def listing(self) -> list[dict]:
        response = httpx.get(self.base + "/v1/targets", timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["targets"]

    def wait(self, name: str, states: tuple[str, ...], timeout: float = PIPELINE_TIMEOUT_S, version: str | None = None) -> dict:
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.tail()
            status = self.status(name)
            if status["state"] in states and (version is None or status["version"] == version):
                return status
            time.sleep(1)
        raise AssertionError(f"{name} stuck at {status}\n{self.tail()}")

    def eaglectl(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(self.env, EAGLE_PLATFORM_URL=self.base)
        return subprocess.run([str(BIN / "eaglectl"), *args], env=env, capture_output=True, text=True, timeout=120)

    def jobs(self) -> list[dict]:
        """Every job of the stack's Ray, from the Jobs REST API (what `ray job list` reads)."""
        token = Path(self.env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        response = httpx.get(self.env["RAY_API_SERVER_ADDRESS"] + "/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert response.status_code == 200, response.text
        return [{"id": job["submission_id"], "status": job["status"], "metadata": job.get("metadata")} for job in response.json()]

    def mlflow(self):
        """An MlflowClient on the stack's MLflow (authenticated by the ``platform`` fixture's credentials)."""
        from mlflow import MlflowClient

        return MlflowClient(self.env["MLFLOW_TRACKING_URI"])

    def served_head(self, model: str) -> str | None:
        """The head version the served pair ``model`` runs (``GET /v1/models``), None when it is not served."""
        response = httpx.get(self.serve_base + "/v1/models", timeout=30)
        assert response.status_code == 200, response.text
        return next((m["eagle"].get("head_version") for m in response.json()["data"] if m["id"] == model), None)

    def wait_served(self, model: str, head: str, timeout: float = 600) -> str:
        """Wait until Serve runs pair ``model`` on head version ``head`` (a rollout, or a replica following the
        alias every 2 s); returns ``head``."""
        deadline = time.monotonic() + timeout
        served: Any = None
        while time.monotonic() < deadline:
            try:
                served = self.served_head(model)
            except (httpx.HTTPError, AssertionError) as err:  # Serve not up yet
                served = repr(err)
            if served == head:
                return head
            time.sleep(1)
        raise AssertionError(f"{model} serves {served}, not head {head}\n{self.tail()}")


@dataclass
class Onboarded:
    """What ``tiny`` saw, at the moment its pipeline finished (later tests retrain and add versions)."""

    responses: list[httpx.Response]  # the two concurrent onboard calls
    at_kill: dict  # the status when the service was SIGKILLed
    status: dict  # the status once the pipeline finished
    jobs: list[dict]  # the target's Ray jobs then
    heads: list  # the head model's versions then (mlflow ModelVersion)


@pytest.fixture(scope="module")
def tiny(platform) -> Onboarded:
    """``tiny-chat`` onboarded once for the module, the hard way: two concurrent onboard calls, the service
    SIGKILLed while the pipeline trains and restarted; waits until the version is ready. Tests that need a ready
    target use it; ``test_concurrent_onboard_then_a_crash_during_training_then_served`` checks what it saw."""
    body = {"name": TINY, "source": str(platform.allowed / TINY)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda _: platform.post("/v1/targets", body), range(2)))
    assert [r.status_code for r in responses] == [202, 202], [r.text for r in responses]
    at_kill = platform.wait(TINY, ("training", "failed"), timeout=600)
    platform.kill()
    platform.start()
    status = platform.wait(TINY, ("ready", "failed"))
    jobs = [job for job in platform.jobs() if (job["metadata"] or {}).get("eagle_target") == TINY]
    heads = platform.mlflow().search_model_versions(f"name = '{TINY}-eagle'")
    assert status["state"] == "ready", status
    return Onboarded(responses, at_kill, status, jobs, heads)


@pytest.fixture
def scratch_tiny_versions(platform, tiny) -> Iterator[None]:
    """Deletes from MLflow (as an operator drops a version given up on) the versions of ``tiny-chat`` the test
    added, so the target's newest version is the fixture's again: a retrain retrains the newest version."""
    client = platform.mlflow()
    kept = {v.version for v in client.search_model_versions(f"name = '{TINY}'")}
    yield
    for version in client.search_model_versions(f"name = '{TINY}'"):
        if version.version not in kept:
            client.delete_model_version(TINY, version.version)


def _logged_tau(platform, status: dict) -> float:
    """The tau the gate's evaluation logged to the run of the status's head version (MLflow, not the service)."""
    client = platform.mlflow()
    head = client.get_model_version(f"{status['name']}-eagle", status["head_version"])
    assert head.run_id == status["run_id"], (head.run_id, status)
    return client.get_run(head.run_id).data.metrics[EVAL_TAU]


def _chat(base: str, model: str, content: str, max_tokens: int, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            response = httpx.post(base + "/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
            if response.status_code == 200:
                return response.json()
            last = response.text
        except httpx.HTTPError as err:
            last = repr(err)
        time.sleep(2)
    raise AssertionError(f"{model} did not answer: {last}")


def _plain_chat(directory: Path, content: str, max_tokens: int) -> str:
    """Plain greedy decoding in fp32 of the target in ``directory`` on the chat-templated ``content``: what the
    served pair must answer at temperature 0."""
    from eagle.target import load_target

    target = load_target(str(directory), dtype="float32")
    rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return plain_text(target, target.tokenizer.encode(rendered, add_special_tokens=False), max_tokens)


def _register_directly(platform, name: str, directory: Path) -> str:
    """What a user does without the service: log a model folder to a run and register it in MLflow."""
    client = platform.mlflow()
    experiment = client.get_experiment_by_name("by-hand") or client.get_experiment(client.create_experiment("by-hand"))
    run = client.create_run(experiment.experiment_id)
    client.log_artifacts(run.info.run_id, str(directory), "model")
    client.set_terminated(run.info.run_id)
    try:
        client.create_registered_model(name)
    except Exception:  # noqa: BLE001 - it exists
        pass
    return client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id).version


def test_bad_input_is_refused_and_the_service_stays_up(platform):
    """Bad onboard bodies get a 4xx naming the field, calls without the right token a 401; an unknown target is
    a 404 (and one line from eaglectl); the service stays up and registers nothing. Seconds: kept in make test."""
    outside = platform.root / "outside"
    tiny_chat_target_dir(outside / "elsewhere")
    registered = sorted((t["name"], t["version"]) for t in platform.listing())
    cases = [
        ({"name": TINY, "source": str(platform.allowed / TINY), "preset": "no-such-preset"}, 400, "preset"),
        ({"name": "Bad Name!", "source": str(platform.allowed / TINY)}, 400, "name"),
        ({"name": "x-eagle", "source": str(platform.allowed / TINY)}, 400, "name"),
        ({"name": "elsewhere", "source": str(outside / "elsewhere")}, 403, "source"),
        ({"name": "dots", "source": str(platform.allowed / ".." / "outside" / "elsewhere")}, 403, "source"),
        ({"name": "rel", "source": "models/tiny"}, 400, "source"),
        ({"name": "smollm2-135m", "source": "builtin:nope"}, 400, "source"),
        ({"name": TINY, "source": str(platform.allowed / TINY), "tau_gate": 0.5}, 400, "tau_gate"),
        ({"name": TINY, "source": str(platform.allowed / TINY), "extra": 1}, 422, "extra"),
    ]
    for body, status, field in cases:
        response = platform.post("/v1/targets", body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["field"] == field, (body, response.text)
    for token in (None, "wrong"):
        response = platform.post("/v1/targets", {"name": TINY, "source": str(platform.allowed / TINY)}, token=token)
        assert response.status_code == 401 and response.json()["error"]["field"] == "authorization"
    assert platform.post(f"/v1/targets/{TINY}/retrain", token=None).status_code == 401
    assert httpx.get(f"{platform.base}/v1/targets/unknown-target", timeout=30).status_code == 404
    cli = platform.eaglectl("targets", "status", "unknown-target", "--json")
    assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1 and "404" in cli.stderr
    assert httpx.get(platform.base + "/health", timeout=10).json()["ok"] is True
    assert platform.process.poll() is None
    assert sorted((t["name"], t["version"]) for t in platform.listing()) == registered  # the refused calls registered nothing


def test_concurrent_onboard_then_a_crash_during_training_then_served(platform, tiny):
    """Two concurrent onboard calls make one version and one pipeline; the service SIGKILLed in training and
    restarted submits no second job for any stage, promotes the one head once, with the tau the evaluation
    logged; the pair answers an OpenAI chat request whose fp32 greedy output equals plain decoding."""
    assert {r.json()["version"] for r in tiny.responses} == {"1"}
    assert (tiny.at_kill["state"], tiny.at_kill["version"]) == ("training", "1"), tiny.at_kill
    status = tiny.status
    assert status["outputs_match_plain"] is True
    assert status["tau"] == _logged_tau(platform, status)  # the gate's record is the evaluation's measurement
    assert sorted(job["id"] for job in tiny.jobs) == sorted(f"eagle-{TINY}-v1-{stage}-a1" for stage in ("preparing", "featurizing", "training", "evaluating"))
    assert all(job["status"] == "SUCCEEDED" for job in tiny.jobs), tiny.jobs
    assert status["production_head"] == status["head_version"] == "1"
    assert [v.version for v in tiny.heads] == ["1"]  # one training, one head, promoted once
    assert PROMOTED_TAG in tiny.heads[0].tags
    cli = platform.eaglectl("targets", "status", TINY, "--json")
    assert cli.returncode == 0, cli.stderr
    live = platform.status(TINY)
    assert {key: json.loads(cli.stdout)[key] for key in ("version", "state", "production_head")} == {key: live[key] for key in ("version", "state", "production_head")}

    # the pair is rolled out: fp32 greedy through the OpenAI API equals plain decoding of the target
    reply = _chat(platform.serve_base, f"{TINY}-eagle", "Say something.", 24)
    assert reply["choices"][0]["message"]["content"] == _plain_chat(platform.allowed / TINY, "Say something.", 24)


def test_a_head_below_its_gate_stays_out_of_production_and_serve(platform, tiny, scratch_tiny_versions):
    """A new version of the served target onboarded with a gate no head reaches: its pipeline runs, its head
    is registered, and the gate refuses it on the tau its evaluation logged; production and the served pair
    keep the head they had at every poll, and the refused head is never promoted."""
    before = platform.status(TINY)
    production = before["production_head"]
    assert before["state"] == "ready" and production is not None, before
    served = platform.wait_served(f"{TINY}-eagle", production)
    # other weights, another depth: a new version of the target with a revision of its own
    source = tiny_chat_target_dir(platform.allowed / f"{TINY}-3-layers", seed=1, layers=3)
    response = platform.post("/v1/targets", {"name": TINY, "source": str(source), "tau_gate": GATE_OUT_OF_REACH})
    assert response.status_code == 202, response.text
    version = response.json()["version"]
    assert int(version) > int(before["version"])
    deadline, status = time.monotonic() + PIPELINE_TIMEOUT_S, None
    while True:
        assert time.monotonic() < deadline, f"{TINY} version {version} stuck at {status}\n{platform.tail()}"
        assert platform.process.poll() is None, platform.tail()
        now_served = platform.served_head(f"{TINY}-eagle")
        status = platform.status(TINY)
        assert status["version"] == version, status
        assert (status["production_head"], now_served) == (production, served), status
        if status["state"] in ("ready", "failed"):
            break
        time.sleep(1)
    assert status["state"] == "failed", status
    assert status["tau_gate"] == GATE_OUT_OF_REACH and status["outputs_match_plain"] is True, status
    assert status["tau"] == _logged_tau(platform, status)
    assert status["reason"] == f"gate: tau {status['tau']:.3f} < {GATE_OUT_OF_REACH:.2f}", status
    assert status["production_head"] == production and platform.served_head(f"{TINY}-eagle") == served
    candidate = platform.mlflow().get_model_version(f"{TINY}-eagle", status["head_version"])  # registered
    assert candidate.version != production
    assert PROMOTED_TAG not in candidate.tags and "production" not in candidate.aliases, (candidate.tags, candidate.aliases)


def test_retrain_while_serving_swaps_only_after_the_gate(platform, tiny):
    """A retrain of the served target: production and the served pair keep the old head until the new head's
    gate results are on record and pass, then both move to it; rollback and promote move production back and
    forth."""
    before = platform.status(TINY)
    assert before["state"] == "ready", before
    old_head = before["production_head"]
    platform.wait_served(f"{TINY}-eagle", old_head)
    assert platform.post(f"/v1/targets/{TINY}/retrain").status_code == 202
    seen = set()
    deadline = time.monotonic() + PIPELINE_TIMEOUT_S
    while time.monotonic() < deadline:
        served = platform.served_head(f"{TINY}-eagle")  # before the status: anything it saw, the status saw
        status = platform.status(TINY)
        seen.add(status["state"])
        if status["state"] in ("ready", "failed") and status["attempt"] == before["attempt"] + 1:
            break
        # until the new head's gate results are on record and pass, production and the served pair keep the
        # old one (the state turns ready just after the alias moves, so one poll may see both in evaluating)
        passed = status["tau"] is not None and status["tau"] >= status["tau_gate"] and status["outputs_match_plain"]
        allowed = {old_head, status["head_version"]} if passed else {old_head}
        assert status["production_head"] in allowed and served in allowed, (served, status)
        time.sleep(2)
    assert status["state"] == "ready" and status["version"] == before["version"], status
    assert {"training", "evaluating"} <= seen
    new_head = status["production_head"]
    assert new_head != old_head and new_head == status["head_version"]
    platform.wait_served(f"{TINY}-eagle", new_head, timeout=120)  # the replica follows the alias (watch_s 2)
    # a manual rollback moves production back to the head before
    response = platform.post(f"/v1/targets/{TINY}/rollback")
    assert response.status_code == 200 and response.json()["production_head"] == old_head, response.text
    assert platform.post(f"/v1/targets/{TINY}/promote", {"version": new_head}).json()["production_head"] == new_head


@pytest.mark.nightly
def test_a_corrupt_version_registered_in_mlflow_fails_and_production_stays(platform, tiny, scratch_tiny_versions):
    """A version registered directly in MLflow whose weights are not safetensors: MLflow's webhook tells the
    service, its data job fails, the version is failed with the job's error line, production and the served pair
    stay where they were."""
    production = platform.status(TINY)["production_head"]
    platform.wait_served(f"{TINY}-eagle", production)
    corrupt = platform.root / "corrupt" / TINY
    corrupt.mkdir(parents=True, exist_ok=True)
    for path in (platform.allowed / TINY).iterdir():
        (corrupt / path.name).write_bytes(path.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    version = _register_directly(platform, TINY, corrupt)
    status = platform.wait(TINY, ("failed",), version=version, timeout=600)
    assert status["reason"].split(":")[0] in ("preparing", "featurizing") and " job " in status["reason"], status
    assert status["production_head"] == production
    assert platform.served_head(f"{TINY}-eagle") == production
    assert httpx.get(platform.base + "/health", timeout=10).json()["webhooks"] >= 1  # MLflow told the service


@pytest.mark.nightly
def test_a_new_target_registered_directly_in_mlflow_gets_trained(platform):
    """A version of a new target registered directly in MLflow is adopted, trained, listed ready and served: its
    pair's fp32 greedy reply equals plain decoding of that target."""
    name = "tiny-direct"
    directory = tiny_chat_target_dir(platform.root / "direct" / name, seed=3)
    version = _register_directly(platform, name, directory)
    status = platform.wait(name, ("ready", "failed"), version=version)
    assert status["state"] == "ready", status
    assert status["jobs"]["training"] == f"eagle-{name}-v{version}-training-a1"
    listing = platform.eaglectl("targets", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    assert {t["name"]: t["state"] for t in json.loads(listing.stdout)["targets"]}[name] == "ready"
    reply = _chat(platform.serve_base, f"{name}-eagle", "Hello", 24)
    assert reply["choices"][0]["message"]["content"] == _plain_chat(directory, "Hello", 24)
