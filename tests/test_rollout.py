"""eagle_platform.rollout: the Serve config it writes (checked against Ray's own schema and code-version hash),
and, for real, adding a pair to a running cluster through the dashboard's REST API.

The real test starts a private local Ray instance with its dashboard (token authentication on), deploys one
tiny pair (the target alone, eager, one thread) behind the ingress, keeps streamed greedy chat requests
running back to back against it, and rolls a second pair out: every stream ends with exactly the text the
same request gives alone, the first pair's and the ingress's replica actors are the same ones before and
after, ``/health`` stays 200 throughout, and the second pair then answers over HTTP. A pair that cannot be
built fails the next rollout in one line while the served pairs keep serving.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from eagle_platform import rollout
from eagle_platform.rollout import RolloutError


def pair(model: str, target: str, **extra) -> dict:
    return {"model": model, "target": target, "head": None, "dtype": "float32", "compile": "off", "threads": 1, "num_cpus": 0.1,
            "watch_s": None, "max_tokens": 400, "autoscaling": {"min_replicas": 1, "max_replicas": 1}, **extra}


def test_serve_config_is_a_valid_deploy_config_whose_unchanged_applications_keep_their_code_version():
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeDeploySchema

    from serve.app import IngressArgs, PairAppArgs, Routes

    pairs = [pair("org/tiny", "/models/tiny"), {"model": "smollm2-135m-eagle", "target": "smollm2-135m",
                                                "head": "models:/smollm2-135m-eagle@production", "tree": {"kind": "dynamic"}}]
    settings = {"retry_after_s": 2, "backpressure_status": 429, "request_timeout_s": 30, "failover_attempts": 1}
    config = rollout.serve_config(pairs, tracking_uri="http://127.0.0.1:5000", port=8123, settings=settings)
    schema = ServeDeploySchema.model_validate(config)
    apps = {app.name: app for app in schema.applications}
    assert set(apps) == {"eagle", "pair-org_tiny", "pair-smollm2-135m-eagle"}
    assert schema.http_options.port == 8123

    ingress = apps["eagle"]
    assert (ingress.import_path, ingress.route_prefix) == ("serve.app:build_ingress_app", "/")
    assert IngressArgs.model_validate(ingress.args).request_timeout_s == 30
    assert Routes.model_validate(ingress.deployments[0].user_config).pairs == {"org/tiny": "pair-org_tiny",
                                                                               "smollm2-135m-eagle": "pair-smollm2-135m-eagle"}
    for model, name in (("org/tiny", "pair-org_tiny"), ("smollm2-135m-eagle", "pair-smollm2-135m-eagle")):
        app = apps[name]
        assert (app.import_path, app.route_prefix) == ("serve.app:build_pair_app", None)
        args = PairAppArgs.model_validate(app.args)
        assert (args.pair.model, args.tracking_uri, args.backpressure_status) == (model, "http://127.0.0.1:5000", 429)

    # the order of the pairs does not matter; adding a pair leaves the others' applications and the ingress's
    # code version as they were (Ray rebuilds an application only when that hash changes), the ingress's
    # routes change (a user_config: reconfigured in place)
    assert rollout.serve_config(pairs[::-1], tracking_uri="http://127.0.0.1:5000", port=8123, settings=settings) == config
    grown = ServeDeploySchema.model_validate(
        rollout.serve_config([*pairs, pair("new", "/models/new")], tracking_uri="http://127.0.0.1:5000", port=8123, settings=settings))
    grown_apps = {app.name: app for app in grown.applications}
    for name, app in apps.items():
        assert get_app_code_version(grown_apps[name]) == get_app_code_version(app), name
    assert grown_apps["pair-org_tiny"] == apps["pair-org_tiny"]
    assert "new" in grown_apps["eagle"].deployments[0].user_config["pairs"]

    routed = rollout.serve_config(pairs, tracking_uri=None, routed=["org/tiny"])
    assert routed["applications"][0]["deployments"][0]["user_config"] == {"pairs": {"org/tiny": "pair-org_tiny"}}
    with pytest.raises(ValueError, match="share an application name"):
        rollout.serve_config([pair("a/b", "x"), pair("a_b", "y")], tracking_uri=None)
    with pytest.raises(ValueError, match="routed models without a pair"):
        rollout.serve_config(pairs, tracking_uri=None, routed=["nope"])


def test_an_unreachable_dashboard_is_one_line():
    from mlflow_server import free_port

    with pytest.raises(RolloutError) as err:
        rollout.served_models(f"http://127.0.0.1:{free_port()}")
    assert "\n" not in str(err.value) and "ConnectError" in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# For real
# ---------------------------------------------------------------------------------------------------------


def replica_actors(dashboard: str) -> dict[str, list[str]]:
    """application -> the actor ids of its replicas (REST API)."""
    apps = rollout.details(dashboard)["applications"]
    return {name: sorted(r.get("actor_id") or "" for d in app["deployments"].values() for r in d["replicas"]) for name, app in apps.items()}


def stream_chat(base: str, model: str, messages: list[dict], max_tokens: int) -> str:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    parts = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            parts.extend(choice["delta"].get("content") or "" for choice in chunk["choices"])
    return "".join(parts)


class Load:
    """Streamed chat requests to one model back to back, and /health polls, on threads until ``stop``."""

    def __init__(self, base: str, model: str, messages: list[dict], max_tokens: int) -> None:
        self.base, self.model, self.messages, self.max_tokens = base, model, messages, max_tokens
        self.done = threading.Event()
        self.requests: list[tuple[float, float, str | BaseException]] = []  # (start, end, text or error)
        self.health: list[int] = []
        self.threads = [threading.Thread(target=self._streams, daemon=True), threading.Thread(target=self._health, daemon=True)]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        while not self.requests and not self.done.wait(0.05):  # one request has finished: the pair answers
            pass
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=180)

    def _streams(self) -> None:
        while not self.done.is_set():
            start = time.monotonic()
            try:
                result: str | BaseException = stream_chat(self.base, self.model, self.messages, self.max_tokens)
            except BaseException as err:  # noqa: BLE001 - recorded, asserted by the test
                result = err
            self.requests.append((start, time.monotonic(), result))

    def _health(self) -> None:
        while not self.done.wait(0.5):
            try:
                self.health.append(httpx.get(self.base + "/health", timeout=30).status_code)
            except httpx.HTTPError:
                self.health.append(0)


@pytest.mark.e2e
@pytest.mark.nightly
def test_adding_a_pair_keeps_the_served_pair_its_replicas_and_its_streams(tmp_path, monkeypatch):
    import ray
    from ray import serve

    from eagle.target import load_target
    from jobs.common import init_ray
    from mlflow_server import free_port
    from serve_helpers import plain_text, tiny_chat_target_dir

    dirs = {name: tiny_chat_target_dir(tmp_path / f"tiny-{name}", seed=seed) for name, seed in (("a", 0), ("b", 1))}
    targets = {name: load_target(str(path), dtype="float32") for name, path in dirs.items()}
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]

    def expected(name: str, max_tokens: int) -> str:
        tokenizer = targets[name].tokenizer
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        return plain_text(targets[name], ids, max_tokens)

    pair_a, pair_b = pair("a", str(dirs["a"])), pair("b", str(dirs["b"]))
    long_a = expected("a", 400)
    http_port = free_port()
    base = f"http://127.0.0.1:{http_port}"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    init_ray(num_cpus=2)
    dashboard = ray._private.worker.get_dashboard_url()
    timings = {}
    try:
        started = time.monotonic()
        rollout.roll_out([pair_a], dashboard, tracking_uri=None, port=http_port, timeout_s=420)
        timings["first deployment"] = time.monotonic() - started
        assert rollout.served_models(dashboard) == {"a"}
        before = replica_actors(dashboard)
        assert all(before[app] and "" not in before[app] for app in ("eagle", "pair-a")), before

        with Load(base, "a", messages, 400) as load:
            started = time.monotonic()
            rollout.roll_out([*rollout.deployed_pairs(dashboard), pair_b], dashboard, tracking_uri=None, port=http_port, timeout_s=420)
            ended = time.monotonic()
            timings["adding a pair"] = ended - started
            deadline = ended + 300  # a 400-token stream takes seconds; httpx gives up on a silent one after 120 s
            while not any(start > ended for start, _, _ in load.requests):  # one more request after the rollout
                assert time.monotonic() < deadline, f"no stream that started after the rollout finished within 300 s ({len(load.requests)} streams ended)"
                time.sleep(0.1)
        requests, health = load.requests, load.health
        print(f"{len(requests)} streams of 400 tokens, {len(health)} /health polls during {ended - started:.1f} s of rollout")

        failures = [result for _, _, result in requests if result != long_a]
        assert not failures, f"{len(failures)} of {len(requests)} streams differ from the request alone: {failures[0]!r:.300}"
        assert requests[0][0] < started and requests[-1][1] > ended
        gaps = [later[0] - earlier[1] for earlier, later in zip(requests, requests[1:])]
        assert max(gaps) < 1.0, gaps  # a stream was running at every moment of the rollout
        assert health and set(health) == {200}, health
        after = replica_actors(dashboard)
        assert after["pair-a"] == before["pair-a"] and after["eagle"] == before["eagle"], (before, after)
        assert after["pair-b"]

        assert rollout.served_models(dashboard) == {"a", "b"}
        assert rollout.deployed_pairs(dashboard) == [pair_a, pair_b]
        assert stream_chat(base, "b", messages, 48) == expected("b", 48)
        chat = httpx.post(base + "/v1/chat/completions", json={"model": "b", "messages": messages, "max_tokens": 48, "temperature": 0}, timeout=120)
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == expected("b", 48)
        models = httpx.get(base + "/v1/models", timeout=60).json()["data"]
        assert {m["id"] for m in models} == {"a", "b"} and all("error" not in m["eagle"] for m in models), models

        # a pair that cannot be built: the rollout fails in one line, the ingress never routes to it
        started = time.monotonic()
        with pytest.raises(RolloutError) as err:
            rollout.roll_out([pair_a, pair_b, pair("bad", str(dirs["a"]), bogus=1)], dashboard, tracking_uri=None, port=http_port, timeout_s=300)
        timings["a failing pair"] = time.monotonic() - started
        print("the failing pair:", err.value)
        assert "\n" not in str(err.value) and "'pair-bad' failed to deploy" in str(err.value) and "bogus" in str(err.value), err.value
        assert replica_actors(dashboard)["pair-a"] == before["pair-a"]
        assert httpx.get(base + "/health", timeout=30).json()["models"] == {"a": "ok", "b": "ok"}

        # the REST calls send the token: a wrong one is refused, in one line
        monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
        with pytest.raises(RolloutError) as err:
            rollout.served_models(dashboard)
        assert "\n" not in str(err.value) and "403" in str(err.value) and "token" in str(err.value)
    finally:
        print("timings:", {key: f"{value:.1f} s" for key, value in timings.items()})
        monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
        serve.shutdown()
        ray.shutdown()
