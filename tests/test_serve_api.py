"""The OpenAI API and the pair server in-process (FastAPI's test client, no Ray): outputs, streaming, stop
sequences, routing, errors, hot swap. tests/test_serve.py runs the same app under real Ray Serve over HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from eagle.target import load_target
from serve.openai_api import LocalPairClient, OpenAIIngress, make_api
from serve.pair import PairServer, PairSpec, Request, RequestError, StopStrings
from serve_helpers import memorised_head_dir, plain_text, register_head, tiny_chat_target_dir, tiny_head_dir


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
        eagle = body["eagle"]
        assert eagle["queue_s"] >= 0 and eagle["prefill_s"] > 0  # (total_s starts after the submit: no order between them)
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
    assert len(finals) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    # tau is the tokens per decode step that the accepted counts give (each step: its accepted drafts + 1);
    # every step delivers at least one token and at most its accepted + 1 (the last may be cut short)
    eagle, completion = finals[0]["eagle"], body["usage"]["completion_tokens"]
    steps, accepted = eagle["target_forwards"] - 1, eagle["accepted_tokens"]  # - the prefill, which gave the first token
    assert steps >= 1 and eagle["tau"] == round((steps + accepted) / steps, 4), eagle
    assert steps <= completion - 1 <= steps + accepted, (completion, eagle)


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
    # issue 13: each of these gave a 5xx, a hang or a silent 200 before
    ("/v1/completions", {"model": "a", "prompt": "x", "seed": 2**64}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "seed": -1}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "temperature": 1e-300}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x" * 900_000, "max_tokens": 2}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "y" * 900_000}]}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "a", "prompt": "x", "stop": [f"s{i}" for i in range(1000)]}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "stop": "z" * 300}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "stop": "z" * (1 << 20)}, 413, "request_too_large"),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "logprobs": 2}, 400, "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400, "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "a", "prompt": "x", "logit_bias": {"5": 100}}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "a", "prompt": "x", "presence_penalty": 0.5}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "a", "prompt": "x", "frequency_penalty": 1}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "a", "prompt": "x", "echo": True}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "a", "prompt": "x", "best_of": 2}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "a", "prompt": "x", "suffix": "tail"}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "a", "prompt": "x", "seed": "1"}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "stream": "yes"}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 8.5}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 10**30}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": True}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": ["one", "two"]}, 400, None),
    ("/v1/completions", {"model": "a", "prompt": ["one", 2]}, 400, None),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400, None),
    ("/v1/chat/completions", {"model": "a", "messages": [{"role": "user"}]}, 400, None),
]

_OK_JSON = b'{"model": "a", "prompt": "x", "max_tokens": 2}'
BAD_RAW = [  # (body, content type, status, code)
    (b'{"model": "a", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", 400, "invalid_json"),
    (b'{"model": "a", "prompt": "x\\ud800"}', "application/json", 400, "invalid_json"),
    (b'{"model": "a", "messages": [{"role": "user", "content": "\\udfff"}]}', "application/json", 400, "invalid_json"),
    (b'{"model": "a", "prompt": "x", "temperature": NaN}', "application/json", 400, "invalid_json"),
    (b'{"model": "a", "prompt": "x", "top_p": Infinity}', "application/json", 400, "invalid_json"),
    (b'{"model": "a", "prompt": "' + b"x" * (10 << 20) + b'"}', "application/json", 413, "request_too_large"),
    (_OK_JSON, "text/plain", 415, "unsupported_media_type"),
    (_OK_JSON, "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    (_OK_JSON, "multipart/form-data; boundary=x", 415, "unsupported_media_type"),
    (_OK_JSON, None, 415, "unsupported_media_type"),
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


@pytest.mark.parametrize("body,content_type,status,code", BAD_RAW, ids=[f"raw{i}" for i in range(len(BAD_RAW))])
def test_bad_bodies_get_a_4xx_openai_error_and_the_server_keeps_serving(client, body, content_type, status, code):
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] == code
    assert client.post("/v1/completions", content=_OK_JSON, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_parameters_set_to_their_defaults_are_accepted(client):
    """Clients that send OpenAI's defaults explicitly (``logprobs: null``, ``presence_penalty: 0``) are served."""
    body = {"model": "a", "prompt": "x", "max_tokens": 2, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0,
            "echo": False, "best_of": 1, "user": "someone", "seed": 2**64 - 1, "temperature": 0.001}
    assert client.post("/v1/completions", json=body).status_code == 200, client.post("/v1/completions", json=body).text


class _Stalling:
    """A pair client whose stream starts and then never sends another event (a wedged replica), and whose
    non-streamed call fails with an exception that carries internal details."""

    name = "stall"

    def __init__(self) -> None:
        self.closed = False

    def stream(self, request):
        async def events():
            try:
                yield {"type": "start", "id": "x", "prompt_tokens": 1}
                await asyncio.Event().wait()
            finally:
                self.closed = True

        return events()

    async def generate(self, request):
        raise RuntimeError("boom at /srv/secret/path line 3")

    async def info(self):
        return {}

    async def health(self):
        return None


def test_a_stalled_stream_ends_with_an_error_event_and_errors_hide_internals():
    stalling = _Stalling()
    ingress = OpenAIIngress({"stall": stalling}, limits={"stream_idle_s": 0.5})
    with TestClient(make_api(ingress)) as test_client:
        started = time.monotonic()
        with test_client.stream("POST", "/v1/completions", json={"model": "stall", "prompt": "x", "stream": True}) as response:
            assert response.status_code == 200
            events = sse_events(response)
        assert time.monotonic() - started < 30
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "stream_timeout"
        assert stalling.closed  # the pair's call was cancelled, not left running
        failed = test_client.post("/v1/completions", json={"model": "stall", "prompt": "x"})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal_error"
        assert "secret" not in failed.text and "boom" not in failed.text


async def _first_failed_check(server: PairServer, *, deadline_s: float) -> tuple[RuntimeError, float]:
    """The error of the first ``check_health`` that fails and when it failed (``time.monotonic``), polled every
    20 ms; the test fails after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            server.check_health()
        except RuntimeError as err:
            return err, time.monotonic()
        if time.monotonic() > deadline:
            pytest.fail(f"check_health still passed {deadline_s} s after the decode step hung")
        await asyncio.sleep(0.02)


def test_check_health_notices_a_stuck_decode_loop(pairs):
    """A decode step that never returns while a request waits makes ``check_health`` fail (Serve then
    replaces the replica), not only a dead thread."""
    import threading

    spec = PairSpec(model="stuck", target="unused", dtype="float32", max_tokens=8, compile="off", stuck_after_s=0.3)
    server = PairServer(spec, target=pairs["a"].target)
    entered, release = threading.Event(), threading.Event()
    engine = server._loaded.engine
    real_step = engine.step

    def hung_step(**kw):  # the fault: a step that hangs until released
        entered.set()
        release.wait(60)
        return real_step(**kw)

    engine.step = hung_step
    try:
        server.check_health()  # idle: healthy however long it has been quiet

        async def run():
            asked = time.monotonic()
            task = asyncio.ensure_future(server.generate(Request(prompt="hi", max_tokens=2, temperature=0)))
            assert await asyncio.to_thread(entered.wait, 10), "the decode loop never started a step"
            stuck, failed_at = await _first_failed_check(server, deadline_s=10)
            # the loop's last progress came after the request was asked: not reported stuck before stuck_after_s
            assert "stuck" in str(stuck) and failed_at - asked > spec.stuck_after_s, (stuck, failed_at - asked)
            release.set()
            return await task

        assert asyncio.run(run())["usage"]["completion_tokens"] == 2
        server.check_health()
    finally:
        release.set()
        server.shutdown()


def test_models_health_and_unknown_routes(client):
    models = client.get("/v1/models").json()
    assert {m["id"] for m in models["data"]} == {"a", "b", "a-plain"}
    assert all(m["object"] == "model" and m["eagle"]["context_window"] == 512 for m in models["data"])
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["models"] == {"a": "ok", "b": "ok", "a-plain": "ok"}
    missing = client.get("/v2/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_concurrent_requests_on_one_pair_are_batched_and_do_not_share_state(pairs, monkeypatch):
    """Eight concurrent requests on one PairServer are decoded in shared batches, and each equals its own
    sequential answer (every request owns its cache row). The replica's first step waits until all eight
    are queued (at most 30 s), so the batch does not depend on how fast the requests arrive: the step
    admits all of them (``max_batch_size`` 8), and every request's steps record the rows they shared."""
    import threading

    server = pairs["a"]
    engine = server._loaded.engine
    prompts = [f"Item {i}: the" for i in range(8)]
    assert server.spec.max_batch_size == len(prompts)
    queued, all_queued = [], threading.Event()
    real_submit, real_step = engine.submit, engine.step

    def submit(*args, **kwargs):
        request = real_submit(*args, **kwargs)
        queued.append(request)
        if len(queued) == len(prompts):
            all_queued.set()
        return request

    def step(**kwargs):
        all_queued.wait(30)  # never forever: a missing request shows as a smaller batch below
        return real_step(**kwargs)

    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine, "step", step)

    async def run_all():
        requests = [Request(prompt=p, max_tokens=20, temperature=0) for p in prompts]
        return await asyncio.gather(*(server.generate(r) for r in requests))

    results = asyncio.run(run_all())
    for prompt, result in zip(prompts, results):
        assert result["text"] == plain_text(server.target, server.target.tokenizer.encode(prompt), 20)
    # every request's first step ran all eight rows together; the batch shrinks only as requests finish
    assert all(request.steps and request.steps[0].batch == len(prompts) for request in queued), \
        [[s.batch for s in request.steps] for request in queued]
    assert all(s.batch <= len(prompts) for request in queued for s in request.steps)
    means = [result["eagle"]["batch_size_mean"] for result in results]
    assert max(means) == len(prompts) and min(means) > 1, means  # the first to finish shared every step
    assert sorted(means) == sorted(round(sum(s.batch for s in r.steps) / len(r.steps), 3) for r in queued)


def test_a_stream_interval_sends_fewer_chunks_with_the_same_text(pairs):
    """``stream_interval_s``: after the first token, one chunk per interval carries every token decoded
    meanwhile; the text is the same, and the stream ends when the request does, not an interval later."""
    base = pairs["a-plain"]
    server = PairServer(base.spec.model_copy(update={"model": "paced", "stream_interval_s": 0.25}), target=base.target)
    prompt = "Item 3: the"
    try:
        started = time.perf_counter()
        events = pair_events(server, {"prompt": prompt, "max_tokens": 48, "temperature": 0})
        elapsed = time.perf_counter() - started
    finally:
        server.shutdown()
    deltas = [e for e in events if e["type"] == "delta" and e["token_ids"]]
    assert delta_text(events) == plain_text(base.target, base.target.tokenizer.encode(prompt), 48)
    assert sum(len(d["token_ids"]) for d in deltas) == events[-1]["usage"]["completion_tokens"] == 48
    assert len(deltas) <= 2 + elapsed / 0.25  # the first chunk, then at most one per interval
    assert len(deltas) < 48


def test_a_chunk_budget_stretches_each_streams_interval_with_the_streams_open(pairs):
    """``stream_chunks_per_s``: with n streams open a stream waits n / budget seconds between chunks (never less
    than ``stream_interval_s``, never more than ``MAX_SHARED_INTERVAL_S``); the text is unchanged."""
    from serve.pair import MAX_SHARED_INTERVAL_S, chunk_interval

    assert chunk_interval(8, 0.1, None) == 0.1
    assert chunk_interval(1, 0.1, 16) == 0.1
    assert chunk_interval(8, 0.1, 16) == 0.5
    assert chunk_interval(4, 0.0, 16) == 0.25
    assert chunk_interval(100, 0.1, 16) == MAX_SHARED_INTERVAL_S
    base = pairs["a-plain"]
    server = PairServer(base.spec.model_copy(update={"model": "budgeted", "stream_chunks_per_s": 8.0}), target=base.target)
    prompts = ["Item 3: the", "Item 4: a"]

    async def run_both():
        async def events(prompt):
            return [event async for event in server.stream({"prompt": prompt, "max_tokens": 48, "temperature": 0})]
        return await asyncio.gather(*(events(p) for p in prompts))

    try:
        started = time.perf_counter()
        results = asyncio.run(run_both())
        elapsed = time.perf_counter() - started
        assert server.info()["open_streams"] == 0
    finally:
        server.shutdown()
    for prompt, events in zip(prompts, results):
        deltas = [e for e in events if e["type"] == "delta" and e["token_ids"]]
        assert delta_text(events) == plain_text(base.target, base.target.tokenizer.encode(prompt), 48)
        assert len(deltas) <= 2 + elapsed / 0.125  # 0.25 s apart while both are open, 0.125 s once one ended
        assert len(deltas) < 48


def test_the_stream_interval_wait_ends_with_the_request():
    from serve.pair import _Outputs, _put_all, _until_end_or

    async def waited(end_after: float | None, interval: float) -> float:
        queue = _Outputs()
        if end_after is not None:
            asyncio.get_running_loop().call_later(end_after, _put_all, queue, [None])
        started = time.perf_counter()
        await _until_end_or(queue, interval)
        return time.perf_counter() - started

    assert asyncio.run(waited(0.05, 30.0)) < 10.0  # the end marker cuts a 30 s interval short
    assert asyncio.run(waited(None, 0.2)) >= 0.19  # without one the whole interval passes


def test_request_errors_keep_their_fields_through_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(RequestError("too long", param="prompt", code="context_length_exceeded")))
    assert (err.message, err.param, err.code) == ("too long", "prompt", "context_length_exceeded")


def test_hot_swap_follows_the_alias_without_dropping_a_request_in_flight(mlflow_server, monkeypatch, tmp_path):
    """A pair on models:/<target>-eagle@production: moving the alias to a new version swaps the head for new
    requests, while a request that started on the old head finishes on it. Eager (compile "off"): the swap,
    not compiling, is the subject (compiling the two heads' graphs took ~3.5 minutes on 2 cores)."""
    from eagle_platform.registry import Registry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    target_dir = tiny_chat_target_dir(tmp_path / "tiny-swap", seed=3)  # from the shared SmolLM2 conversion
    target = load_target(str(target_dir), dtype="float32")
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))  # the heads' cache, after: an empty one would convert SmolLM2 (~80 s)
    first = register_head(tiny_head_dir(target_dir, tmp_path / "h1", seed=1), target)
    server = PairServer(PairSpec(model="swap", target=str(target_dir), head=f"models:/{target.name}-eagle@production", dtype="float32", watch_s=None,
                                 compile="off"), target=target)
    try:
        assert server.info()["head_version"] == first
        assert server.refresh() is False  # nothing moved

        async def scenario():
            events = server.stream(Request(prompt="Story:", max_tokens=30, temperature=0))
            start = await events.__anext__()
            second = register_head(tiny_head_dir(target_dir, tmp_path / "h2", seed=2), target, alias="candidate")
            Registry().promote(target.name, second, "production")
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


def test_a_replacement_replica_starts_from_its_head_cache_while_mlflow_is_down(monkeypatch, tmp_path):
    """A pair on models:/...@production resolved once (cached, recorded); then the tracking server goes down:
    a new replica on the same machine starts on the version recorded last, from the cache, and its alias
    watch keeps serving it; with nothing cached the start fails in one line instead."""
    from mlflow_server import free_port, start_mlflow_server, stop_mlflow_server

    from eagle_platform import registry
    from eagle_platform.registry import RegistryError

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    target_dir = tiny_chat_target_dir(tmp_path / "tiny-down", seed=5)  # from the shared SmolLM2 conversion
    target = load_target(str(target_dir), dtype="float32")
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))  # the heads' cache, after: an empty one would convert SmolLM2 (~80 s)
    uri, process = start_mlflow_server(tmp_path / "mlflow", port=free_port())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec = PairSpec(model="down", target=str(target_dir), head=f"models:/{target.name}-eagle@production", dtype="float32",
                    watch_s=None, compile="off")
    try:
        version = register_head(tiny_head_dir(target_dir, tmp_path / "h", seed=1), target)
        PairServer(spec, target=target).shutdown()  # the first replica resolved and cached it
    finally:
        stop_mlflow_server(process)
    registry._REACHABLE.clear()
    replacement = PairServer(spec, target=target)
    try:
        assert replacement.info()["head_version"] == version
        assert replacement.refresh() is False  # the watch keeps the cached head while the server is away
        result = asyncio.run(replacement.generate(Request(prompt="Story:", max_tokens=12, temperature=0)))
        assert result["text"] == plain_text(target, target.tokenizer.encode("Story:"), 12)
    finally:
        replacement.shutdown()
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(RegistryError, match="no MLflow tracking server"):
        PairServer(spec, target=target)


def test_loadtest_percentiles():
    from serve.loadtest import percentile

    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)
    assert percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) is None


def test_loadtest_pools_rounds_of_a_cell():
    from serve.loadtest import pool_rounds, summarize, table

    def request(tokens, latency, status=200):
        return {"status": status, "tokens": tokens, "tau": 2.0, "error": None, "latency_s": latency, "ttft_s": latency / 10}

    first = summarize("m", 4, [request(100, 2.0), request(100, 4.0)], wall=4.0)  # 50 tok/s
    second = summarize("m", 4, [request(100, 1.0), request(0, 9.0, status=503)], wall=1.0)  # 100 tok/s, one failed
    cell = pool_rounds([first, second])
    assert (cell["requests"], cell["ok"], cell["errors"], cell["tokens"]) == (4, 3, 1, 300)
    assert cell["tokens_per_s"] == 60.0  # 300 tokens over 5 s: the summed walls, not the mean of 50 and 100
    assert cell["tokens_per_s_rounds"] == [50.0, 100.0]
    assert cell["latency_p50_s"] == 2.0  # the successful requests of both rounds
    assert "| m | 4 | 3/4 | 60.0 (50.0 / 100.0) |" in table([cell])


def test_loadtest_ratio_table_pairs_rounds_that_ran_side_by_side():
    from serve.loadtest import ratio_table

    def cell(model, concurrency, pooled, rounds):
        return {"model": model, "concurrency": concurrency, "tokens_per_s": pooled, "tokens_per_s_rounds": rounds}

    run = [cell("a", 1, 90.0, [100.0, 80.0]), cell("b", 1, 60.0, [50.0, 80.0]),
           cell("a", 8, 300.0, [300.0]), cell("b", 8, 0.0, [0.0])]
    text = ratio_table([run], [("a", "b"), ("a", "missing")])
    # round 1 of a against round 1 of b (2.00), round 2 against round 2 (1.00), not a's best over b's worst;
    # geometric mean sqrt(2) = 1.41; log ratios 0.69 and 0, standard error 0.35, t(0.975, 1 df) = 12.71:
    # exp(0.35 -+ 4.40) = 0.02 and 115.6
    assert "| a / b | 1 | 1.50 | 2.00 / 1.00 | 1.41 (0.02-115.61) | 1.00 |" in text
    assert "| a / b | 8 |" not in text  # no ratio over a cell that served nothing
    assert "missing" not in text
    # two runs: their round ratios pooled into one mean, each run's pooled ratio kept
    second = [cell("a", 1, 100.0, [100.0, 100.0]), cell("b", 1, 100.0, [100.0, 100.0])]
    row = next(line for line in ratio_table([run, second], [("a", "b")]).splitlines() if line.startswith("| a / b | 1 |"))
    # log ratios 0.69, 0, 0, 0: mean 0.17 (1.19), standard error 0.17, t(0.975, 3 df) = 3.18: exp(0.17 -+ 0.55)
    assert row == "| a / b | 1 | 1.50 / 1.00 | 2.00 / 1.00 / 1.00 / 1.00 | 1.19 (0.69-2.06) | 1.00 |"


# ---- failover: resume in the pair, retry in the ingress -------------------------------------------------

MEMO_PROMPTS = ["The capital of France is", "Once upon a time there"]


@pytest.fixture(scope="module")
def memo(pairs, tmp_path_factory):
    """Pair "memo" on pair a's target: a head that memorised the greedy continuations of MEMO_PROMPTS, so its
    decode steps accept several tokens there (a cut can fall inside a step)."""
    target = pairs["a"].target
    head_dir = memorised_head_dir(target, tmp_path_factory.mktemp("memo") / "head", MEMO_PROMPTS, 48)
    server = PairServer(PairSpec(model="memo", target=pairs["a"].spec.target, head=str(head_dir), dtype="float32", max_tokens=64, compile="off", speculate="always"), target=target)
    yield server
    server.shutdown()


def pair_events(server: PairServer, request: dict) -> list[dict]:
    async def run():
        return [event async for event in server.stream(request)]

    return asyncio.run(run())


def delta_text(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e["type"] == "delta")


def cut_points(deltas: list[dict], target) -> list[tuple[int, str]]:
    """(tokens delivered, text delivered) where a replica could have died: before any token, at step
    boundaries (what the ingress records), inside multi-token steps (the text of the steps before, or the
    whole text of the cut's tokens), and after the last token."""
    sizes = [len(d["token_ids"]) for d in deltas]
    ids = [t for d in deltas for t in d["token_ids"]]
    boundaries = [(sum(sizes[:i]), "".join(d["text"] for d in deltas[:i])) for i in range(len(deltas) + 1)]
    inside = [(k + 1, text) for (k, text), size in zip(boundaries, sizes) if size >= 2]
    cuts = [boundaries[0], boundaries[1], boundaries[len(boundaries) // 2], boundaries[-1], inside[0], inside[-1]]
    cuts.append((inside[len(inside) // 2][0], target.decode(ids[: inside[len(inside) // 2][0]]).rstrip("\ufffd")))
    return cuts


def test_a_resumed_request_continues_exactly_after_the_delivered_text(memo):
    """At T=0, resuming after any cut gives delivered text + the resumed pair's text = the uninterrupted text,
    and the end event counts the whole completion; also with a stop sequence after (or across) the cut."""
    base = {"prompt": MEMO_PROMPTS[0], "max_tokens": 48, "temperature": 0}
    plain = delta_text(pair_events(memo, base))
    assert plain == plain_text(memo.target, memo.target.tokenizer.encode(base["prompt"]), 48)
    stop = plain[2 * len(plain) // 3 :][:3]
    for request in (base, {**base, "stop": [stop]}):
        events = pair_events(memo, request)
        deltas = [e for e in events if e["type"] == "delta"]
        full, end = delta_text(events), events[-1]
        ids = [t for d in deltas for t in d["token_ids"]]
        assert max(len(d["token_ids"]) for d in deltas) >= 2  # multi-token steps, so some cuts fall inside one
        for k, delivered in cut_points(deltas, memo.target):
            resumed = pair_events(memo, {**request, "resume_token_ids": ids[:k], "resume_text": delivered})
            where = (request.get("stop"), k, delivered)
            assert resumed[0]["type"] == "start" and resumed[0]["prompt_tokens"] == events[0]["prompt_tokens"]
            assert all("token_ids" in e for e in resumed if e["type"] == "delta")
            assert delivered + delta_text(resumed) == full, where
            last = resumed[-1]
            assert last["finish_reason"] == end["finish_reason"] and last["eagle"]["resumed_tokens"] == k, where
            if "stop" not in request:  # with a stop sequence the last step's extra tokens depend on where steps fall
                assert last["usage"] == end["usage"] and end["usage"]["completion_tokens"] == len(ids) == 48, where
                assert ids[:k] + [t for e in resumed if e["type"] == "delta" for t in e["token_ids"]] == ids, where
    assert end["finish_reason"] == "stop" and full == plain[: plain.index(stop)]


def test_resumed_text_is_exact_across_a_character_split_between_tokens(memo):
    """Delivered tokens that end inside a multi-byte character (its first bytes' token): the resumed text
    continues the whole completion's text, as if decoding had never stopped (a detokeniser started afresh on
    the new tokens would drop the split character)."""
    target = memo.target
    text = "Café 😀 and 成都"
    ids = target.tokenizer.encode(text)
    splits = [k for k in range(1, len(ids)) if target.decode(ids[:k]).endswith("\ufffd")]
    assert splits, [target.decode([i]) for i in ids]
    for k in splits[:2]:
        delivered = target.decode(ids[:k]).rstrip("\ufffd")
        resumed = pair_events(memo, {"prompt": "Say:", "max_tokens": 12, "temperature": 0, "resume_token_ids": ids[:k], "resume_text": delivered})
        new_ids = [t for e in resumed if e["type"] == "delta" for t in e["token_ids"]]
        assert delivered + delta_text(resumed) == target.decode(ids[:k] + new_ids), k
        assert resumed[-1]["usage"]["completion_tokens"] == k + len(new_ids) <= 12


@pytest.mark.parametrize("resume", [
    {"resume_token_ids": [-1]},
    {"resume_token_ids": [10**6]},
    {"resume_token_ids": ["7"]},
    {"resume_token_ids": [True]},
    {"resume_text": "text without tokens"},
    {"resume_token_ids": [42], "resume_text": "certainly not the text of token 42"},
    {"resume_token_ids": [42] * 9},  # more than max_tokens
])
def test_bad_resume_fields_are_request_errors(memo, resume):
    from serve.openai_api import as_api_error

    with pytest.raises(RequestError) as err:
        pair_events(memo, {"prompt": "x", "max_tokens": 8, "temperature": 0, **resume})
    assert err.value.param in ("resume_token_ids", "resume_text")
    assert as_api_error(err.value, retry_after_s=1).status == 400


class DyingPairClient(LocalPairClient):
    """The real pair in-process behind the ingress's own failover (``ResumingPairClient``), whose first
    ``deaths`` attempts die after ``after`` events with Ray's ActorDiedError, as when a replica's process is
    killed mid-request; ``hang`` makes each attempt after the deaths wait forever instead (no replica)."""

    def __init__(self, server: PairServer, *, after: int, deaths: int, hang: bool = False, **kwargs) -> None:
        super().__init__(server, **kwargs)
        self.after, self.deaths, self.hang = after, deaths, hang
        self.attempts: list[dict] = []

    def open_stream(self, request):
        self.attempts.append(request)
        events = self.server.stream(request)
        if len(self.attempts) > self.deaths:
            return self._hung() if self.hang else events
        return self._dies(events)

    async def _dies(self, events):
        from ray.exceptions import ActorDiedError

        sent = 0
        async for event in events:
            if sent == self.after:
                await events.aclose()
                raise ActorDiedError()
            sent += 1
            yield event
        raise ActorDiedError()

    async def _hung(self):
        await asyncio.sleep(3600)
        yield {}


def failover_client(server: PairServer, **kwargs) -> tuple[TestClient, DyingPairClient]:
    from serve.openai_api import FailoverPolicy

    policy = kwargs.pop("failover", FailoverPolicy(attempts=3, deadline_s=30, backoff_s=0.01))
    dying = DyingPairClient(server, failover=policy, **kwargs)
    return TestClient(make_api(OpenAIIngress({"memo": dying}))), dying


@pytest.mark.parametrize("after", [0, 1, 3, 7])
def test_the_ingress_resumes_a_request_whose_replica_died(memo, after, caplog):
    """Two deaths, after ``after`` events of each attempt: the streamed and the non-streamed answer are the
    uninterrupted text, with no error event; each failover is logged with the tokens resumed and counted."""
    import logging

    prompt = MEMO_PROMPTS[1]
    expected = plain_text(memo.target, memo.target.tokenizer.encode(prompt), 40)
    body = {"model": "memo", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    caplog.set_level(logging.WARNING, logger="serve.openai_api")
    http, dying = failover_client(memo, after=after, deaths=2)
    with http, http.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected
    final = next(e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"])
    assert final["eagle"]["failovers"] == 2 and events[-2]["usage"]["completion_tokens"] == 40
    resumed = [len(a.get("resume_token_ids", [])) for a in dying.attempts]
    assert len(resumed) == 3 and resumed[0] == 0 and resumed == sorted(resumed)
    assert final["eagle"]["resumed_tokens"] == resumed[-1]
    assert all(a.get("resume_text", "") == expected[: len(a.get("resume_text", ""))] for a in dying.attempts)
    logged = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    assert len(logged) == 2 and f"after {resumed[1]} tokens" in logged[0]

    http, dying = failover_client(memo, after=after, deaths=1)
    with http:
        whole = http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == expected and whole.json()["eagle"]["failovers"] == 1
    assert whole.json()["usage"]["completion_tokens"] == 40 and len(dying.attempts) == 2


def test_failover_is_bounded_and_never_retries_a_bad_request(memo):
    from serve.openai_api import FailoverPolicy

    body = {"model": "memo", "prompt": MEMO_PROMPTS[0], "max_tokens": 24, "temperature": 0}
    # attempts run out: the death reaches the client as it did without failover
    http, dying = failover_client(memo, after=2, deaths=10, failover=FailoverPolicy(attempts=2, deadline_s=30, backoff_s=0.01))
    with http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "unavailable" and len(dying.attempts) == 3
    http, dying = failover_client(memo, after=0, deaths=10, failover=FailoverPolicy(attempts=2, deadline_s=30, backoff_s=0.01))
    with http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable" and len(dying.attempts) == 3
    # the deadline: a resumed attempt that waits for a replica gives up when it passes
    http, dying = failover_client(memo, after=3, deaths=1, hang=True, failover=FailoverPolicy(attempts=5, deadline_s=1.0, backoff_s=0.01))
    started = time.monotonic()
    with http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = sse_events(response)
    assert 1.0 <= time.monotonic() - started < 10 and events[-2]["error"]["code"] == "unavailable" and len(dying.attempts) == 2
    # a bad request is answered 400 at once, never retried
    http, dying = failover_client(memo, after=0, deaths=10)
    with http:
        for request in ({**body, "max_tokens": 65}, {**body, "max_tokens": 65, "stream": True}):
            response = http.post("/v1/completions", json=request)
            assert response.status_code == 400, response.text
    assert len(dying.attempts) == 2


def test_batch_graphs_are_validated_with_the_pair():
    """``batch_graphs`` follows the engine's rule (``eagle.batch.check_graphs``) when the pair's schema is
    validated: sizes in 2..max_batch_size, compile on only."""
    from pydantic import ValidationError

    assert PairSpec(model="m", target="t", max_batch_size=16, batch_graphs=(4, 16)).batch_graphs == (4, 16)
    for bad, expected in (({"batch_graphs": (1,)}, "2..8"), ({"batch_graphs": (16,)}, "2..8"),
                          ({"batch_graphs": (4,), "compile": "off"}, "compile 'on'")):
        with pytest.raises(ValidationError, match=r"batch_graphs: .*" + expected.replace(".", r"\.")):
            PairSpec(model="m", target="t", **bad)


@pytest.mark.parametrize("native_bf16, expected", [("0", "float32"), ("1", "bfloat16")])
def test_a_pair_in_auto_dtype_runs_what_the_machine_computes_natively(native_bf16, expected, monkeypatch, tmp_path):
    """``dtype: auto`` (the default) loads the target in bf16 where the CPU computes it natively and in fp32 where
    bf16 is emulated (``EAGLE_NATIVE_BF16`` stands in for the CPU flags here); ``info`` reports the dtype that runs."""
    monkeypatch.setenv("EAGLE_NATIVE_BF16", native_bf16)
    target_dir = tiny_chat_target_dir(tmp_path / "tiny", seed=0)
    spec = PairSpec(model="auto", target=str(target_dir), max_tokens=8, compile="off", max_batch_size=2)
    assert spec.dtype == "auto"
    server = PairServer(spec)
    try:
        assert server.info()["dtype"] == expected
        assert all(str(p.dtype) == f"torch.{expected}" for p in server.target.model.parameters())
    finally:
        server.shutdown()


def test_a_pair_takes_a_device_and_a_cuda_pair_reserves_gpus():
    """``device`` is part of the pair's schema (spelling checked when the config is validated; whether the
    replica sees the GPU, when it loads); a CUDA pair's replicas reserve GPUs, since a Ray actor sees only
    the GPUs it reserved."""
    from pydantic import ValidationError

    from serve.app import PairArgs, _pair_deployment

    assert PairSpec(model="m", target="t").device == "cpu"
    assert PairSpec(model="m", target="t", device="cuda:1").device == "cuda:1"
    for bad in ("gpu", "cuda:", "CUDA"):
        with pytest.raises(ValidationError, match="device must be"):
            PairSpec(model="m", target="t", device=bad)
    cpu, cuda = PairArgs(model="m", target="t"), PairArgs(model="m", target="t", device="cuda")
    assert (cpu.actor_gpus(), cuda.actor_gpus(), PairArgs(model="m", target="t", device="cuda", num_gpus=0.5).actor_gpus()) == (0.0, 1.0, 0.5)
    assert cuda.spec()["device"] == "cuda" and "num_gpus" not in cuda.spec()
    assert _pair_deployment(cuda, None, 1.0, 503).ray_actor_options["num_gpus"] == 1.0
    assert _pair_deployment(cpu, None, 1.0, 503).ray_actor_options["num_gpus"] == 0.0
    with pytest.raises(ValidationError, match="needs num_gpus > 0"):
        PairArgs(model="m", target="t", device="cuda", num_gpus=0)


def test_a_replica_without_the_pairs_gpu_fails_at_load_with_one_line():
    import torch

    from eagle.errors import EagleError

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(EagleError, match=f"device 'cuda:{visible}': this process sees {visible} CUDA GPU"):
        PairServer(PairSpec(model="m", target="smollm2-135m", device=f"cuda:{visible}"))


def test_a_replica_answers_on_the_eager_path_while_its_graphs_compile_then_switches(monkeypatch, tmp_path):
    """compile "on": the pair answers at once on an eager stand-in (the target alone) while its compiled pair
    is built in the background; a request in flight across the switch finishes exactly; requests after it
    run on the compiled pair; info() (the /v1/models entry) says which path serves. The build waits until
    the test releases it, so the switch falls inside the streamed request (the compiling itself is real)."""
    import threading

    target_dir = tiny_chat_target_dir(tmp_path / "tiny-switch", seed=4)  # from the shared SmolLM2 conversion
    target = load_target(str(target_dir), dtype="float32")
    head_dir = tiny_head_dir(target_dir, tmp_path / "head", seed=1)
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))  # compiled artifacts of this test's own
    release = threading.Event()
    ready = PairServer._ready

    def held(self, head):
        assert release.wait(300)
        return ready(self, head)

    monkeypatch.setattr(PairServer, "_ready", held)
    server = PairServer(PairSpec(model="switch", target=str(target_dir), head=str(head_dir), dtype="float32", watch_s=None,
                                 compile="on", max_tokens=64, threads=1), target=target)
    try:
        assert server.info()["path"] == "eager" and server.info()["speculative"] is False
        expected = plain_text(target, target.tokenizer.encode("Story:"), 40)

        async def scenario():
            before = await server.generate(Request(prompt="Story:", max_tokens=40, temperature=0))
            events = server.stream(Request(prompt="Story:", max_tokens=40, temperature=0))
            start = await events.__anext__()
            first = await events.__anext__()
            release.set()
            assert await asyncio.get_running_loop().run_in_executor(None, server.wait_until_compiled, 900)
            rest = [event async for event in events]
            after = await server.generate(Request(prompt="Story:", max_tokens=40, temperature=0))
            return before, start, [first, *rest], after

        before, start, streamed, after = asyncio.run(scenario())
        assert before["text"] == expected and before["eagle"]["path"] == "eager"
        assert start["path"] == "eager" and delta_text(streamed) == expected and streamed[-1]["eagle"]["path"] == "eager"
        info = server.info()
        assert info["path"] == "compiled" and info["compile_error"] is None and info["speculative"] is True
        assert after["text"] == expected and after["eagle"]["path"] == "compiled"
        assert after["eagle"]["tau"] is not None and after["eagle"]["tau"] >= 1.0
    finally:
        release.set()
        server.shutdown()
