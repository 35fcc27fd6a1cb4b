"""The control-plane service end to end (eagle_platform.service): a real local stack (Ray head with the Jobs
API and token auth, MLflow server; infra/local/stack.sh on free ports), the service as its own process,
tiny random targets through the real jobs (``smoke`` preset sizes), Ray Serve over HTTP for the rollout.

One module, one stack, one service, in order (the steps share the pipelines they wait for):

1. bad input → 4xx with a JSON error naming the field, 401 without the token; the service stays up;
2. two concurrent onboard calls for one target → one version, one pipeline;
3. the service SIGKILLed while that pipeline trains, restarted: no second Ray job for any stage, the state
   recovers, the head is promoted once, and its pair answers an OpenAI chat request whose fp32 greedy output
   equals plain decoding;
4. a version registered directly in MLflow with a corrupt source → ``failed`` with a reason, production
   untouched;
5. retrain while serving: production (and the served pair) moves to the new head only after its gate;
6. a version of a new target registered directly in MLflow gets trained.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlflow_server import free_port
from serve_helpers import plain_text, tiny_chat_target_dir
from stack_helpers import BIN, client_env, mlflow_credentials, stack, stack_env

pytestmark = pytest.mark.slow

TINY = "tiny-chat"
PIPELINE_TIMEOUT_S = 900


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
        self.process: subprocess.Popen | None = None
        self.log = open(root / "service.log", "a")

    def start(self) -> None:
        command = [
            sys.executable, "-m", "eagle_platform.service", "--port", str(self.port), "--allowed-root", str(self.allowed),
            "--poll-s", "1", "--default-preset", "smoke", "--tau-gate", "1.0", "--eval-compile", "off",
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


def test_bad_input_is_refused_and_the_service_stays_up(platform):
    outside = platform.root / "outside"
    tiny_chat_target_dir(outside / "elsewhere")
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
    assert httpx.get(platform.base + "/v1/targets", timeout=30).json()["targets"] == []  # the refused calls registered nothing


def test_concurrent_onboard_then_a_crash_during_training_then_served(platform):
    body = {"name": TINY, "source": str(platform.allowed / TINY)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda _: platform.post("/v1/targets", body), range(2)))
    assert [r.status_code for r in responses] == [202, 202], [r.text for r in responses]
    assert {r.json()["version"] for r in responses} == {"1"}
    platform.wait(TINY, ("training",), timeout=600)
    platform.kill()
    platform.start()
    status = platform.wait(TINY, ("ready", "failed"))
    assert status["state"] == "ready", status
    assert status["tau"] >= 1.0 and status["outputs_match_plain"] is True
    mine = [job for job in platform.jobs() if (job["metadata"] or {}).get("eagle_target") == TINY]
    assert sorted(job["id"] for job in mine) == sorted(f"eagle-{TINY}-v1-{stage}-a1" for stage in ("preparing", "featurizing", "training", "evaluating"))
    assert all(job["status"] == "SUCCEEDED" for job in mine)
    head = status["production_head"]
    assert head == status["head_version"] == "1"
    from mlflow import MlflowClient

    client = MlflowClient(platform.env["MLFLOW_TRACKING_URI"])
    heads = client.search_model_versions(f"name = '{TINY}-eagle'")
    assert [v.version for v in heads] == ["1"]  # one training, one head, promoted once
    assert "eagle.promoted_ms" in heads[0].tags
    cli = platform.eaglectl("targets", "status", TINY, "--json")
    assert cli.returncode == 0 and json.loads(cli.stdout)["state"] == "ready"

    # the pair is rolled out: fp32 greedy through the OpenAI API equals plain decoding of the target
    from eagle.target import load_target

    target = load_target(str(platform.allowed / TINY), dtype="float32")
    model = f"{TINY}-eagle"
    base = f"http://127.0.0.1:{platform.serve_port}"
    reply = _chat(base, model, "Say something.", 24)
    rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}], tokenize=False, add_generation_prompt=True)
    prompt_ids = target.tokenizer.encode(rendered, add_special_tokens=False)
    assert reply["choices"][0]["message"]["content"] == plain_text(target, prompt_ids, 24)


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


def _register_directly(platform, name: str, directory: Path) -> str:
    """What a user does without the service: log a model folder to a run and register it in MLflow."""
    from mlflow import MlflowClient

    client = MlflowClient(platform.env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("by-hand") or client.get_experiment(client.create_experiment("by-hand"))
    run = client.create_run(experiment.experiment_id)
    client.log_artifacts(run.info.run_id, str(directory), "model")
    client.set_terminated(run.info.run_id)
    try:
        client.create_registered_model(name)
    except Exception:  # noqa: BLE001 - it exists
        pass
    return client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id).version


def _served_head(platform, model: str) -> str | None:
    models = httpx.get(f"http://127.0.0.1:{platform.serve_port}/v1/models", timeout=30).json()["data"]
    return next(m["eagle"].get("head_version") for m in models if m["id"] == model)


def test_retrain_while_serving_swaps_only_after_the_gate(platform):
    before = platform.status(TINY)
    assert before["state"] == "ready"
    old_head = before["production_head"]
    assert platform.post(f"/v1/targets/{TINY}/retrain").status_code == 202
    seen = set()
    deadline = time.monotonic() + PIPELINE_TIMEOUT_S
    while time.monotonic() < deadline:
        served = _served_head(platform, f"{TINY}-eagle")  # before the status: anything it saw, the status saw
        status = platform.status(TINY)
        seen.add(status["state"])
        if status["state"] in ("ready", "failed") and status["attempt"] == 2:
            break
        # until the new head's gate results are on record and pass, production and the served pair keep the
        # old one (the state turns ready just after the alias moves, so one poll may see both in evaluating)
        passed = status["tau"] is not None and status["tau"] >= status["tau_gate"] and status["outputs_match_plain"]
        allowed = {old_head, status["head_version"]} if passed else {old_head}
        assert status["production_head"] in allowed and served in allowed, (served, status)
        time.sleep(2)
    assert status["state"] == "ready", status
    assert {"training", "evaluating"} <= seen
    new_head = status["production_head"]
    assert new_head != old_head and new_head == status["head_version"]
    deadline = time.monotonic() + 120
    while _served_head(platform, f"{TINY}-eagle") != new_head:  # the replica follows the alias (watch_s 2)
        assert time.monotonic() < deadline, "the served pair did not swap to the new head"
        time.sleep(1)
    # a manual rollback moves production back to the head before
    response = platform.post(f"/v1/targets/{TINY}/rollback")
    assert response.status_code == 200 and response.json()["production_head"] == old_head, response.text
    assert platform.post(f"/v1/targets/{TINY}/promote", {"version": new_head}).json()["production_head"] == new_head


def test_a_corrupt_version_registered_in_mlflow_fails_and_production_stays(platform):
    production = platform.status(TINY)["production_head"]
    corrupt = platform.root / "corrupt" / TINY
    corrupt.mkdir(parents=True)
    for path in (platform.allowed / TINY).iterdir():
        (corrupt / path.name).write_bytes(path.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    version = _register_directly(platform, TINY, corrupt)
    status = platform.wait(TINY, ("failed",), version=version, timeout=600)
    assert status["reason"].split(":")[0] in ("preparing", "featurizing") and " job " in status["reason"], status
    assert status["production_head"] == production
    assert _served_head(platform, f"{TINY}-eagle") == production
    assert httpx.get(platform.base + "/health", timeout=10).json()["webhooks"] >= 1  # MLflow told the service


def test_a_new_target_registered_directly_in_mlflow_gets_trained(platform):
    name = "tiny-direct"
    directory = tiny_chat_target_dir(platform.root / "direct" / name, seed=3)
    version = _register_directly(platform, name, directory)
    status = platform.wait(name, ("ready", "failed"), version=version)
    assert status["state"] == "ready", status
    assert status["jobs"]["training"] == f"eagle-{name}-v{version}-training-a1"
    listing = platform.eaglectl("targets", "list", "--json")
    assert listing.returncode == 0
    assert {t["name"]: t["state"] for t in json.loads(listing.stdout)["targets"]} == {TINY: "failed", name: "ready"}
    reply = _chat(f"http://127.0.0.1:{platform.serve_port}", f"{name}-eagle", "Hello", 8)
    assert reply["choices"][0]["message"]["content"]
