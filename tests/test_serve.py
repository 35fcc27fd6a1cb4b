"""The Serve application for real: a private local Ray cluster, Ray Serve's HTTP proxy on 127.0.0.1, tiny chat
pairs deployed by ``serve.app.build_app``; requests over HTTP with httpx and the official ``openai`` client.

Covers: T=0 outputs equal plain decoding, streamed chunks concatenate to the non-streamed text, routing by
``model``, 4xx bodies with the server alive, back-pressure (503 + Retry-After), autoscaling 1 -> 2 -> 1
under a bounded load, failover (a replica's process SIGKILLed under load: no request lost or hung, every
text exact; a single replica's requests wait for its replacement), and the Prometheus metrics exported
through Ray's metrics agent.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import logging
import math
import os
import signal
import threading
import time
import urllib.request

import httpx
import pytest

from eagle.target import load_target
from mlflow_server import free_port
from serve_helpers import plain_text, register_head, tiny_chat_target_dir, tiny_head_dir

import ray  # noqa: E402
from ray import serve  # noqa: E402

from jobs.common import init_ray  # noqa: E402
from serve.app import build_app, deployment_name  # noqa: E402

pytestmark = pytest.mark.e2e  # make test keeps the T=0 equality over HTTP and the replica SIGKILL under load
logger = logging.getLogger(__name__)

APP = "eagle"
DEADLINE_S = 120.0


def replica_states(model: str) -> dict[str, int]:
    status = serve.status().applications[APP].deployments[deployment_name(model)]
    return {str(getattr(state, "value", state)): count for state, count in status.replica_states.items()}


def running(model: str) -> int:
    return replica_states(model).get("RUNNING", 0)


def wait_for(predicate, what: str, timeout: float = DEADLINE_S, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# The pairs each test talks to: the app deploys those of the tests selected (make test's two tests need four of the
# seven pairs, and every replica costs a process start on 2 cores).
PAIRS_USED = {
    "test_openai_client_t0_equals_plain_decoding_and_streams_the_same_text": {"a", "b", "a-plain"},
    "test_bad_input_is_4xx_with_an_error_body_and_the_server_stays_up": {"a"},
    "test_backpressure_answers_503_with_retry_after_instead_of_queueing": {"busy"},
    "test_autoscaling_goes_from_one_replica_to_two_and_back": {"scale"},
    "test_metrics_are_exported_for_prometheus": {"a"},
    "test_a_killed_replica_is_replaced_and_its_requests_wait_for_it": {"a"},
    "test_sigkilling_a_replica_under_load_loses_no_request": {"failover"},
    "test_loadtest_level_records_every_request": {"b"},
    "test_moving_the_alias_swaps_the_head_without_dropping_a_streamed_request": {"swap"},
}


def selected_pairs(request: pytest.FixtureRequest) -> set[str]:
    """The pairs the selected tests of this module use (``PAIRS_USED``)."""
    names = {item.originalname for item in request.session.items if item.module is request.module}
    return set().union(*(PAIRS_USED[name] for name in names))


@pytest.fixture(scope="module")
def app(request, tmp_path_factory, mlflow_server):
    """Deploy the tiny pairs the selected tests use (of seven) behind the ingress; yield (base_url, metrics_port,
    targets, swap_context).

    "swap" serves ``models:/tiny-a-eagle@production`` from the session's MLflow server and polls it every
    second; its first version is registered before the deployment starts."""
    root = tmp_path_factory.mktemp("serve")
    dirs = {name: tiny_chat_target_dir(root / f"tiny-{name}", seed=seed) for name, seed in (("a", 0), ("b", 1))}
    heads = {name: tiny_head_dir(path, root / f"head-{name}", seed=7) for name, path in dirs.items()}
    saved_env = {key: os.environ.get(key) for key in ("MLFLOW_TRACKING_URI", "EAGLE_CACHE_DIR")}
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server
    os.environ["EAGLE_CACHE_DIR"] = str(root / "cache")
    target_a = load_target(str(dirs["a"]), dtype="float32")
    first_version = register_head(heads["a"], target_a)
    # pair "a" runs compiled, as served pairs do by default; the rest eagerly (each compiled replica pays
    # its compile at start-up, which this module's many pairs cannot afford on 2 cores)
    common = {"dtype": "float32", "threads": 1, "num_cpus": 0.1, "max_tokens": 256, "watch_s": None, "compile": "off"}
    fixed = {"min_replicas": 1, "max_replicas": 1}
    pairs = [
        {"model": "a", "target": str(dirs["a"]), "head": str(heads["a"]), **common, "compile": "on", "autoscaling": fixed},
        {"model": "b", "target": str(dirs["b"]), "head": str(heads["b"]), **common, "autoscaling": fixed},
        {"model": "a-plain", "target": str(dirs["a"]), "head": None, **common, "autoscaling": fixed},
        {"model": "busy", "target": str(dirs["a"]), "head": str(heads["a"]), **common, "autoscaling": fixed,
         "max_ongoing_requests": 1, "max_queued_requests": 1},
        {"model": "scale", "target": str(dirs["a"]), "head": str(heads["a"]), **common, "max_ongoing_requests": 2,
         "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
                         "downscale_delay_s": 3, "metrics_interval_s": 0.5, "look_back_period_s": 2}},
        {"model": "swap", "target": str(dirs["a"]), "head": "models:/tiny-a-eagle@production", **common, "watch_s": 1.0,
         "autoscaling": fixed},
        {"model": "failover", "target": str(dirs["a"]), "head": str(heads["a"]), **common, "max_ongoing_requests": 8,
         "autoscaling": {"min_replicas": 2, "max_replicas": 2}},
    ]
    wanted = selected_pairs(request)
    pairs = [pair for pair in pairs if pair["model"] in wanted]
    metrics_port = free_port()
    http_port = free_port()
    init_ray(num_cpus=8, metrics_export_port=metrics_port)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(build_app({"pairs": pairs, "retry_after_s": 2, "tracking_uri": mlflow_server}), name=APP, route_prefix="/")
    targets = {name: load_target(str(path), dtype="float32") for name, path in dirs.items()}
    swap = {"target": target_a, "target_dir": dirs["a"], "root": root, "first_version": first_version}
    try:
        yield f"http://127.0.0.1:{http_port}", metrics_port, targets, swap
    finally:
        serve.shutdown()
        ray.shutdown()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def post(base: str, path: str, body, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=timeout)


def test_openai_client_t0_equals_plain_decoding_and_streams_the_same_text(app, request):
    import openai

    base, _, targets, _ = app
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    for model, target_name in (("a", "a"), ("b", "b"), ("a-plain", "a")):
        target = targets[target_name]
        prompt = "The quick brown fox"
        expected = plain_text(target, target.tokenizer.encode(prompt), 32)
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        assert completion.choices[0].text == expected, model
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, stream=True) if chunk.choices)
        assert streamed == expected, model

    target = targets["b"]
    messages = [{"role": "user", "content": "What is a tree?"}]
    rendered = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = plain_text(target, target.tokenizer.encode(rendered, add_special_tokens=False), 40)
    chat = client.chat.completions.create(model="b", messages=messages, max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == expected
    assert chat.usage.completion_tokens <= 40
    stream = client.chat.completions.create(model="b", messages=messages, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert {m.id for m in client.models.list()} == selected_pairs(request)  # every pair deployed, and only those


@pytest.mark.nightly
def test_bad_input_is_4xx_with_an_error_body_and_the_server_stays_up(app):
    base, _, _, _ = app
    cases = [
        (httpx.post(base + "/v1/completions", content=b"{oops", headers={"content-type": "application/json"}, timeout=30), 400),
        (post(base, "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": "many"}), 400),
        (post(base, "/v1/completions", {"model": "zzz", "prompt": "x"}), 404),
        (post(base, "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 0}), 400),
        (post(base, "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 100000}), 400),
        (post(base, "/v1/completions", {"model": "a", "prompt": "token " * 700, "max_tokens": 4}), 400),
        (post(base, "/v1/completions", {"model": "a", "prompt": "token " * 700, "max_tokens": 4, "stream": True}), 400),
        (post(base, "/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}], "temperature": -1}), 400),
        (post(base, "/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}], "top_p": 2}), 400),
        (httpx.post(base + "/v1/completions", content=b'{"model": "a", "prompt": "x"}', headers={"content-type": "text/plain"}, timeout=30), 415),
        (httpx.post(base + "/v1/completions", content=b'{"model": "a", "prompt": "' + b"x" * (2 << 20) + b'"}',
                    headers={"content-type": "application/json"}, timeout=30), 413),
        (post(base, "/v1/completions", {"model": "a", "prompt": "x", "seed": 2**64}), 400),
        (post(base, "/v1/completions", {"model": "a", "prompt": "x", "temperature": 1e-300}), 400),
        (post(base, "/v1/completions", {"model": "a", "prompt": "x", "logprobs": 1}), 400),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["message"]
    assert cases[5][0].json()["error"]["code"] == "context_length_exceeded"
    health = httpx.get(base + "/health", timeout=30)
    assert health.status_code == 200 and set(health.json()["models"].values()) == {"ok"}
    assert post(base, "/v1/completions", {"model": "a", "prompt": "still here", "max_tokens": 4}).status_code == 200


@pytest.mark.nightly
def test_backpressure_answers_503_with_retry_after_instead_of_queueing(app):
    """busy: one request on its replica, one queued at the caller; the rest of a burst is refused at once."""
    base, _, _, _ = app
    body = {"model": "busy", "prompt": "Count:", "max_tokens": 200, "temperature": 0}
    with futures.ThreadPoolExecutor(8) as pool:
        burst = [pool.submit(post, base, "/v1/completions", body, timeout=120) for _ in range(8)]
        # /health does not queue behind the saturated pair (it asks Serve's controller, not the replica)
        started = time.monotonic()
        health = httpx.get(base + "/health", timeout=30)
        health_s, running_meanwhile = time.monotonic() - started, not all(f.done() for f in burst)
        responses = [f.result() for f in burst]
    assert health.status_code == 200 and health.json()["models"]["busy"] == "ok", health.text
    assert health_s < 5 and running_meanwhile, (health_s, running_meanwhile)
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
    for response in responses:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "2"
            assert response.json()["error"]["code"] == "overloaded"


def bounded_load(base: str, model: str, *, workers: int, until, max_requests: int, timeout_s: float, stream: bool = False,
                 answering: threading.Event | None = None, max_tokens: int = 160, client_timeout_s: float = 60.0) -> list:
    """``workers`` loopback clients send requests until ``until()`` is true, ``max_requests`` were sent or
    ``timeout_s`` passed; returns (status, body) per request, in the order sent. Each request has its own
    client timeout. ``answering`` is set once a response has started arriving."""
    deadline = time.monotonic() + timeout_s
    sent = 0
    results: list = []

    def one(i: int):
        body = {"model": model, "prompt": f"Request {i}: once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=client_timeout_s) as response:
                if answering is not None and response.status_code == 200:
                    answering.set()
                raw = response.read().decode()
            return response.status_code, raw
        except httpx.TimeoutException:
            return "timeout", ""

    with futures.ThreadPoolExecutor(workers) as pool:
        jobs = []
        while time.monotonic() < deadline and sent < max_requests and not until():
            while sum(not f.done() for f in jobs) < workers and sent < max_requests:
                jobs.append(pool.submit(one, sent))
                sent += 1
            futures.wait([f for f in jobs if not f.done()], timeout=0.2, return_when=futures.FIRST_COMPLETED)
        results.extend(f.result() for f in jobs)
    return results


def sse_payloads(raw: str) -> list:
    """The JSON events of an SSE body, after checking it ends in ``[DONE]``."""
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-300:]
    return [json.loads(e) for e in events[:-1]]


def replica_pids(model: str) -> dict[str, int]:
    """Replica id (``X-Eagle-Replica``) -> pid of the live replica actors of ``model``'s deployment."""
    from ray.util.state import list_actors

    marker = f"#{deployment_name(model)}#"
    alive = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")], limit=10_000)
    return {a.name.rsplit("#", 1)[1]: a.pid for a in alive if a.name and marker in a.name and a.pid}


@pytest.mark.nightly
def test_autoscaling_goes_from_one_replica_to_two_and_back(app):
    base, _, _, _ = app
    assert running("scale") == 1
    results = bounded_load(base, "scale", workers=6, until=lambda: running("scale") >= 2, max_requests=400, timeout_s=90)
    assert running("scale") == 2, replica_states("scale")
    assert all(status == 200 for status, _ in results), {s for s, _ in results}
    wait_for(lambda: running("scale") == 1 and sum(replica_states("scale").values()) == 1, "scale-down to one replica")


@pytest.mark.nightly
def test_metrics_are_exported_for_prometheus(app):
    _, metrics_port, _, _ = app

    def scrape() -> str | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return text if "eagle_generated_tokens" in text and "eagle_tau" in text else None

    text = wait_for(scrape, "eagle_* metrics on the metrics agent", every=2.0)
    for name in ("eagle_requests", "eagle_generated_tokens", "eagle_tau_bucket", "eagle_time_to_first_token_s_bucket", "eagle_request_latency_s_bucket"):
        assert name in text, name
    assert 'model="a"' in text


@pytest.mark.nightly
def test_a_killed_replica_is_replaced_and_its_requests_wait_for_it(app):
    """Kill pair a's only replica while streamed requests run on it: the ingress fails them over, which with
    one replica means waiting (within its deadline, 120 s) for the replacement Serve starts; every request
    is answered (200, no error event) with the exact text, none times out, at least one was resumed."""
    base, _, targets, _ = app
    answering = threading.Event()
    with futures.ThreadPoolExecutor(1) as runner:
        load = runner.submit(bounded_load, base, "a", workers=4, until=lambda: False, max_requests=12, timeout_s=120,
                             stream=True, answering=answering, max_tokens=48, client_timeout_s=180)
        assert answering.wait(60), "no request got an answer"
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment_name('a')}#" in a["name"]]
        assert len(actors) == 1, actors
        killed = time.monotonic()
        ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
        results = load.result(timeout=400)
    assert len(results) >= 4 and all(status != "timeout" for status, _ in results), "a request hung"
    target = targets["a"]
    failovers = 0
    for i, (status, raw) in enumerate(results):
        assert status == 200, (status, raw[:300])
        payloads = sse_payloads(raw)
        assert not any("error" in p for p in payloads), payloads[-1]
        expected = plain_text(target, target.tokenizer.encode(f"Request {i}: once upon a time"), 48)
        assert "".join(p["choices"][0]["text"] for p in payloads) == expected, i
        failovers += payloads[-1]["eagle"]["failovers"]
    assert failovers >= 1  # the kill was felt, and recovered from, by the requests on that replica
    wait_for(lambda: running("a") == 1, "a replacement replica")
    logger.info("single replica killed: %d requests, 0 lost, %d failovers, replacement serving within %.1f s of the kill",
                len(results), failovers, time.monotonic() - killed)
    expected = plain_text(target, target.tokenizer.encode("after the kill"), 16)
    response = post(base, "/v1/completions", {"model": "a", "prompt": "after the kill", "max_tokens": 16, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected


def test_sigkilling_a_replica_under_load_loses_no_request(app):
    """Pair "failover" (two replicas): eight concurrent clients (four streamed, four not, T=0); once a streamed
    request has received text, SIGKILL the process of the replica that serves it. No request is lost (all 200, no
    error event) or hung, every text equals plain decoding, at least one request failed over, and Serve
    replaces the replica. Logs the figures: requests, lost, failovers, the resumed requests' added latency."""
    base, _, targets, _ = app
    target = targets["a"]
    tokens = 64
    prompts = [f"Client {i // 2} asks: what lies beyond the sea?" for i in range(8)]  # each prompt twice: streamed, then not
    expected = [plain_text(target, target.tokenizer.encode(p), tokens) for p in prompts]
    wait_for(lambda: running("failover") == 2, "two failover replicas")
    pids = replica_pids("failover")
    assert len(pids) == 2, pids
    streaming = threading.Event()
    victims: list[str] = []

    def one(i: int) -> dict:
        stream = i % 2 == 0
        body = {"model": "failover", "prompt": prompts[i], "max_tokens": tokens, "temperature": 0, "stream": stream}
        started = time.monotonic()
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=180) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    if stream and len(lines) == 8 and not victims:  # 4 chunks of text delivered (and blank lines)
                        victims.append(response.headers["x-eagle-replica"])
                        streaming.set()
                raw = "\n".join(lines)
        except httpx.TimeoutException:
            return {"i": i, "stream": stream, "status": "timeout"}
        result = {"i": i, "stream": stream, "status": response.status_code, "latency_s": time.monotonic() - started, "raw": raw}
        if response.status_code == 200 and stream:
            payloads = sse_payloads(raw)
            result["error"] = next((p["error"] for p in payloads if "error" in p), None)
            result["text"] = "".join(p["choices"][0]["text"] for p in payloads if "error" not in p)
            result["eagle"] = payloads[-1].get("eagle", {})
            finishes = [p["choices"][0]["finish_reason"] for p in payloads if p.get("choices") and p["choices"][0].get("finish_reason")]
            result["finish"] = finishes[-1] if finishes else None  # a stream cut short has none
        elif response.status_code == 200:
            body = json.loads(raw)
            result.update(error=None, text=body["choices"][0]["text"], eagle=body["eagle"], finish=body["choices"][0]["finish_reason"])
        return result

    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        jobs = [pool.submit(one, i) for i in range(len(prompts))]
        assert streaming.wait(120), "no streamed request got an answer"
        victim = victims[0]
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        results = [job.result(timeout=400) for job in jobs]

    hung = [r["i"] for r in results if r["status"] == "timeout"]
    lost = [r["i"] for r in results if r["status"] != 200 or r.get("error") or r.get("text") != expected[r["i"]]]
    resumed = [r for r in results if r.get("eagle", {}).get("failovers", 0) >= 1]
    others = [r for r in results if r not in resumed and r["status"] == 200]

    def mean(rs: list[dict]) -> float:
        return sum(r["latency_s"] for r in rs) / len(rs) if rs else float("nan")

    latencies = sorted(r["latency_s"] for r in results if "latency_s" in r)
    p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)] if latencies else float("nan")
    outcomes = {str(status): sum(r["status"] == status for r in results) for status in {r["status"] for r in results}}
    logger.info("failover figures: %d requests (%d streamed), outcomes %s, %d lost, %d hung, %d resumed (%d failovers, %d tokens "
                "resumed), mean latency %.2f s resumed vs %.2f s others (added %.2f s), p99 latency %.2f s; killed replica %s (pid %d)",
                len(results), sum(r["stream"] for r in results), outcomes, len(lost), len(hung), len(resumed),
                sum(r["eagle"]["failovers"] for r in resumed), sum(r["eagle"]["resumed_tokens"] for r in resumed),
                mean(resumed), mean(others), mean(resumed) - mean(others), p99, victim, pids[victim])
    assert not hung, hung
    for r in results:
        assert r["status"] == 200 and r["error"] is None, (r["i"], r["status"], r.get("raw", "")[-300:])
        assert r["finish"] in ("length", "stop"), (r["i"], r.get("raw", "")[-300:])  # not a stream that just ended
        assert r["text"] == expected[r["i"]], r["i"]
        assert r["eagle"]["replica"] in pids, r["eagle"]
    assert not lost
    for i in range(0, 8, 2):  # identical T=0 prompts got identical answers, whichever replica and failover served them
        assert results[i]["text"] == results[i + 1]["text"], i
    assert resumed, "no request failed over: the killed replica had none in flight"
    assert all(r["eagle"]["replica"] != victim for r in resumed)
    assert any(r["stream"] and r["eagle"]["resumed_tokens"] >= 4 for r in resumed)  # the one that named the victim, mid-answer
    wait_for(lambda: running("failover") == 2 and victim not in replica_pids("failover") and len(replica_pids("failover")) == 2,
             "Serve to replace the killed replica")
    logger.info("failover: the killed replica was replaced %.1f s after the kill", time.monotonic() - killed)


@pytest.mark.nightly
def test_loadtest_level_records_every_request(app):
    """serve.loadtest's measuring loop against the live app: every request answered, TTFT <= latency, tau."""
    import asyncio

    from serve.loadtest import run_level, table

    base, _, _, _ = app
    level = asyncio.run(run_level(base, "b", ["Hello there", "What is two plus two?", "Name a fruit."], concurrency=2, max_tokens=8, timeout_s=120))
    assert level["requests"] == level["ok"] == 3 and level["errors"] == 0
    assert all(0 < r["ttft_s"] <= r["latency_s"] and 1 <= r["tokens"] <= 8 for r in level["records"])
    assert level["tokens_per_s"] > 0
    assert "| b | 2 | 3/3 |" in table([level])


@pytest.mark.nightly
def test_moving_the_alias_swaps_the_head_without_dropping_a_streamed_request(app):
    """Promote a new version while a streamed request runs on "swap": that request finishes on the old
    version without an error, the replica reports the new version within the deadline, and new requests
    are served by it (still equal to plain decoding); the replica never restarts."""
    from eagle_platform.registry import Registry

    base, _, _, swap = app
    target = swap["target"]

    def head_version() -> str | None:
        models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
        return next(m["eagle"].get("head_version") for m in models if m["id"] == "swap")

    assert head_version() == swap["first_version"]
    replicas_before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#pair-swap#" in a["name"]}
    body = {"model": "swap", "prompt": "A long story:", "max_tokens": 120, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        first_data = next(line for line in lines if line.startswith("data: "))
        second = register_head(tiny_head_dir(swap["target_dir"], swap["root"] / "head-a-v2", seed=8), target, alias="candidate")
        Registry().promote(target.name, second, "production")
        rest = [line for line in lines if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in [first_data] + rest[:-1]]
    assert rest[-1] == "data: [DONE]" and not any("error" in e for e in events)
    assert events[-1]["eagle"]["head_version"] == swap["first_version"]
    assert "".join(e["choices"][0]["text"] for e in events) == plain_text(target, target.tokenizer.encode("A long story:"), 120)

    wait_for(lambda: head_version() == second, "the replica to load the promoted version", timeout=90)
    after = post(base, "/v1/completions", {"model": "swap", "prompt": "A long story:", "max_tokens": 120, "temperature": 0}).json()
    assert after["eagle"]["head_version"] == second
    assert after["choices"][0]["text"] == "".join(e["choices"][0]["text"] for e in events)
    replicas_after = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#pair-swap#" in a["name"]}
    assert replicas_after == replicas_before
