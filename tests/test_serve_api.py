"""The OpenAI API and the pair server in-process (FastAPI's test client, no Ray): outputs, streaming, stop
sequences, routing, errors, hot swap. tests/test_serve.py runs the same app under real Ray Serve over HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from eagle.target import load_target
from serve.openai_api import LocalPairClient, OpenAIIngress, make_api
from serve.pair import PairServer, PairSpec, Request, RequestError, StopStrings
from serve_helpers import plain_text, register_head, tiny_chat_target_dir, tiny_head_dir


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Two tiny pairs with different targets ("a" with a head, "b" with a head) and "a-plain" (no head)."""
    root = tmp_path_factory.mktemp("pairs")
    servers = {}
    for name, seed in (("a", 0), ("b", 1)):
        target_dir = tiny_chat_target_dir(root / f"tiny-{name}", seed=seed)
        head_dir = tiny_head_dir(target_dir, root / f"head-{name}", seed=seed)
        target = load_target(str(target_dir), dtype="float32")
        servers[name] = PairServer(PairSpec(model=name, target=str(target_dir), head=str(head_dir), dtype="float32", max_tokens=64, compile="off"), target=target)
    servers["a-plain"] = PairServer(PairSpec(model="a-plain", target="unused", dtype="float32", max_tokens=64, compile="off"), target=servers["a"].target)
    yield servers
    for server in servers.values():
        server.shutdown()


@pytest.fixture(scope="module")
def client(pairs):
    ingress = OpenAIIngress({name: LocalPairClient(server) for name, server in pairs.items()})
    with TestClient(make_api(ingress)) as test_client:
        yield test_client


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_at_t0_equals_plain_decoding_for_each_pair(client, pairs):
    for model in ("a", "b", "a-plain"):
        target = pairs[model].target
        response = client.post("/v1/completions", json={"model": model, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        expected = plain_text(target, target.tokenizer.encode("The capital of France is"), 24)
        assert body["choices"][0]["text"] == expected
        assert body["object"] == "text_completion" and body["model"] == model
        assert body["usage"]["completion_tokens"] <= 24
        assert body["eagle"]["speculative"] is (model != "a-plain")
    # the two targets differ, so routing to the wrong pair would have failed one of the equalities above
    a = client.post("/v1/completions", json={"model": "a", "prompt": "Hello", "max_tokens": 16, "temperature": 0}).json()
    b = client.post("/v1/completions", json={"model": "b", "prompt": "Hello", "max_tokens": 16, "temperature": 0}).json()
    assert a["choices"][0]["text"] != b["choices"][0]["text"]


def test_chat_uses_the_chat_template_and_streaming_concatenates_to_the_same_text(client, pairs):
    target = pairs["a"].target
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = plain_text(target, target.tokenizer.encode(rendered, add_special_tokens=False), 32)
    body = client.post("/v1/chat/completions", json={"model": "a", "messages": messages, "max_tokens": 32, "temperature": 0}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert body["object"] == "chat.completion"

    with client.stream("POST", "/v1/chat/completions", json={
        "model": "a", "messages": messages, "max_tokens": 32, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["eagle"]["tau"] >= 1.0
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_completion_streaming_equals_non_streaming_at_t0(client):
    request = {"model": "b", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    whole = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole


def test_seeded_sampling_repeats_and_stop_sequences_cut_the_text(client):
    request = {"model": "a", "prompt": "Tell me", "max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    first = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    assert client.post("/v1/completions", json=request).json()["choices"][0]["text"] == first
    greedy = client.post("/v1/completions", json={"model": "a", "prompt": "Tell me", "max_tokens": 24, "temperature": 0}).json()
    text = greedy["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = client.post("/v1/completions", json={"model": "a", "prompt": "Tell me", "max_tokens": 24, "temperature": 0, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_stop_strings_hold_back_possible_prefixes():
    stops = StopStrings(("END",))
    assert stops.push("abc E") == ("abc ", False)  # "E" may start "END"
    assert stops.push("N") == ("", False)
    assert stops.push("Dxyz") == ("", True)
    stops = StopStrings(("END",))
    assert stops.push("abc E") == ("abc ", False)
    assert stops.push("Xy") == ("EXy", False)
    assert stops.flush() == ""


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": "ten"}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": 42}, 400, None),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 0}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": -3}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 65}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "word " * 600, "max_tokens": 8}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "a", "prompt": "x", "temperature": -0.1}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "top_p": 0}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "top_p": 1.5}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "n": 2}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": ""}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": [999999]}, 400, None),
    ("/v1/completions", {"prompt": "x"}, 400, None),
    ("/v1/chat/completions", {"model": "a", "messages": []}, 400, None),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": "a", "messages": "hi"}, 400, None),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 1000}, 400, None),
]


@pytest.mark.parametrize("path,body,status,code", BAD_REQUESTS)
def test_bad_input_gets_a_4xx_openai_error_and_the_server_keeps_serving(client, path, body, status, code):
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code:
        assert error["code"] == code
    ok = client.post("/v1/completions", json={"model": "a", "prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_models_health_and_unknown_routes(client):
    models = client.get("/v1/models").json()
    assert {m["id"] for m in models["data"]} == {"a", "b", "a-plain"}
    assert all(m["object"] == "model" and m["eagle"]["context_window"] == 512 for m in models["data"])
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["models"] == {"a": "ok", "b": "ok", "a-plain": "ok"}
    missing = client.get("/v2/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_concurrent_requests_on_one_pair_do_not_share_state(pairs):
    """Eight interleaved requests on one PairServer (one decode thread, steps interleave) each equal their
    own sequential answer: every request owns its caches."""
    server = pairs["a"]
    prompts = [f"Item {i}: the" for i in range(8)]

    async def run_all():
        requests = [Request(prompt=p, max_tokens=20, temperature=0) for p in prompts]
        return await asyncio.gather(*(server.generate(r) for r in requests))

    results = asyncio.run(run_all())
    for prompt, result in zip(prompts, results):
        assert result["text"] == plain_text(server.target, server.target.tokenizer.encode(prompt), 20)


def test_request_errors_keep_their_fields_through_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(RequestError("too long", param="prompt", code="context_length_exceeded")))
    assert (err.message, err.param, err.code) == ("too long", "prompt", "context_length_exceeded")


def test_hot_swap_follows_the_alias_without_dropping_a_request_in_flight(mlflow_server, monkeypatch, tmp_path):
    """A pair on models:/<target>-eagle@production: moving the alias to a new version swaps the head for new
    requests, while a request that started on the old head finishes on it."""
    from eagle_platform import registry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))
    target_dir = tiny_chat_target_dir(tmp_path / "tiny-swap", seed=3)
    target = load_target(str(target_dir), dtype="float32")
    first = register_head(tiny_head_dir(target_dir, tmp_path / "h1", seed=1), target)
    server = PairServer(PairSpec(model="swap", target=str(target_dir), head=f"models:/{target.name}-eagle@production", dtype="float32", watch_s=None), target=target)
    try:
        assert server.info()["head_version"] == first
        assert server.refresh() is False  # nothing moved

        async def scenario():
            events = server.stream(Request(prompt="Story:", max_tokens=30, temperature=0))
            start = await events.__anext__()
            second = register_head(tiny_head_dir(target_dir, tmp_path / "h2", seed=2), target, alias="candidate")
            registry.promote(target.name, second, "production")
            assert await asyncio.get_running_loop().run_in_executor(None, server.refresh) is True
            rest = [event async for event in events]
            after = await server.generate(Request(prompt="Story:", max_tokens=30, temperature=0))
            return start, rest, second, after

        start, rest, second, after = asyncio.run(scenario())
        assert start["head_version"] == first and rest[-1]["eagle"]["head_version"] == first
        text = "".join(e["text"] for e in rest if e["type"] == "delta")
        assert text == plain_text(target, target.tokenizer.encode("Story:"), 30)  # the old head, still lossless
        assert after["eagle"]["head_version"] == second and server.info()["head_version"] == second
        assert after["text"] == text
    finally:
        server.shutdown()


def test_loadtest_percentiles():
    from serve.loadtest import percentile

    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)
    assert percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) is None
