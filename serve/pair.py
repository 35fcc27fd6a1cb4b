"""One served pair: a target and its EAGLE head (or the target alone), as a plain class.

``PairServer`` loads the pair, submits requests to an ``eagle.batch.BatchDecoder`` and swaps the head when
the registry's alias moves. It knows nothing about HTTP or Ray Serve's deployment options: ``serve.app``
makes it a deployment, ``serve.openai_api`` speaks HTTP. Tests run it in-process with tiny models.

Batching: one decode thread per replica steps the batch decoder; every live request of the replica (up
to ``max_batch_size``; more wait in the engine's queue) advances by one step per target forward, and each
step's tokens go to the request's asyncio queue, so streaming stays per request. The engine owns the
request rules (context window, stop tokens, tau); the server renders text, applies stop strings and
resumes requests whose first replica died (``Request.resume_token_ids``).

Hot swap: with a ``models:/<name>@<alias>`` head, a watcher thread polls the registry every ``watch_s``
seconds; when the alias points at a new version it downloads and loads that head (a new batch decoder)
beside the current one, then swaps the reference. Requests already running finish on the engine they
started with (the decode loop steps both until the old one is empty), so none is dropped; new requests
get the new head. ``reconfigure`` (Serve's ``user_config``) can also pin a head.

Serving while compiling: with ``compile: on`` a replica first loads an eager stand-in (the target alone,
plain decoding, nothing compiled: it answers within seconds of the target's load) and builds the compiled
pair on a background thread (its graphs compile, or load from ``eagle.artifacts`` where that is on); then
it swaps the compiled pair in exactly as a hot swap does.
Requests running on the stand-in finish there, new ones get the compiled pair; ``info()["path"]`` says
which one serves new requests ("eager" or "compiled"). Greedy answers are the same on both paths in fp32;
in bf16 they may differ where eager and compiled rounding split a near-tie.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle.admission import BatchRequest
from eagle.batch import BatchDecoder, check_graphs
from eagle.compile import CompileConfig
from eagle.errors import ContextLengthError, EagleError
from eagle.generate import Decoder, GenerationConfig, StepOutput, TextDelta
from eagle.runtime import available_cores, on_own_thread, preferred_dtype, use_threads
from eagle.target import Target, check_device
from eagle.tree import TreeSpec, build_tree
from eagle.verify import SamplingConfig

logger = logging.getLogger(__name__)


class RequestError(EagleError):
    """A request the pair cannot serve as asked (HTTP 400). ``code`` follows OpenAI's error codes."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self):  # keep param/code when Ray pickles the error back to the caller
        return (_rebuild_request_error, (self.message, self.param, self.code))


def _rebuild_request_error(message: str, param: str | None, code: str | None) -> "RequestError":
    return RequestError(message, param=param, code=code)


WATCH_S = 30.0  # the registry poll interval of a models:/...@alias head, unless a pair sets its own
MAX_SHARED_INTERVAL_S = 1.0  # the longest wait between two chunks that a replica's chunk budget imposes


def chunk_interval(open_streams: int, minimum_s: float, chunks_per_s: float | None) -> float:
    """Seconds a stream waits between two chunks: ``minimum_s`` (``stream_interval_s``), or the stream's
    share of the replica's chunk budget when that is longer (``open_streams / chunks_per_s``, capped at
    ``MAX_SHARED_INTERVAL_S``). Each chunk costs the replica, the ingress and the HTTP proxy CPU on the
    cores that decode (docs/benchmarks.md section 7: 0.5 s chunks served 188-192 tok/s at 8 clients
    against 169-174 for 0.1 s on one start of one pair)."""
    share = min(open_streams / chunks_per_s, MAX_SHARED_INTERVAL_S) if chunks_per_s else 0.0
    return max(minimum_s, share)


class TreeSettings(BaseModel):
    """The draft tree (``eagle.tree.build_tree``: kind and sizes); None = the engine default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["dynamic", "static", "auto", "hybrid"] = "dynamic"
    depth: int | None = Field(None, ge=1)
    top_k: int | None = Field(None, ge=1)
    total_tokens: int | None = Field(None, ge=1)
    branch_tokens: int | None = Field(None, ge=1)

    def build(self) -> TreeSpec:
        return build_tree(self.kind, depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens, branch_tokens=self.branch_tokens)


class PairSpec(BaseModel):
    """What one pair serves: the one schema of a pair (``serve.app.PairArgs`` adds how it is deployed; a
    replica receives this model's dict and validates it again here).

    Attributes:
        model: the id clients send as ``model`` (e.g. ``smollm2-135m-eagle``).
        target: a built-in target name (``smollm2-135m``) or a local Hugging Face directory.
        head: ``models:/<name>@<alias>`` (registry), a local head directory, or None for the target alone.
        dtype: weights and compute dtype of target and head; ``auto`` (the default) is
            ``eagle.runtime.preferred_dtype``: bf16 on a GPU or a CPU that computes it natively, else fp32 (on an
            AVX2-only CPU a SmolLM2 speculative step ran 775 ms in bf16 against 269 ms in fp32,
            docs/benchmarks.md section 12).
        device: where target and head run: ``cpu``, ``cuda`` or ``cuda:N`` (``eagle.target.check_device``;
            a CUDA pair's replicas reserve GPUs, ``serve.app.PairArgs.num_gpus``).
        max_tokens: the largest ``max_tokens`` a request may ask for.
        default_max_tokens: used when a request gives none (capped by what fits the context).
        watch_s: registry poll interval for hot swap (``models:/...@alias`` heads only); None disables it.
        threads: torch intra-op threads per replica (None: ``default_threads()``, all cores but one); set on
            the decode thread and the threads that load heads (``eagle.runtime.use_threads``).
        tree: the draft tree.
        compile: ``eagle.compile`` mode ("on": the batched functions compile when the replica starts, on
            CPU with inductor's C++ wrapper, ``CompileConfig.cpp_wrapper``).
        eager_until_compiled: with ``compile: on``, answer on an eager stand-in (the target alone) while the
            compiled pair is built in the background, then switch (the module docstring); False: the
            replica is not ready until its graphs are.
        max_batch_size: requests one replica decodes together (``eagle.batch.BatchDecoder``); more wait.
        batch_graphs: batch sizes whose plain steps run a compiled graph (``compile: on`` only; each in
            ``2..max_batch_size``; a step pads up to the next one): less CPU per step, ~1.5 minutes of
            start-up each for SmolLM2 on 2 cores (measured: 3 sizes added 269 s). Empty (default): batched steps run eagerly.
        max_context: prompt + completion tokens per request (the replica's KV cache holds
            ``max_batch_size`` rows of this many slots); capped by the target's context window.
        speculate: the batch's speculation policy: "auto" (measured costs), "always" or "never".
        stuck_after_s: ``check_health`` fails when requests wait and no decode step finished for this long.
        stream_interval_s: the shortest time between two chunks of one request's stream after its first
            token (which goes out at once): tokens decoded meanwhile go out together. Every chunk costs the
            streaming path (replica, ingress, HTTP proxy) CPU on the cores that decode; 0 sends every step's
            tokens as their own chunk.
        stream_chunks_per_s: the most chunks per second the replica's open streams send together: with n
            streams open, a stream waits at least ``n / stream_chunks_per_s`` seconds between chunks (at most
            ``MAX_SHARED_INTERVAL_S``), so the streaming path's CPU stays bounded as the batch grows instead
            of growing with it (``chunk_interval``). None (default): each stream keeps ``stream_interval_s``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    target: str = Field(min_length=1)
    head: str | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    device: str = "cpu"
    max_tokens: int = Field(1024, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    watch_s: float | None = Field(WATCH_S, gt=0)
    threads: int | None = Field(None, ge=1)
    tree: TreeSettings = Field(default_factory=TreeSettings)
    compile: Literal["on", "off"] = "on"
    eager_until_compiled: bool = True
    max_batch_size: int = Field(8, ge=1)
    batch_graphs: tuple[int, ...] = ()
    max_context: int = Field(2048, ge=2)
    speculate: Literal["auto", "always", "never"] = "auto"  # eagle.policy.SPECULATE_MODES
    stuck_after_s: float = Field(120.0, gt=0)
    stream_interval_s: float = Field(0.0, ge=0, le=1.0)
    stream_chunks_per_s: float | None = Field(None, gt=0)

    @field_validator("device")
    @classmethod
    def _device_spelling(cls, device: str) -> str:
        return check_device(device, present=False)  # whether the replica sees it is checked where it loads

    @model_validator(mode="after")
    def _graphs_fit(self) -> "PairSpec":
        try:
            check_graphs(self.batch_graphs, self.max_batch_size, self.compile == "on")
        except EagleError as err:
            raise ValueError(f"batch_graphs: {err}") from None
        return self


def default_threads() -> int:
    """A replica's torch threads when its pair sets none: every core it may run on but one, which the
    streaming path (Serve's HTTP proxy, the ingress, the replica's event loop) needs. Measured on 2 cores
    (SmolLM2 bf16, compiled, target alone, 16 MT-bench prompts x 128 tokens through HTTP): 1 thread served
    52 tok/s at 1 client and 109 at 8, 2 threads 38 and 82-98 with eager batches: the decode step's OpenMP
    team stalls whenever the serving processes take one of its cores. With compiled ``batch_graphs`` and
    one busy replica, all cores won on both 2-core CPUs measured (docs/benchmarks.md section 7); a pair
    that has the cores to itself sets ``threads``."""
    return max(1, available_cores() - 1)


@dataclass(frozen=True)
class Request:
    """A decoding request as the HTTP layer hands it over (already type-checked there).

    Exactly one of ``prompt`` (plain text), ``prompt_ids`` (token ids) or ``messages`` (chat turns rendered
    with the target's chat template) is set.

    ``resume_token_ids`` / ``resume_text``: this request's completion tokens and the exact text already
    delivered to the client (by a replica that died); the pair continues after them (``PairServer._resume``).
    """

    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    resume_token_ids: tuple[int, ...] = ()
    resume_text: str = ""


@dataclass
class _Loaded:
    """An immutable snapshot of what serves requests: swapped as a whole on hot swap."""

    decoder: Decoder
    engine: BatchDecoder
    head_dir: str | None
    head_version: str | None  # registry version, or None for a local folder / no head
    loaded_at: float
    path: str = "compiled"  # "eager" for the stand-in that serves while the compiled pair is built


class _Metrics:
    """Prometheus metrics through Ray Serve's metrics API (exported by Ray's metrics agent); a no-op
    outside a Serve replica so the class also runs in plain Python."""

    def __init__(self, model: str) -> None:
        self.tags = {"model": model}
        try:
            from ray import serve
            from ray.serve import metrics

            serve.get_replica_context()  # raises outside a replica
        except Exception:  # noqa: BLE001 - any failure means "not in a replica": metrics are optional there
            self.enabled = False
            return
        self.enabled = True
        keys = ("model",)
        self.requests = metrics.Counter("eagle_requests", "Requests answered, by outcome.", tag_keys=("model", "outcome"))
        self.tokens = metrics.Counter("eagle_generated_tokens", "Tokens generated.", tag_keys=keys)
        self.tau = metrics.Histogram(
            "eagle_tau", "Average acceptance length per request (tokens per target forward).",
            boundaries=[1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0], tag_keys=keys,
        )
        seconds = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
        self.ttft = metrics.Histogram("eagle_time_to_first_token_s", "Seconds to the first token.", boundaries=seconds, tag_keys=keys)
        self.latency = metrics.Histogram("eagle_request_latency_s", "Seconds per request.", boundaries=seconds, tag_keys=keys)
        self.batch = metrics.Histogram(
            "eagle_batch_size", "Mean number of requests sharing a request's target forwards (continuous batching).",
            boundaries=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0], tag_keys=keys,
        )

    def finished(self, *, tokens: int, tau: float | None, ttft: float | None, latency: float, batch: float | None = None) -> None:
        if not self.enabled:
            return
        if batch is not None:
            self.batch.observe(batch, tags=self.tags)
        self.requests.inc(1, tags={**self.tags, "outcome": "ok"})
        self.tokens.inc(tokens, tags=self.tags)
        if tau:
            self.tau.observe(tau, tags=self.tags)
        if ttft is not None:
            self.ttft.observe(ttft, tags=self.tags)
        self.latency.observe(latency, tags=self.tags)

    def failed(self, outcome: str) -> None:
        if self.enabled:
            self.requests.inc(1, tags={**self.tags, "outcome": outcome})


class StopStrings:
    """OpenAI ``stop`` sequences on the decoded text: the output ends before the first match, which is not
    returned. In streaming, text that could still become a match is held back until it cannot."""

    def __init__(self, stops: tuple[str, ...], *, sent: int = 0) -> None:
        """``sent``: characters the client already has (a resumed request), which are never released again."""
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # everything decoded so far
        self.sent = sent  # characters released
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to release, whether a stop sequence was hit)."""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent :], max(self.sent, len(self.text))
            return out, False
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.sent : end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            self.stopped = True
            return out, True
        hold = 0  # longest suffix of the text that is a proper prefix of some stop sequence
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:length]):
                    hold = max(hold, length)
                    break
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        if self.stopped:  # nothing from a stop sequence on is ever released
            return ""
        out, self.sent = self.text[self.sent :], max(self.sent, len(self.text))
        return out


@dataclass
class _Resume:
    """How a request continues after what was already delivered (``Request.resume_token_ids``/``resume_text``).

    ``config`` is None when nothing is left to decode (``finish`` says why); ``released``: text of the
    delivered tokens the client lacks (held back before) that is safe to send now. The engine primes its
    detokeniser with the delivered tokens (``BatchDecoder.submit(generated=...)``), so its text deltas
    continue right after theirs.
    """

    token_ids: list[int]
    config: GenerationConfig | None
    finish: str | None
    stops: StopStrings
    released: str = ""


class PairServer:
    """Serve one (target, head) pair; see the module docstring for concurrency and hot swap."""

    def __init__(self, spec: PairSpec | dict[str, Any], *, target: Target | None = None) -> None:
        """``spec`` (a PairSpec or its dict form, as Serve passes it); ``target`` injects an already loaded
        target (tests), else ``spec.target`` is loaded."""
        self.spec = spec if isinstance(spec, PairSpec) else PairSpec.model_validate(spec)
        self.threads = self.spec.threads or default_threads()
        self.tree = self.spec.tree.build()
        self._head_spec = self.spec.head
        self._load_lock = threading.Lock()  # one head load at a time: the background build, refresh, reconfigure
        self._compile_error: str | None = None
        self._compiled = threading.Event()  # set once the compiled pair serves (or when there is none to build)
        self._pending_head: tuple[str | None, tuple] | None = None  # (head spec, _read_head's) for the background build
        stand_in = self.spec.compile == "on" and self.spec.eager_until_compiled
        # model work off the decode thread runs on short-lived threads (``on_own_thread``: a second long-lived
        # OpenMP team would halve the decode thread's speed)
        self._loaded = on_own_thread(self._load_pair, target, stand_in, threads=self.threads)
        self._swap_lock = threading.Lock()
        self._metrics = _Metrics(self.spec.model)
        # the decode loop: one thread steps the current engine (and, after a hot swap, the previous one until
        # its requests finish); requests wait on asyncio queues that the loop fills between steps
        self._engines: list[BatchDecoder] = [self._loaded.engine]
        self._waiters: dict[int, tuple[BatchRequest, asyncio.AbstractEventLoop, _Outputs, list[int]]] = {}
        self._work = threading.Condition()
        self._closed = False
        self._loop_error: str | None = None
        self._progress_at = time.monotonic()  # the decode loop's last step, or when it woke up to work
        self._open_streams = 0  # ``stream`` generators between their first chunk and their end (the event loop's)
        self._max_prompt_bytes = _max_prompt_bytes(self.target.tokenizer, self._loaded.engine.max_context)
        self._decode_thread = threading.Thread(target=self._decode_loop, name=f"decode-{self.spec.model}", daemon=True)
        self._decode_thread.start()
        self._stop_watch = threading.Event()
        self._watch_s = self.spec.watch_s
        self._watch_error: str | None = None
        self._watcher: threading.Thread | None = None
        if stand_in:
            threading.Thread(target=self._build_compiled, name=f"compile-{self.spec.model}", daemon=True).start()
        else:
            self._compiled.set()
        if self._head_spec and self._head_spec.startswith("models:/") and self._watch_s:
            self._start_watcher()
        logger.info("pair %s ready (%s path): target %s, head %s (version %s)", self.spec.model, self._loaded.path, self.target.name,
                    self._loaded.head_dir, self._loaded.head_version)

    # ---- loading and hot swap -------------------------------------------------------------------------

    def _load_pair(self, target: Target | None, stand_in: bool) -> _Loaded:
        """Set ``self.target`` (``target``, or ``spec.target`` loaded) and load the head on it, or (``stand_in``)
        read the head (a head that cannot be resolved or does not fit fails the start here, as without a
        stand-in) and return the eager stand-in that serves until ``_build_compiled`` has built the pair."""
        from eagle.target import load_target

        if target is None:
            dtype = preferred_dtype(self.spec.dtype, gpu=self.spec.device != "cpu")  # what ``auto`` is on this machine
            target = load_target(self.spec.target, dtype=dtype, device=self.spec.device)
        self.target = target
        if self.target.tokenizer is None:
            raise EagleError(f"pair {self.spec.model!r}: the target has no tokenizer; an HTTP pair needs one")
        if stand_in:
            self._pending_head = (self._head_spec, self._read_head(self._head_spec))
            decoder = Decoder(self.target, None, compile="off")
            engine = BatchDecoder(decoder, max_batch=self.spec.max_batch_size, max_context=self.spec.max_context)
            return _Loaded(decoder, engine, None, None, time.time(), path="eager")
        return self._load(self._head_spec)

    def _build_compiled(self) -> None:
        """The compiled pair, built beside the eager stand-in and then swapped in (the background thread)."""
        started = time.perf_counter()
        try:
            with self._load_lock:
                head_spec, (head, head_dir, version) = self._pending_head
                self._pending_head = None
                if head_spec != self._head_spec:  # ``reconfigure`` switched heads first: its compiled pair serves
                    return
                loaded = on_own_thread(self._loaded_from, head, head_dir, version, threads=self.threads)
                with self._swap_lock:
                    self._loaded = loaded
                self._add_engine(loaded.engine)
            logger.info("pair %s: compiled path serves after %.1f s (head version %s)", self.spec.model,
                        time.perf_counter() - started, loaded.head_version)
        except Exception as err:  # noqa: BLE001 - the stand-in keeps answering; info() and the log say why
            self._compile_error = str(err).splitlines()[0] if str(err) else type(err).__name__
            logger.exception("pair %s: building the compiled path failed; serving on the eager stand-in", self.spec.model)
        finally:
            self._compiled.set()

    def _load(self, head_spec: str | None) -> _Loaded:
        return self._loaded_from(*self._read_head(head_spec))

    def _load_dir(self, head_dir: str, version: str | None) -> _Loaded:
        return self._loaded_from(self._head_from(head_dir), head_dir, version)

    def _loaded_from(self, head, head_dir: str | None, version: str | None) -> _Loaded:
        """What serves ``head`` (None: the target alone): its decoder and batch decoder, ready (``_ready``)."""
        return _Loaded(*self._ready(head), head_dir, version, time.time(), path=self._path)

    def _read_head(self, head_spec: str | None) -> tuple[Any, str | None, str | None]:
        """(head, its directory, its registry version) for ``head_spec``; (None, None, None) for no head."""
        if head_spec is None:
            return None, None, None
        head_dir, version = self._resolve_head_dir(head_spec)
        return self._head_from(head_dir), head_dir, version

    def _head_from(self, head_dir: str):
        from eagle.head import EagleHead

        return EagleHead.from_pretrained(head_dir, self.target)  # checks shape and target revision

    @property
    def _path(self) -> str:
        return "compiled" if self.spec.compile == "on" else "eager"

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until the compiled pair serves (or its build failed, ``info()["compile_error"]``; or there
        is none to build); False on timeout."""
        return self._compiled.wait(timeout)

    @functools.cached_property
    def _registry(self):
        """The ``eagle_platform.registry.Registry`` (at ``$MLFLOW_TRACKING_URI``) that ``models:/`` heads
        come from; built on first use, so a pair with a local head never imports the platform."""
        from eagle_platform.registry import Registry

        return Registry()

    def _resolve_head_dir(self, spec: str) -> tuple[str, str | None]:
        """A head spec as (local directory, registry version or None); a ``models:/`` head comes from the
        local cache when MLflow is briefly down (``Registry.resolve_head_version``)."""
        if spec.startswith("models:/"):
            directory, version = self._registry.resolve_head_version(spec)
            return directory, version
        from eagle.cli import resolve_head_spec

        return resolve_head_spec(spec), None

    def _ready(self, head) -> tuple[Decoder, BatchDecoder]:
        """A batch decoder whose functions are compiled (auto tree chosen, policy costs measured) before it
        serves a request: on hot swap this runs on the watcher thread while the old head keeps serving."""
        # the C++ wrapper runs each graph without the GIL, away from the replica's event loops (eagle.compile)
        decoder = Decoder(self.target, head, self.tree, compile=CompileConfig(mode=self.spec.compile, cpp_wrapper=True))
        engine = BatchDecoder(decoder, max_batch=self.spec.max_batch_size, max_context=self.spec.max_context, speculate=self.spec.speculate,
                              graphs=self.spec.batch_graphs)
        started = time.perf_counter()
        report = engine.warmup()
        logger.info("pair %s: ready in %.1f s; speculation policy %s", self.spec.model, time.perf_counter() - started, report)
        return decoder, engine

    def _start_watcher(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name=f"head-watch-{self.spec.model}", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop_watch.wait(self._watch_s or WATCH_S):
            try:
                self.refresh()
                self._watch_error = None
            except Exception as err:  # noqa: BLE001 - a registry hiccup must not kill the replica: keep serving
                self._watch_error = str(err).splitlines()[0] if str(err) else type(err).__name__
                logger.warning("pair %s: registry poll failed, keeping version %s: %s", self.spec.model, self._loaded.head_version, self._watch_error)

    def refresh(self) -> bool:
        """Load the head the alias points at now, if it moved; True when the head was swapped."""
        spec = self._head_spec
        if not spec or not spec.startswith("models:/"):
            return False
        if not self._compiled.is_set():  # the stand-in's background build loads the alias's head as it is then
            return False
        head_dir, current = self._registry.resolve_head_version(spec)
        if current == self._loaded.head_version:
            return False
        with self._load_lock:
            loaded = on_own_thread(self._load_dir, head_dir, current, threads=self.threads)
            with self._swap_lock:
                previous, self._loaded = self._loaded, loaded
            self._add_engine(loaded.engine)
        logger.info("pair %s: %s moved, head version %s -> %s", self.spec.model, spec, previous.head_version, loaded.head_version)
        return True

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config``: ``{"head": <spec>}`` switches to that head (a ``serve deploy`` with a new
        value updates replicas in place), ``{"watch_s": s}`` changes the poll interval."""
        if "watch_s" in user_config:
            self._watch_s = float(user_config["watch_s"]) if user_config["watch_s"] else None
        head = user_config.get("head", self._head_spec)
        if head != self._head_spec:
            with self._load_lock:  # after a background build: its pair is replaced by this one
                loaded = on_own_thread(self._load, head, threads=self.threads)
                with self._swap_lock:
                    self._loaded, self._head_spec = loaded, head
                self._add_engine(loaded.engine)
            logger.info("pair %s: reconfigured to head %s (version %s)", self.spec.model, head, loaded.head_version)
        if self._head_spec and self._head_spec.startswith("models:/") and self._watch_s and self._watcher is None:
            self._start_watcher()

    def shutdown(self) -> None:
        self._stop_watch.set()
        with self._work:
            self._closed = True
            self._work.notify_all()

    # ---- the decode loop ------------------------------------------------------------------------------

    def _add_engine(self, engine: BatchDecoder) -> None:
        with self._work:
            if engine not in self._engines:
                self._engines.insert(0, engine)
            self._work.notify_all()

    def _decode_loop(self) -> None:
        """Step every engine with work, deliver each step's outputs, sleep when there is none."""
        use_threads(self.threads)
        try:
            while True:
                with self._work:
                    while not self._closed and all(engine.idle for engine in self._engines) and not self._undelivered():
                        self._work.wait()
                    if self._closed:
                        return
                    # a swapped-out engine stays until its last request finished
                    self._engines = [e for i, e in enumerate(self._engines) if i == 0 or not e.idle]
                    engines = [engine for engine in self._engines if not engine.idle]
                    self._progress_at = time.monotonic()
                for engine in engines:
                    engine.step(on_admit=self._deliver)  # a wave's first tokens go out as each prefill ends
                    self._progress_at = time.monotonic()
                self._deliver()
        except BaseException as err:  # noqa: BLE001 - the replica is unusable: health checks report it
            self._loop_error = f"{type(err).__name__}: {err}"
            logger.exception("pair %s: decode loop died", self.spec.model)
            with self._work:
                self._closed = True
            self._deliver(failed=RuntimeError(f"decode loop died: {self._loop_error}"))

    def _undelivered(self) -> bool:
        """Whether a request finished or produced outputs its waiter has not been handed (it may have been
        decoded before its waiter registered); called with ``_work`` held."""
        return any(request.done or len(request.outputs) > sent[0] for request, _, _, sent in self._waiters.values())

    def _deliver(self, failed: BaseException | None = None) -> None:
        """Hand every waiting request its new outputs, then its end (``None``) once it is done."""
        with self._work:
            waiters = list(self._waiters.items())
        for key, (request, loop, queue, sent) in waiters:
            new = request.outputs[sent[0]:]
            sent[0] += len(new)
            done = request.done or failed is not None
            if new or done:
                items: list[Any] = list(new)
                if done:
                    items.append(request.error or failed)
                try:
                    loop.call_soon_threadsafe(_put_all, queue, items)
                except RuntimeError:  # the request's event loop is gone (client went away)
                    pass
            if done:
                with self._work:
                    self._waiters.pop(key, None)

    def __del__(self) -> None:  # Serve drops replicas by garbage collection
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    # ---- health and metadata --------------------------------------------------------------------------

    def check_health(self) -> None:
        """Serve's health check: raises when this replica cannot serve (Serve then replaces it)."""
        if self._loop_error is not None:
            raise RuntimeError(f"pair {self.spec.model}: decode loop died: {self._loop_error}")
        if self._closed or not self._decode_thread.is_alive():
            raise RuntimeError(f"pair {self.spec.model}: decode loop is not running")
        with self._work:
            waiting = not all(engine.idle for engine in self._engines)
            quiet_s = time.monotonic() - self._progress_at
        if waiting and quiet_s > self.spec.stuck_after_s:
            raise RuntimeError(f"pair {self.spec.model}: decode loop is stuck: no step finished in {quiet_s:.0f} s "
                               f"while requests wait")

    def info(self) -> dict[str, Any]:
        loaded = self._loaded
        return {
            "model": self.spec.model,
            "target": self.target.name,
            "target_revision": self.target.revision,
            "head": self._head_spec,
            "head_version": loaded.head_version,
            "path": loaded.path,  # "eager" while the compiled pair is built (serving while compiling)
            "compile_error": self._compile_error,
            "speculative": loaded.decoder.head is not None,
            "tree": self.spec.tree.model_dump(),
            "max_batch_size": self.spec.max_batch_size,
            "batch_graphs": list(self.spec.batch_graphs),
            "stream_interval_s": self.spec.stream_interval_s,
            "stream_chunks_per_s": self.spec.stream_chunks_per_s,
            "open_streams": self._open_streams,
            "active_requests": sum(engine.active for engine in self._engines),
            "speculation_policy": loaded.engine.policy.report(),
            "dtype": str(self.target.dtype).removeprefix("torch."),  # the dtype that runs (``auto`` resolved)
            "threads": self.threads,
            "context_window": loaded.decoder.context_window,
            "max_tokens": self.spec.max_tokens,
            "registry_error": self._watch_error,
        }

    # ---- requests -------------------------------------------------------------------------------------

    def _prompt_ids(self, request: Request) -> list[int]:
        tokenizer = self.target.tokenizer
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            if not ids:
                raise RequestError("the prompt is empty", param="prompt")
            if min(ids) < 0 or max(ids) >= self.target.vocab_size:
                raise RequestError(f"prompt token ids must lie in [0, {self.target.vocab_size})", param="prompt")
            return ids
        if request.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise RequestError(f"model {self.spec.model!r} has no chat template: use /v1/completions", param="messages")
            self._check_prompt_bytes(sum(len(content) for _, content in request.messages), "messages")
            messages = [{"role": role, "content": content} for role, content in request.messages]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            if not request.prompt:
                raise RequestError("the prompt is empty", param="prompt")
            self._check_prompt_bytes(len(request.prompt), "prompt")
            ids = tokenizer.encode(request.prompt)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        return ids

    def _check_prompt_bytes(self, chars: int, param: str) -> None:
        """Refuse, without tokenising it, a prompt that cannot fit the context whatever its tokens (a
        character is at least one UTF-8 byte; ``_max_prompt_bytes`` bounds what ``max_context`` tokens spell)."""
        if chars > self._max_prompt_bytes:
            raise RequestError(f"the prompt ({chars} characters) cannot fit this model's context window of "
                               f"{self._loaded.engine.max_context} tokens", param=param, code="context_length_exceeded")

    def _config(self, request: Request, prompt_len: int, engine: BatchDecoder) -> GenerationConfig:
        """The request's settings; the context rule is the engine's (``BatchDecoder.room`` / ``check``)."""
        max_tokens = request.max_tokens if request.max_tokens is not None else min(self.spec.default_max_tokens, self.spec.max_tokens)
        if max_tokens > self.spec.max_tokens:
            raise RequestError(f"max_tokens must be at most {self.spec.max_tokens}, got {max_tokens}", param="max_tokens")
        room = engine.room(prompt_len)
        if request.max_tokens is None and room > 0:
            max_tokens = min(max_tokens, room)
        try:
            sampling = SamplingConfig(temperature=request.temperature, top_p=request.top_p)
            return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, seed=request.seed)
        except EagleError as err:
            raise RequestError(str(err)) from None

    def _resume(self, request: Request, config: GenerationConfig, stop_ids: set[int]) -> _Resume:
        """Validate ``resume_token_ids``/``resume_text`` and prime the stop strings with them: the engine
        continues after the delivered tokens (which count against ``max_new_tokens``), and the text sent
        next starts right after ``resume_text``."""
        ids, delivered = list(request.resume_token_ids), request.resume_text
        if not ids and not delivered:
            return _Resume([], config, None, StopStrings(request.stop))
        vocab = self.target.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise RequestError(f"resume_token_ids must be token ids in [0, {vocab})", param="resume_token_ids")
        if not isinstance(delivered, str) or (delivered and not ids):
            raise RequestError("resume_text must be the text of resume_token_ids", param="resume_text")
        if len(ids) > config.max_new_tokens:
            raise RequestError(f"resume_token_ids: {len(ids)} tokens, more than max_tokens ({config.max_new_tokens})", param="resume_token_ids")
        primed = TextDelta(self.target).push(ids)  # the delivered tokens' text, as the engine will have it
        if not (primed.startswith(delivered) or delivered.startswith(primed)):
            raise RequestError("resume_text is not the text of resume_token_ids", param="resume_text")
        stops = StopStrings(request.stop, sent=len(delivered))
        released, hit = stops.push(primed)  # the delivered text itself is never sent again
        left = config.max_new_tokens - len(ids)
        finish = "stop" if hit or ids[-1] in stop_ids else ("length" if left == 0 else None)
        return _Resume(ids, config if finish is None else None, finish, stops, released)

    def _submit(self, loaded: _Loaded, prompt_ids: list[int], resume: _Resume, request: Request) -> tuple[BatchRequest, _Outputs]:
        """Queue the request on the engine (its checks raise here, as 4xx) and register where its outputs go."""
        try:
            queued = loaded.engine.submit(prompt_ids, resume.config, generated=resume.token_ids)
        except ContextLengthError as err:
            param = "max_tokens" if request.max_tokens is not None else ("messages" if request.messages is not None else "prompt")
            raise RequestError(f"{err} (this model's context window is {loaded.engine.max_context} tokens)", param=param,
                               code="context_length_exceeded") from None
        except EagleError as err:
            raise RequestError(str(err)) from None
        queue = _Outputs()
        with self._work:
            self._waiters[queued.id] = (queued, asyncio.get_running_loop(), queue, [0])
            self._work.notify_all()
        return queued, queue

    async def stream(self, request: Request | dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The request's events: ``start``, ``delta`` events (each with that step's ``token_ids``, its text
        possibly empty while held back), ``end``. Validation errors raise before the first event. The request
        joins the replica's batch (``eagle.batch.BatchDecoder``) and each of its steps' tokens arrive from the
        decode loop; a resumed request (``_resume``) continues after what was delivered."""
        request = request if isinstance(request, Request) else request_from_dict(request)
        try:
            if self._closed:
                raise RuntimeError(f"pair {self.spec.model}: decode loop is not running")
            loaded = self._loaded  # this request keeps this head even if a swap happens meanwhile
            # tokenised off the event loop: a long prompt must not stall the other requests' streams
            prompt_ids = await asyncio.to_thread(self._prompt_ids, request)
            config = self._config(request, len(prompt_ids), loaded.engine)
            stop_ids = loaded.decoder.stop_ids(config)
            resume = self._resume(request, config, stop_ids)
            queued, queue = self._submit(loaded, prompt_ids, resume, request) if resume.config else (None, None)
        except RequestError:
            self._metrics.failed("invalid")
            raise
        request_id = uuid.uuid4().hex
        started = time.perf_counter()
        yield {"type": "start", "id": request_id, "prompt_tokens": len(prompt_ids), "head_version": loaded.head_version,
               "path": loaded.path, "replica": _replica_id()}
        stops = resume.stops
        tokens = len(resume.token_ids)
        finish = resume.finish or "length"
        first_token_s: float | None = None
        self._open_streams += 1
        try:
            if resume.released:
                yield {"type": "delta", "text": resume.released, "token_ids": []}
            while queue is not None:
                output, end = _coalesce([await queue.get(), *_drain(queue)])
                if output is not None:
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - started
                    tokens += len(output.token_ids)
                    text, hit = stops.push(output.text)
                    if text or output.token_ids:
                        yield {"type": "delta", "text": text, "token_ids": output.token_ids}
                    if hit:
                        finish = "stop"
                        break
                    interval = chunk_interval(self._open_streams, self.spec.stream_interval_s, self.spec.stream_chunks_per_s)
                    if interval and end is _OPEN:
                        await _until_end_or(queue, interval)  # the next chunk takes what the steps meanwhile made
                if end is not _OPEN:
                    if end is not None:
                        raise end
                    finish = queued.finish_reason if queued.finish_reason in ("stop", "length") else finish
                    tail = stops.flush()
                    if tail:
                        yield {"type": "delta", "text": tail, "token_ids": []}
                    break
        except Exception:
            self._metrics.failed("error")
            raise
        finally:
            self._open_streams -= 1
            if queued is not None and not queued.done:
                loaded.engine.cancel(queued)  # a stop string, or the client went away: free the row
                with self._work:
                    self._work.notify_all()
        total_s = time.perf_counter() - started
        steps = queued.steps if queued is not None else []
        tau = queued.tau if queued is not None else None
        accepted = sum(s.accepted for s in steps)
        batch_mean = sum(s.batch for s in steps) / len(steps) if steps else None
        speculative = loaded.decoder.head is not None
        self._metrics.finished(tokens=tokens - len(resume.token_ids), tau=tau if speculative else None, ttft=first_token_s,
                               latency=total_s, batch=batch_mean)
        yield {
            "type": "end",
            "finish_reason": finish,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": tokens, "total_tokens": len(prompt_ids) + tokens},
            "eagle": {
                "head_version": loaded.head_version,
                "path": loaded.path,
                "speculative": speculative,
                "target_forwards": len(steps) + (1 if queued is not None and not resume.token_ids else 0),  # + the prefill
                "accepted_tokens": accepted,
                "tau": round(tau, 4) if tau is not None else None,
                "batch_size_mean": round(batch_mean, 3) if batch_mean is not None else None,
                "drafted_steps": sum(1 for s in steps if s.policy != "plain"),
                "draft_s": round(sum(s.draft_s for s in steps), 6),
                "verify_s": round(sum(s.verify_s for s in steps), 6),
                "time_to_first_token_s": round(first_token_s or 0.0, 6),
                "queue_s": round(queued.queue_s, 6) if queued is not None and queued.queue_s is not None else None,
                "prefill_s": round(queued.prefill_s, 6) if queued is not None and queued.prefill_s is not None else None,
                "total_s": round(total_s, 6),
                "resumed_tokens": len(resume.token_ids),
                "replica": _replica_id(),
            },
        }

    async def generate(self, request: Request | dict[str, Any]) -> dict[str, Any]:
        """The whole answer: ``{"id", "text", "finish_reason", "usage", "eagle"}``."""
        parts: list[str] = []
        result: dict[str, Any] = {}
        async for event in self.stream(request):
            if event["type"] == "start":
                result["id"] = event["id"]
            elif event["type"] == "delta":
                parts.append(event["text"])
            else:
                result.update(finish_reason=event["finish_reason"], usage=event["usage"], eagle=event["eagle"])
        result["text"] = "".join(parts)
        return result


_OPEN = object()  # ``_coalesce``: the request has not ended


def _drain(queue: asyncio.Queue) -> list[Any]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _coalesce(items: list[Any]) -> tuple[StepOutput | None, Any]:
    """The step outputs waiting in a request's queue as one output (a client that reads slower than the
    batch steps gets fewer, larger chunks instead of a backlog: every chunk costs Serve's streaming path
    CPU on the machine that decodes), and the end marker if one arrived (None: finished; an exception:
    failed; ``_OPEN``: still running)."""
    outputs = [item for item in items if not _is_end(item)]
    end = next((item for item in items if _is_end(item)), _OPEN)
    if not outputs:
        return None, end
    merged = StepOutput([t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs), outputs[-1].stats)
    return merged, end


def _is_end(item: Any) -> bool:
    """Whether a queued item is a request's end marker (None: finished; an exception: failed), not a step output."""
    return not isinstance(item, StepOutput)


class _Outputs(asyncio.Queue):
    """A request's step outputs, then its end marker (None or an exception); ``ended`` is set with the marker."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()


async def _until_end_or(queue: _Outputs, seconds: float) -> None:
    """Wait ``seconds``, or less if the request's end marker arrives meanwhile (its last tokens are not held
    back for the rest of the interval); the items stay queued for the caller."""
    try:
        await asyncio.wait_for(queue.ended.wait(), seconds)
    except asyncio.TimeoutError:
        pass


def _put_all(queue: _Outputs, items: list[Any]) -> None:
    for item in items:
        queue.put_nowait(item)
        if _is_end(item):
            queue.ended.set()


def _replica_id() -> str | None:
    """This Serve replica's unique id (its actor is ``SERVE_REPLICA::<app>#<deployment>#<id>``); None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - any failure means "not in a replica"
        return None


def _max_prompt_bytes(tokenizer, max_context: int) -> int:
    """The most UTF-8 bytes a prompt of ``max_context`` tokens can spell: the longest token's spelling times the
    context, times 4 for normalisers that shrink text (NFKC maps a 3-byte full-width letter to one byte). A
    token's spelling in the vocabulary is never shorter in bytes than the text it stands for (byte-level BPE
    spells a byte with a 1-2 byte character, SentencePiece a byte as ``<0xNN>``)."""
    longest = max((len(token.encode("utf-8", "replace")) for token in tokenizer.get_vocab()), default=1)
    return 4 * max(1, longest) * max_context


def request_from_dict(raw: dict[str, Any]) -> Request:
    raw = dict(raw)
    for key in ("prompt_ids", "stop", "resume_token_ids"):
        if raw.get(key) is not None:
            raw[key] = tuple(raw[key])
    if raw.get("messages") is not None:
        raw["messages"] = tuple((m[0], m[1]) if isinstance(m, (list, tuple)) else (m["role"], m["content"]) for m in raw["messages"])
    return Request(**raw)

