"""The OpenAI-compatible HTTP API: request schemas, error bodies, SSE, and the ingress that routes by ``model``.

``OpenAIIngress`` is a plain class holding one ``PairClient`` per served model id; ``make_api`` builds its
FastAPI app. ``serve.app`` makes the ingress a Serve deployment whose clients call the pair deployments
through ``DeploymentHandle``s; tests can plug in ``LocalPairClient`` (a ``PairServer`` in-process).

Failover: both clients read a pair through ``resumable_stream``, which records what each request has
delivered and, when its replica dies mid-request, re-issues it with ``resume_token_ids``/``resume_text`` so
Serve routes it to a live replica that continues it (``serve.pair.PairServer._resume``); streamed and
non-streamed requests alike (``collect`` assembles the latter), bounded by a ``FailoverPolicy``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
sends ``text/event-stream`` chunks ending in ``data: [DONE]``), ``GET /health``. Every error is an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (malformed JSON,
wrong types, out-of-range values, unsupported parameters, a prompt over the context window), 413 past
``Limits.max_body_bytes``, 415 for a body that is not JSON, 404 for an unknown model, 503/429 with
``Retry-After`` when a pair's queue is full or its replicas are unavailable, 500 (an incident id, never
exception text) otherwise. docs/security.md lists the limits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Callable, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle.errors import EagleError
from eagle.generate import GenerationConfig
from eagle.verify import SamplingConfig
from serve.pair import PairServer, RequestError

logger = logging.getLogger(__name__)

Number = Annotated[float, Field(strict=True)]  # JSON numbers only: "0.5" (a string) is rejected

MAX_STOP = 4  # stop sequences per request (OpenAI's own limit)
MAX_STOP_CHARS = 256  # characters per stop sequence (each is searched for in every streamed delta)


@dataclass(frozen=True)
class Limits:
    """What the ingress accepts before any replica sees a request (docs/security.md lists them).

    Attributes:
        max_body_bytes: request body size; larger bodies get 413 without being read to the end.
        stream_idle_s: a stream that sends no event for this long is closed with an error event (longer than
            ``FailoverPolicy.deadline_s``, during which a resumed request waits for a replacement replica).
    """

    max_body_bytes: int = 1 << 20
    stream_idle_s: float = 180.0


# OpenAI parameters this server does not implement, with the values that mean "not asked for": a request that
# sets one to anything else gets 400 unsupported_parameter instead of a 200 that silently ignores it
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
}


# ----------------------------------------------------------------------------------------------------
# Request schemas (pydantic at the HTTP boundary only)
# ----------------------------------------------------------------------------------------------------


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields this server ignores (user, ...)

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt = Field(1, ge=1, le=1)  # one choice per request

    def check(self) -> None:
        """The rules pydantic's field types do not express (raises ``RequestError``, a 400). The sampling
        settings are checked by the engine's own configs (``eagle.verify.SamplingConfig``: temperature 0 or
        at least its floor; ``eagle.generate.GenerationConfig``: seed in [0, 2**64)) before routing."""
        try:
            SamplingConfig(temperature=float(self.temperature), top_p=float(self.top_p))
        except EagleError as err:
            raise RequestError(str(err), param="temperature" if "temperature" in str(err) else "top_p") from None
        try:
            GenerationConfig(seed=self.seed)
        except EagleError as err:
            raise RequestError(str(err), param="seed") from None
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise RequestError(f"unsupported parameter: {name!r} is not implemented by this server",
                                   param=name, code="unsupported_parameter")
        stops = self.stops()
        if len(stops) > MAX_STOP:
            raise RequestError(f"stop: at most {MAX_STOP} sequences, got {len(stops)}", param="stop")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise RequestError(f"stop: each sequence is at most {MAX_STOP_CHARS} characters", param="stop")

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]

    def to_request(self) -> dict[str, Any]:
        prompt: dict[str, Any]
        if isinstance(self.prompt, str):
            prompt = {"prompt": self.prompt}
        elif self.prompt and all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise RequestError("prompt: one prompt per request (a list of one string, or token ids)", param="prompt")
            prompt = {"prompt": self.prompt[0]}
        else:
            prompt = {"prompt_ids": list(self.prompt)}
        return {**prompt, **_sampling_fields(self)}


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...

    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def to_request(self) -> dict[str, Any]:
        fields = _sampling_fields(self)
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        messages = [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]
        return {"messages": messages, **fields}


def _sampling_fields(body: _Sampling) -> dict[str, Any]:
    return {
        "max_tokens": body.max_tokens,
        "temperature": float(body.temperature),
        "top_p": float(body.top_p),
        "stop": list(body.stops()),
        "seed": body.seed,
    }


# ----------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))} if self.retry_after_s is not None else {}


def _validation_error(err: ValidationError) -> APIError:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid request"),
                    param=str(first["loc"][0]) if first.get("loc") else None)


def as_api_error(err: BaseException, *, retry_after_s: float) -> APIError:
    """Map what a pair call raised to an HTTP error (Ray wraps remote errors: look at the cause too)."""
    cause = getattr(err, "cause", None) or err
    if isinstance(cause, APIError):
        return cause
    if isinstance(cause, StreamIdleError):
        return APIError(504, f"{cause}; the stream is closed", type="server_error", code="stream_timeout")
    if isinstance(cause, RequestError) or isinstance(err, RequestError):
        source = cause if isinstance(cause, RequestError) else err
        return APIError(400, source.message, param=source.param, code=source.code)
    name = type(cause).__name__
    try:
        from ray.serve.exceptions import BackPressureError

        if isinstance(cause, BackPressureError):
            return APIError(cause.status_code, "the model is at capacity; retry later", type="server_busy",
                            code="rate_limit_exceeded" if cause.status_code == 429 else "overloaded",
                            retry_after_s=cause.retry_after_s or retry_after_s)
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    if name in {"RayActorError", "ActorDiedError", "ActorUnavailableError", "ReplicaUnavailableError", "DeploymentUnavailableError",
                "RequestCancelledError"}:
        return APIError(503, f"the model's replica is unavailable ({name}); retry", type="server_error",
                        code="unavailable", retry_after_s=retry_after_s)
    incident = uuid.uuid4().hex[:12]
    logger.error("unexpected error serving a request (incident %s)", incident, exc_info=err)
    return APIError(500, f"internal error (incident {incident} in the server log)", type="server_error", code="internal_error")


# ----------------------------------------------------------------------------------------------------
# Failover: a request whose replica dies continues on another one
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailoverPolicy:
    """How often and for how long ``resumable_stream`` resumes a request whose replica died.

    Attributes:
        attempts: resumes per request; past them the death reaches the client as without failover (503, or an
            in-stream error event once a stream has started).
        deadline_s: seconds from the request's first replica death within which a resumed attempt must have
            started (its replica sent ``start``); a single-replica pair's request waits for Serve's replacement
            up to this long.
        backoff_s: pause before the first resume, doubled before each next one, so Serve's router has marked
            the dead replica before the request is routed again.
    """

    attempts: int = 3
    deadline_s: float = 120.0
    backoff_s: float = 0.25


def is_replica_death(err: BaseException) -> bool:
    """Whether ``err`` says the replica serving a request is gone: Ray's actor errors (``RayActorError`` and
    its ``ActorDiedError``/``ActorUnavailableError``) or Serve's ``ReplicaUnavailableError``, maybe wrapped in
    a ``RayTaskError``. Bad requests, back-pressure, cancellation and a deployment that failed are not."""
    try:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return any(isinstance(e, (RayActorError, ReplicaUnavailableError)) for e in (err, getattr(err, "cause", None), err.__cause__))


def _is_backpressure(err: BaseException) -> bool:
    try:
        from ray.serve.exceptions import BackPressureError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(getattr(err, "cause", None) or err, BackPressureError)


async def _close(events: AsyncIterator[dict[str, Any]]) -> None:
    """Stop an attempt that will not be read to its end: cancel a Serve call, close a local generator."""
    try:
        if callable(getattr(events, "cancel", None)):
            events.cancel()  # type: ignore[attr-defined]
        elif callable(getattr(events, "aclose", None)):
            await events.aclose()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort: the replica may be gone already
        logger.debug("closing an abandoned pair stream failed", exc_info=True)


async def resumable_stream(open_stream: Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]], request: dict[str, Any],
                           policy: FailoverPolicy = FailoverPolicy(), *, name: str = "pair") -> AsyncIterator[dict[str, Any]]:
    """A pair's events (``start``, ``delta``..., ``end``) that survive the death of the replica serving them.

    Every delta's ``token_ids`` and ``text`` are recorded as they pass. When the stream raises a replica
    death (``is_replica_death``), the request is opened again with ``resume_token_ids``/``resume_text`` set to
    what was delivered; Serve routes it to a live replica, whose events continue this stream (its ``start``
    is swallowed once one was passed on). Bounded by ``policy``, after which the death error propagates; a
    resumed attempt refused by back-pressure is retried within the same bounds. The ``end`` event's ``eagle``
    gains ``failovers``: how many times the request was resumed.
    """
    token_ids: list[int] = []
    text: list[str] = []
    failovers = 0
    deadline: float | None = None  # set by the first death
    death: BaseException | None = None
    request_id: str | None = None
    attempt = request
    while True:
        events = open_stream(attempt)
        done = started = ended = False
        try:
            while True:
                pending = events.__anext__()
                try:  # a resumed attempt that waits for a replica waits at most until the deadline
                    event = await (asyncio.wait_for(pending, max(0.0, deadline - time.monotonic())) if deadline and not started else pending)
                except StopAsyncIteration:
                    done = True
                    return
                except asyncio.TimeoutError:
                    raise death from None  # the deadline passed while the resumed attempt waited for a replica
                started = True
                if event["type"] == "start":
                    if request_id is not None:
                        continue
                    request_id = event["id"]
                elif event["type"] == "delta":
                    token_ids.extend(event.get("token_ids", ()))
                    text.append(event["text"])
                elif event["type"] == "end":
                    event = {**event, "eagle": {**event["eagle"], "failovers": failovers}}
                    ended = True
                yield event
        except Exception as err:  # noqa: BLE001 - anything but a replica death propagates unchanged
            if ended and is_replica_death(err):  # the answer is complete: a death after it changes nothing
                done = True
                return
            if not (is_replica_death(err) or (failovers and _is_backpressure(err))):
                raise
            death = err
            now = time.monotonic()
            deadline = deadline or now + policy.deadline_s
            if failovers >= policy.attempts or now >= deadline:
                raise
            failovers += 1
            logger.warning("%s: the replica serving request %s died (%s) after %d tokens; resuming them on another "
                           "replica (failover %d of at most %d)", name, request_id or "(not started)", type(err).__name__,
                           len(token_ids), failovers, policy.attempts)
            await asyncio.sleep(min(policy.backoff_s * 2 ** (failovers - 1), max(0.0, deadline - now)))
            attempt = {**request, "resume_token_ids": list(token_ids), "resume_text": "".join(text)}
        finally:
            if not done:
                await _close(events)


async def collect(events: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """A whole answer from a pair's events: ``{"id", "text", "finish_reason", "usage", "eagle"}``."""
    parts: list[str] = []
    result: dict[str, Any] = {}
    async for event in events:
        if event["type"] == "start":
            result["id"] = event["id"]
        elif event["type"] == "delta":
            parts.append(event["text"])
        elif event["type"] == "end":
            result.update(finish_reason=event["finish_reason"], usage=event["usage"], eagle=event["eagle"])
    result["text"] = "".join(parts)
    return result


# ----------------------------------------------------------------------------------------------------
# Pair clients: how the ingress reaches a pair
# ----------------------------------------------------------------------------------------------------


class PairClient(Protocol):
    async def generate(self, request: dict[str, Any]) -> dict[str, Any]: ...
    def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...
    async def info(self) -> dict[str, Any]: ...
    async def health(self) -> None: ...


class ResumingPairClient:
    """``stream`` and ``generate`` over ``open_stream`` (one attempt at a request's events), with failover;
    a non-streamed request runs through the same resumable stream, so it survives a replica death too."""

    name = "pair"
    failover = FailoverPolicy()

    def open_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError

    def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return resumable_stream(self.open_stream, request, self.failover, name=self.name)

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        return await collect(self.stream(request))


class LocalPairClient(ResumingPairClient):
    """A ``PairServer`` in this process (tests, single-process use)."""

    def __init__(self, server: PairServer, failover: FailoverPolicy = FailoverPolicy()) -> None:
        self.server, self.failover, self.name = server, failover, server.spec.model

    def open_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self.server.stream(request)

    async def info(self) -> dict[str, Any]:
        return self.server.info()

    async def health(self) -> None:
        self.server.check_health()


class HandlePairClient(ResumingPairClient):
    """A pair deployment reached through its ``DeploymentHandle`` (Serve routes each attempt to a replica)."""

    def __init__(self, handle, failover: FailoverPolicy = FailoverPolicy()) -> None:
        self.handle, self.failover = handle, failover
        self.name = getattr(handle, "deployment_name", "pair")

    def open_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self.handle.options(stream=True).stream.remote(request)

    async def info(self) -> dict[str, Any]:
        return await self.handle.info.remote()

    async def health(self) -> None:
        """The pair deployment's health as Serve's controller sees it (its own periodic ``check_health`` calls
        on every replica): no call reaches a replica here, so ``/health`` never queues behind generation
        requests on a busy pair."""
        from ray import serve

        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.handle.app_name)
        deployment = app.deployments.get(self.handle.deployment_name) if app else None
        if deployment is None:
            raise RuntimeError(f"the deployment {self.handle.deployment_name!r} of {self.handle.app_name!r} is not running")
        running = sum(count for state, count in deployment.replica_states.items() if state == "RUNNING")
        if not running:  # a deployment replacing a dead replica is healthy while another one runs
            raise RuntimeError(f"the deployment {self.handle.deployment_name!r} has no running replica "
                               f"({deployment.status}: {deployment.message})")


# ----------------------------------------------------------------------------------------------------
# The ingress
# ----------------------------------------------------------------------------------------------------


class OpenAIIngress:
    """Routes OpenAI requests to pairs by ``model``. ``clients`` maps model id -> PairClient (or a Serve
    ``DeploymentHandle``, wrapped here with the ``failover`` policy). Each request looks its model up in
    ``self.clients``, so a subclass may replace that map while serving (``serve.app.RoutedIngress``)."""

    def __init__(self, clients: dict[str, Any], *, retry_after_s: float = 1.0, request_timeout_s: float = 600.0,
                 failover: FailoverPolicy | dict[str, Any] | None = None, limits: Limits | dict[str, Any] | None = None) -> None:
        self.failover = failover if isinstance(failover, FailoverPolicy) else FailoverPolicy(**(failover or {}))
        self.limits = limits if isinstance(limits, Limits) else Limits(**(limits or {}))
        self.clients: dict[str, PairClient] = {
            name: client if hasattr(client, "health") and not _is_handle(client) else HandlePairClient(client, self.failover)
            for name, client in clients.items()
        }
        self.retry_after_s = retry_after_s
        self.request_timeout_s = request_timeout_s
        self.created = int(time.time())

    def __serve_build_asgi_app__(self):  # Serve's hook: `serve.ingress()` with no app builds it per replica
        return make_api(self)

    def client(self, model: str) -> PairClient:
        if model not in self.clients:
            raise APIError(404, f"the model {model!r} does not exist; GET /v1/models lists what this server serves",
                           param="model", code="model_not_found")
        return self.clients[model]

    async def models(self) -> dict[str, Any]:
        async def one(name: str, client: PairClient) -> dict[str, Any]:
            try:
                info = await asyncio.wait_for(client.info(), timeout=10)
            except Exception as err:  # noqa: BLE001 - listing must not fail because one pair is down
                info = {"error": f"unavailable ({type(err).__name__})"}
            return {"id": name, "object": "model", "created": self.created, "owned_by": "eagle-platform", "eagle": info}

        return {"object": "list", "data": list(await asyncio.gather(*(one(n, c) for n, c in self.clients.items())))}

    async def health(self) -> tuple[int, dict[str, Any]]:
        async def one(client: PairClient) -> str:
            try:
                await asyncio.wait_for(client.health(), timeout=10)
                return "ok"
            except Exception as err:  # noqa: BLE001 - reported per pair; the details are in this server's log
                logger.warning("health: a pair is unhealthy: %s", err)
                return f"unhealthy ({type(err).__name__})"

        states = dict(zip(self.clients, await asyncio.gather(*(one(c) for c in self.clients.values()))))
        healthy = all(state == "ok" for state in states.values())
        return (200 if healthy else 503), {"status": "ok" if healthy else "unhealthy", "models": states}


def _is_handle(obj: Any) -> bool:
    return type(obj).__name__ in {"DeploymentHandle"}


def _completion_body(kind: str, model: str, result: dict[str, Any], created: int) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]}, "finish_reason": result["finish_reason"], "logprobs": None}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": result["text"], "finish_reason": result["finish_reason"], "logprobs": None}
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + result["id"], "object": obj, "created": created, "model": model, "choices": [choice],
        "usage": result["usage"], "eagle": result["eagle"],
    }


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _bounded(events: AsyncIterator[dict[str, Any]], idle_s: float) -> AsyncIterator[dict[str, Any]]:
    """``events``, raising ``StreamIdleError`` when none arrives within ``idle_s`` seconds (the pair's call is
    cancelled then)."""
    while True:
        try:
            event = await asyncio.wait_for(events.__anext__(), idle_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            await _close(events)
            raise StreamIdleError(idle_s) from None
        yield event


class StreamIdleError(Exception):
    def __init__(self, idle_s: float) -> None:
        super().__init__(f"the model sent nothing for {idle_s:g} s")
        self.idle_s = idle_s


async def _sse_stream(kind: str, model: str, first: dict[str, Any], events: AsyncIterator[dict[str, Any]],
                      include_usage: bool, retry_after_s: float, idle_s: float) -> AsyncIterator[bytes]:
    created = int(time.time())
    chunk_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + first["id"]
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, *, role: bool = False, extra: dict | None = None) -> dict[str, Any]:
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if delta_text is None else {"content": delta_text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        return {"id": chunk_id, "object": obj, "created": created, "model": model, "choices": [choice], **(extra or {})}

    if kind == "chat":
        yield _sse(chunk(None, None, role=True))
    try:
        async for event in _bounded(events, idle_s):
            if event["type"] == "delta":
                if event["text"]:  # a delta whose text is held back carries only token ids: nothing to send
                    yield _sse(chunk(event["text"], None))
            elif event["type"] == "end":
                yield _sse(chunk(None, event["finish_reason"], extra={"eagle": event["eagle"]}))
                if include_usage:
                    yield _sse({"id": chunk_id, "object": obj, "created": created, "model": model, "choices": [], "usage": event["usage"]})
    except Exception as err:  # noqa: BLE001 - headers are sent: report the failure in-band, then end the stream
        api_error = as_api_error(err, retry_after_s=retry_after_s)
        yield _sse(api_error.body())
    yield _sse("[DONE]")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (by its Content-Length when it sends one,
    else while it is read: a larger body is never held whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
        parts.append(chunk)
    return b"".join(parts)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_media_type(request: Request) -> None:
    """415 unless the body is sent as ``application/json``: a cross-site form post cannot send that type
    without a CORS preflight. Checked before the body is read."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, "the request body must be sent as Content-Type: application/json", code="unsupported_media_type")


def decode_json(raw: bytes) -> dict[str, Any]:
    """A JSON object; 400 for invalid JSON, NaN/Infinity, nesting past Python's recursion limit, and strings
    with a lone UTF-16 surrogate (they cannot be encoded as text)."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate ("\\ud800") cannot be encoded
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except UnicodeEncodeError:
        raise APIError(400, "the request body contains a lone UTF-16 surrogate, which is not text", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return value


def schema_checked(schema: type[_Sampling], raw: dict[str, Any]) -> _Sampling:
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        raise _validation_error(err) from None


def make_api(ingress: OpenAIIngress):
    """The FastAPI app for ``ingress``."""
    app = FastAPI(title="eagle-platform", description="EAGLE speculative decoding, OpenAI-compatible")

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers())

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, err: StarletteHTTPException):
        return error_response(APIError(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, err: RequestValidationError):
        return error_response(APIError(400, str(err.errors()[0].get("msg", "invalid request"))))

    async def parse(request: Request, schema: type[_Sampling]) -> _Sampling:
        check_media_type(request)
        body = schema_checked(schema, decode_json(await read_body(request, ingress.limits.max_body_bytes)))
        try:
            body.check()
        except RequestError as err:
            raise APIError(400, err.message, param=err.param, code=err.code) from None
        return body

    async def complete(kind: str, request: Request, schema: type[_Sampling]):
        body = await parse(request, schema)
        client = ingress.client(body.model)
        try:
            payload = body.to_request()  # type: ignore[attr-defined]
        except RequestError as err:
            raise APIError(400, err.message, param=err.param, code=err.code) from None
        if body.stream:
            events = client.stream(payload)
            try:  # the first event arrives after validation on the replica: errors are still proper 4xx
                first = await asyncio.wait_for(events.__anext__(), timeout=ingress.request_timeout_s)
            except StopAsyncIteration:
                raise APIError(500, "the model ended the stream before it started", type="server_error") from None
            except Exception as err:  # noqa: BLE001 - mapped to an HTTP error
                raise as_api_error(err, retry_after_s=ingress.retry_after_s) from None
            replica = {"X-Eagle-Replica": first["replica"]} if first.get("replica") else {}  # the replica that started it
            return StreamingResponse(
                _sse_stream(kind, body.model, first, events, body.include_usage(), ingress.retry_after_s, ingress.limits.stream_idle_s),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", **replica},
            )
        try:
            result = await asyncio.wait_for(client.generate(payload), timeout=ingress.request_timeout_s)
        except Exception as err:  # noqa: BLE001 - mapped to an HTTP error
            raise as_api_error(err, retry_after_s=ingress.retry_after_s) from None
        return JSONResponse(_completion_body(kind, body.model, result, int(time.time())))

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(await ingress.models())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete("text", request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete("chat", request, ChatRequest)

    @app.get("/health")
    async def health():
        status, body = await ingress.health()
        return JSONResponse(body, status_code=status)

    return app
