"""The decode loop, for one request or many: every live request advances by one step per target forward.

``BatchDecoder`` is the one decode loop: ``eagle.generate.Decoder`` runs each request as a batch of one on
it, a Serve replica runs all of its requests on one (continuous batching). Requests
join (prefill, then the next step) and leave (a stop token, their ``max_new_tokens``, a cancel) between
steps. Each request keeps its own tree (its own tokens, its own accepted length), its own sampling
settings, seed and stop rules; a step is

1. *policy*: draft this step or not (``SpeculationPolicy``: measured costs and the acceptance seen so far);
2. *catch-up*: the head consumes the target's features of every row's newly committed tokens
   (batched, one head forward; a row with more than the compiled catch-up takes, on its own). A newly
   admitted row's prompt is among them: its prefill runs the target alone, and the head consumes the
   prompt at the row's first speculative step, so a request the policy never drafts for never runs the
   head;
3. *draft*: one batched tree per row (``eagle.tree.draft_trees``: one head call per depth for all rows),
   or only the root when the policy says no;
4. *verify*: one target forward over ``[B, W]`` tokens, row b's tree in row b, under a per-row tree mask
   over the batched KV cache (``KVCache`` with one row per request: padded static slots, each row at its
   own length; the mask of row b is row b's ``padded_mask``, so rows never see each other: the batch is
   block-diagonal);
5. *accept*: per row, greedy or speculative-sampling verification (``eagle.verify``), then one batched
   compaction of the accepted paths.

Layout choice (padded rows, not a paged pool): on this CPU a pool shared by all rows would make each
query attend over every request's slots (B times the attention work of a row that sees only its own);
padded rows cost memory (``max_batch`` x capacity slots) but keep attention per row (a flat
pool was not measured: it was ruled out by that arithmetic). Under ``compile="on"`` a batch of one runs the single-request compiled graphs on row 0; batches of two
and more run eagerly, with the weights prepacked for oneDNN on CPU (``eagle.runtime.PackedLinear``):
compiled with a dynamic batch dimension the step was slower than eager and erratic on this CPU, and a
graph per batch size costs minutes of compilation each.

Lossless per request: a row's tokens depend only on its own cache row and its own random stream, so each
request's greedy output equals its batch-1 plain decoding (tests/test_batch.py, fp32), and at T > 0 each
row is the single-request speculative sampler (distribution test in the same file).

Seeding: a request with a ``seed`` draws each step's randomness from a generator seeded with (seed, the
absolute position of the step's first new token) (``step_seed``), and at T > 0 it decodes without
drafting (its rows verify the root alone, ``_seeded_sampling``), so its output is a function of the
prompt, the settings, the seed and the tokens so far, whatever the batch and the policy, and a request
resumed from the tokens already sent continues as the uninterrupted run would (``serve`` failover).
Greedy requests are deterministic whatever they draft; unseeded sampling draws from streams seeded by
torch's global generator.

Owns: ``BatchDecoder`` (the loop, its warm-up and the measurement of the policy's costs), ``BatchRequest``,
``step_seed``. Does not own: the policy's rule (``eagle.policy``), the decoder's functions, tree, widths
and request checks (``generate.Decoder``), the request and output types (``eagle.request``), HTTP or
threads (``serve.pair`` drives ``step``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

from eagle.errors import ContextLengthError, EagleError
from eagle.policy import SpeculationPolicy, check_speculate
from eagle.request import GenerationConfig, StepOutput, StepStats, TextDelta, truncate
from eagle.runtime import step_inputs
from eagle.tree import DraftTree, HybridTree, base_tree, causal_allowed, draft_trees, root_only, rows_mask
from eagle.verify import ProcessedRows, greedy_verify, processed_probs, sample_token, sample_verify

if TYPE_CHECKING:
    from eagle.generate import Decoder

logger = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment (splitmix64): spreads (seed, position) pairs


def check_graphs(graphs: Sequence[int], max_batch: int, compiled: bool) -> tuple[int, ...]:
    """The batch sizes of ``BatchDecoder(graphs=...)``, sorted; an ``EagleError`` unless each lies in
    ``2..max_batch`` and the decoder compiles (a batch of one has its own graphs)."""
    sizes = tuple(sorted({int(size) for size in graphs}))
    if sizes and not compiled:
        raise EagleError("batch graphs need compile 'on'")
    bad = [size for size in sizes if not 2 <= size <= max_batch]
    if bad:
        raise EagleError(f"batch graph sizes must lie in 2..{max_batch} (the batch limit), got {bad}")
    return sizes


def step_seed(seed: int, position: int) -> int:
    """The seed of one step's generator: a function of the request's seed and the absolute position of the
    step's first new token only (splitmix64 finaliser), so outputs do not depend on batch or history."""
    z = (seed * _SEED_MIX + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


@dataclass
class BatchRequest:
    """One request in a ``BatchDecoder``: its settings, and what it has produced so far.

    ``outputs`` receives one ``StepOutput`` per step the request took part in (the first one from its
    prefill, with ``stats=None``); ``done`` is set when it finished (``finish_reason`` "stop", "length" or
    "cancelled") or failed (``error``)."""

    prompt_ids: list[int]
    config: GenerationConfig
    id: int = field(default_factory=itertools.count().__next__)
    token_ids: list[int] = field(default_factory=list)
    outputs: list[StepOutput] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    done: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None
    resumed: list[int] = field(default_factory=list)  # output tokens produced before this request (resume)
    generator: torch.Generator | None = None  # T > 0: draw every step from this stream (``submit``)
    submitted_at: float = field(default_factory=time.perf_counter)
    queue_s: float | None = None  # from ``submit`` to the start of its prefill
    prefill_s: float | None = None  # its prefill (the target's forward, first token; the head's waits for a draft)

    @property
    def tau(self) -> float | None:
        """Tokens per target forward after the prefill (None before the first step)."""
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps) if self.steps else None


@dataclass
class _Row:
    """A live request's decoding state; its caches are row ``index`` of the batch's caches."""

    request: BatchRequest
    stop_ids: set[int]
    generator: torch.Generator | None
    committed: int  # target cache positions that are final
    root: int
    context: list[int]  # prompt + every token chosen (the root included)
    text: TextDelta
    head_committed: int = 0  # head cache positions that are final
    last_hidden: torch.Tensor | None = None  # head output at the last committed head position
    pending_features: list[torch.Tensor] = field(default_factory=list)  # target features the head has not consumed
    pending_tokens: list[int] = field(default_factory=list)  # the token after each pending feature

    @property
    def pending(self) -> int:
        return len(self.pending_tokens)


def _seeded_sampling(request: BatchRequest) -> bool:
    """A seeded request at T > 0 never drafts: speculative sampling draws a different (equally distributed)
    sample than plain sampling from the same random stream, so a seeded row that drafted in some steps
    and not in others (the policy follows the batch and the measured costs) would not repeat its output.
    A request given its own generator drafts: its caller asked for one stream, not for a repeatable output."""
    return request.config.seed is not None and request.generator is None and not request.config.sampling.greedy


class BatchDecoder:
    """Continuous batching over one ``Decoder``'s target, head, tree and compiled functions.

    ``submit`` (any thread) queues a request; ``step`` (one thread) admits queued requests up to
    ``max_batch`` (prefilling each), runs one batched step over every live request and returns the
    (request, output) pairs it produced. ``cancel`` drops a request between steps. ``max_context`` bounds
    prompt + new tokens per request (the KV cache holds ``max_batch`` rows of that many slots).
    ``speculate``: the ``SpeculationPolicy``'s mode (default the decoder's); ``warmup`` measures its costs.

    ``graphs``: batch sizes whose plain step (one token per row) runs a compiled graph (``compile="on"``
    only): a plain step of B rows pads to the smallest of them >= B (padding rows write slot 0 of free
    cache rows and are dropped); larger batches, tree verification and drafting run eagerly. Each graph
    compiles in ``warmup`` (SmolLM2 on 2 cores: 55 s for 8 rows offline without autotune, ~1.5 minutes
    a size with autotune at a Serve replica's start-up) and saves the eager step's per-op
    dispatch (docs/benchmarks.md section 7).
    """

    def __init__(self, decoder: Decoder, *, max_batch: int = 8, max_context: int | None = None,
                 speculate: str | None = None, policy: SpeculationPolicy | None = None, graphs: Sequence[int] = ()) -> None:
        if max_batch < 1:
            raise EagleError(f"max_batch must be >= 1, got {max_batch}")
        self.graphs = check_graphs(graphs, max_batch, decoder.compile.enabled)
        self.decoder = decoder
        self.target = decoder.target
        self.runtime = decoder.runtime
        self.heads = decoder.head_runtime
        self.max_batch = max_batch
        self.max_context = min(max_context or decoder.context_window, decoder.context_window)
        self.tree = decoder.tree if decoder.head is not None else None
        self.capacity = decoder._capacity(self.max_context)
        rows = max_batch
        self.cache = self.runtime.new_cache(self.capacity, rows)
        self.head_cache = self.heads.new_cache(self.capacity, rows) if self.heads is not None else None
        self.rows: list[_Row] = []
        self._queue: deque[BatchRequest] = deque()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.speculate = check_speculate(speculate or decoder.speculate) if self.heads is not None else "never"
        # unmeasured (break-even 1) until ``warmup``: drafts every step
        self.policy = policy or SpeculationPolicy({1: 1.0}, {1: 1.0}, mode=self.speculate)
        self.steps = 0
        # called after each step's verification with every row's tree and kept nodes (the root included):
        # what ``eagle.autotree`` calibrates from
        self.trace: Callable[[list[DraftTree], list[list[int]]], None] | None = None

    # ---- widths and warm-up -----------------------------------------------------------------------

    @staticmethod
    def _single(batch: int) -> bool:
        """Whether a step of ``batch`` rows runs the single-request functions on row 0 (compiled under
        ``compile="on"``, the lean modules eagerly otherwise): a batch of one."""
        return batch == 1

    def _verify_width(self, speculative: bool) -> int:
        return max(self.decoder._widths()["verify"]) if speculative else 1

    @torch.inference_mode()
    def warmup(self, *, measure: bool = True, sizes: Sequence[int] | None = None, repeats: int = 3) -> dict:
        """Run (compile) every batched function once, then measure the policy's costs at a few batch sizes
        (``sizes``; default 1, 2, 4, ... up to ``max_batch``); returns the policy report.

        Speculative steps are measured up to the first batch size whose break-even passes the most tokens a
        step can yield per row (the tree's depth + 1): verification only grows more compute-bound with the
        batch, so drafting cannot pay at the larger sizes either, and ``SpeculationPolicy`` extrapolates
        their cost. Where drafting is dear (bf16 emulated on an AVX2 CPU: a SmolLM2 speculative step 13x a
        plain one at batch 1) this skips the slowest measurements of a replica's start."""
        self.decoder.warmup(measure=False)  # resolves an auto tree; compiles the single-request graphs a batch of one runs
        for batch in self.graphs:  # compiled here, not in a request's step
            self._synthetic_verify(batch, 1, self._synthetic_context)
        self.policy = self.measure(sizes=sizes, repeats=repeats if measure else 1)
        report = self.policy.report()
        logger.info("batch policy: %s", report)
        return report

    @torch.inference_mode()
    def measure(self, *, sizes: Sequence[int] | None = None, repeats: int = 3) -> SpeculationPolicy:
        """A ``SpeculationPolicy`` over this decoder's measured plain and speculative step costs at ``sizes``
        (default 1, 2, 4, ... up to ``max_batch``), keeping the current policy's mode, tau and exploration
        settings."""
        sizes = sorted(set(sizes or [b for b in (1, 2, 4, 8, 16, 32) if b < self.max_batch] + [self.max_batch]))
        plain, speculative = {}, {}
        most_per_step = self.decoder.tree.depth + 1 if self.heads is not None else 0
        for batch in sizes:
            plain[batch] = self._time_step(batch, False, repeats)
            if self.heads is not None and all(speculative[b] <= most_per_step * plain[b] for b in speculative):
                speculative[batch] = self._time_step(batch, True, repeats)
        return SpeculationPolicy(plain, speculative, mode=self.speculate, prior_tau=self.policy.tau,
                                 explore_every=self.policy.explore_every, explore_backoff=self.policy.explore_backoff, live=True)

    def _time_step(self, batch: int, speculative: bool, repeats: int) -> float:
        """Milliseconds of one synthetic step of ``batch`` rows at a 128-token context (the median of
        ``repeats``): catch-up, drafting and the tree's verification, or one plain verification."""
        context = self._synthetic_context
        times = []
        for _ in range(repeats + 1):  # the first call warms (compiles) and is not counted
            started = time.perf_counter()
            if speculative:
                self._synthetic_draft(batch, context)
            self._synthetic_verify(batch, self._verify_width(speculative), context)
            times.append((time.perf_counter() - started) * 1e3)
        return sorted(times[1:])[len(times[1:]) // 2]

    @property
    def _synthetic_context(self) -> int:
        """The committed length the warm-up's synthetic steps run at."""
        return min(128, self.max_context // 2)

    def _synthetic_verify(self, batch: int, width: int, context: int) -> None:
        ids, positions, slots, mask = step_inputs(width, context, self.target.device)
        rows = lambda t: t.expand(batch, *t.shape[1:]).contiguous()  # noqa: E731
        self._target_rows(rows(ids), rows(positions), rows(slots[None]), rows(mask))

    def _graph(self, batch: int, width: int) -> int | None:
        """The compiled batch size a plain step of ``batch`` rows pads to, or None (eager)."""
        if width != 1 or self._single(batch):
            return None
        return next((size for size in self.graphs if size >= batch), None)

    def _target_rows(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One target forward over rows ``0..B-1`` of the cache (``ids`` ``[B, q]``, ``slots`` ``[B, q]``, ``mask``
        ``[B, 1, q, kv]``): (head input ``[B, q, ..]``, logits ``[B, q, V]``, greedy ``[B, q]``). A batch of one
        runs the single-request graph, a plain step of a size in ``graphs`` (padded up) its graph, the rest
        the eager batched step."""
        batch, width = ids.shape
        if self._single(batch):
            view = self.cache.row(0)
            out = self.runtime.step(width)(ids, positions, slots[0], mask, view.keys, view.values)
            return tuple(t[None] for t in out)
        size = self._graph(batch, width)
        if size is None:
            return self.runtime.rows_model.step_rows(ids, positions, slots, mask, self.cache.keys, self.cache.values)
        pad = size - batch
        if pad:  # padding rows: token 0 at position 0 into slot 0 of a free cache row, seeing only itself
            ids, positions, slots = (F.pad(t, (0, 0, 0, pad)) for t in (ids, positions, slots))
            alone = torch.zeros(pad, 1, 1, mask.shape[-1], dtype=torch.bool, device=mask.device)
            alone[..., 0] = True
            mask = torch.cat([mask, alone])
        out = self.runtime.rows_step(size)(ids, positions, slots, mask, self.cache.keys, self.cache.values)
        return tuple(t[:batch] for t in out)

    def _synthetic_draft(self, batch: int, context: int) -> None:
        device, dtype = self.target.device, self.runtime.model.lm_head.weight.dtype
        width = self.decoder._widths()["advance"][0]
        features = torch.zeros(1, width, self.heads.lean.input_size, dtype=dtype, device=device)
        ids, positions, slots, mask = step_inputs(width, context, device)
        if self._single(batch):
            view = self.head_cache.row(0)
            hidden = self.heads.advance(width)(features, ids, positions, slots, mask, view.keys, view.values)[:, -1]
        else:
            rows = lambda t: t.expand(batch, *t.shape[1:]).contiguous()  # noqa: E731
            hidden = self.heads.rows_lean(rows(features), rows(ids), rows(positions), rows(slots[None]), rows(mask),
                                          self.head_cache.keys, self.head_cache.values)[:, -1]
        roots = torch.zeros(batch, dtype=torch.long, device=device)
        prefix = torch.full((batch,), context, dtype=torch.long, device=device)
        self._draft_rows(hidden, roots, prefix, [[0] * 4] * batch)

    # ---- requests -----------------------------------------------------------------------------------

    def check(self, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        """Raise ``EagleError`` when this decoder cannot run the request (the engine's one check)."""
        self.decoder._check_request(list(prompt_ids), config)
        if len(prompt_ids) + config.max_new_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceed this batch "
                f"decoder's context of {self.max_context} tokens"
            )

    def room(self, prompt_len: int) -> int:
        """The most new tokens a request with a ``prompt_len``-token prompt may ask for (<= 0: none)."""
        tree_size = self.decoder.tree.size if self.decoder.head is not None else 0
        return min(self.max_context - prompt_len, self.decoder.context_window - prompt_len - tree_size - 1)

    def submit(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None, *,
               generated: Sequence[int] = (), generator: torch.Generator | None = None) -> BatchRequest:
        """Queue a request (checked now: ``EagleError`` on bad input); it joins at the next ``step``.

        ``generated``: tokens of this request's output produced earlier (a resumed request): decoding
        continues after them exactly as a step of the uninterrupted run would (the last of them is the
        root of the next step's tree, not a token sampled again); ``max_new_tokens`` counts them.
        ``generator``: at T > 0, the one random stream every step of this request draws from (instead of
        streams seeded per step from ``config.seed``), and the request drafts as the policy says."""
        config = config or GenerationConfig()
        prompt_ids, generated = list(prompt_ids), [int(t) for t in generated]
        self.check(prompt_ids + generated, config)  # the vocabulary and window checks cover them too
        if len(generated) > config.max_new_tokens:
            raise EagleError(f"{len(generated)} generated tokens exceed max_new_tokens ({config.max_new_tokens})")
        request = BatchRequest(prompt_ids, config, resumed=generated, generator=generator)
        with self._lock:
            self._queue.append(request)
        return request

    def cancel(self, request: BatchRequest) -> None:
        """Drop ``request`` before the next step (its row is freed then)."""
        with self._lock:
            self._cancelled.add(request.id)

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self.rows and not self._queue

    # ---- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, on_admit: Callable[[], None] | None = None) -> list[tuple[BatchRequest, StepOutput]]:
        """Admit queued requests, advance every live request by one target forward, retire finished ones.
        Returns the outputs of this step (prefill outputs of admitted requests included).

        ``on_admit``: called after each admitted request's prefill, before the next one's, so a server can
        hand that request its first token while the rest of a wave of arrivals is still being prefilled
        (their outputs are already in ``request.outputs``)."""
        self._drop_cancelled()
        events = self.admit(on_admit)
        if not self.rows:
            return events
        try:
            events.extend(self._advance())
        except Exception as err:  # the batch's state is unknown after a failed forward: fail its requests
            logger.exception("batch step failed; failing its %d requests", len(self.rows))
            for row in self.rows:
                self._fail(row.request, err)
            self.rows.clear()
        self._retire()
        return events

    @torch.inference_mode()
    def admit(self, on_admit: Callable[[], None] | None = None) -> list[tuple[BatchRequest, StepOutput]]:
        """Prefill queued requests into free rows (up to ``max_batch``) and retire those already finished;
        returns their first tokens. ``step`` does this before each step."""
        events: list[tuple[BatchRequest, StepOutput]] = []
        while len(self.rows) < self.max_batch:
            with self._lock:
                if not self._queue:
                    break
                request = self._queue.popleft()
            started = time.perf_counter()
            request.queue_s = started - request.submitted_at
            try:
                output = self._admit(request)
            except Exception as err:  # noqa: BLE001 - a request that cannot start fails alone
                self._fail(request, err)
                output = None
            finally:
                request.prefill_s = time.perf_counter() - started
            if output is not None:
                events.append((request, output))
                request.outputs.append(output)
            if on_admit is not None:
                on_admit()
        self._retire()
        return events

    @torch.inference_mode()
    def draft(self) -> list[DraftTree]:
        """The tree each live row would verify at its next speculative step (the head caught up first);
        nothing is verified or committed. For inspection: tests, and what a tree drafts."""
        self._catch_up()
        return self._draft(self.rows)

    def run_until_done(self) -> None:
        """Step until nothing is queued or live (tests, offline batches)."""
        while not self.idle:
            self.step()

    # ---- internals ----------------------------------------------------------------------------------

    def _generator(self, request: BatchRequest, position: int) -> torch.Generator | None:
        if request.config.sampling.greedy:
            return None
        if request.generator is not None:
            return request.generator
        generator = torch.Generator(device=self.target.device)
        seed = request.config.seed
        # unseeded: a fresh stream drawn from torch's global generator (``torch.manual_seed`` repeats a run)
        generator.manual_seed(step_seed(seed, position) if seed is not None else int(torch.randint(1 << 62, ())))
        return generator

    def _reseed(self, row: _Row) -> None:
        if row.generator is not None and row.request.config.seed is not None and row.request.generator is None:
            row.generator.manual_seed(step_seed(row.request.config.seed, len(row.context)))

    def _admit(self, request: BatchRequest) -> StepOutput | None:
        """Prefill ``request`` into the next free row; its first token (None for a resumed request, whose
        next token comes from the next step)."""
        index = len(self.rows)
        device = self.target.device
        resumed = request.resumed
        prompt = request.prompt_ids + resumed[:-1]  # a resumed request's last token is the next root
        ids = torch.tensor(prompt, device=device)
        features, head_input = self.runtime.prefill(ids, self.cache.row(index))  # [n, hidden], [n, head input]
        sampling = request.config.sampling
        generator = self._generator(request, len(prompt))
        if resumed:
            root = resumed[-1]
        else:
            last = features[-1:]
            logits = self.runtime.model.lm_head(last)
            if sampling.greedy:
                root = int(self.runtime.model.greedy(last, logits)[0])
            else:
                root = sample_token(processed_probs(logits[0].float(), sampling), generator)
        row = _Row(request, self.decoder.stop_ids(request.config), generator, len(prompt), root, prompt + [root], TextDelta(self.target))
        if self.heads is not None:
            # the head's prefill waits for the row's first speculative step (``_catch_up``): while the
            # policy decodes plainly a request can finish without ever running the head
            row.pending_features.append(head_input)
            row.pending_tokens.extend(prompt[1:] + [root])
        self.rows.append(row)
        request.token_ids.extend(resumed or [root])
        output = None
        if resumed:
            # the text of the resumed tokens was sent before: prime the detokeniser with them (their text is
            # dropped), so later deltas are what the uninterrupted run would have sent (a character split
            # across the seam, a merge with the token before)
            row.text.push(resumed)
        else:
            output = StepOutput([root], row.text.push([root]), None)
        if root in row.stop_ids or len(request.token_ids) >= request.config.max_new_tokens:
            self._finish(row, "stop" if root in row.stop_ids else "length")
        return output

    def _advance(self) -> list[tuple[BatchRequest, StepOutput]]:
        rows = self.rows
        batch = len(rows)
        started = time.perf_counter()
        decision = self.policy.choose(batch) if self.heads is not None else "plain"
        speculative = decision != "plain"
        for row in rows:
            self._reseed(row)
        backlog_s = 0.0
        if speculative:
            backlog_s = self._catch_up()
            trees = [self._root_only(row) if _seeded_sampling(row.request) else tree for row, tree in zip(rows, self._draft(rows))]
        else:
            trees = [self._root_only(row) for row in rows]
        drafted = time.perf_counter()
        results = self._verify(trees)
        verified = time.perf_counter()
        if self.trace is not None:
            self.trace(trees, [keep for keep, _, _ in results])
        self.steps += 1
        events = []
        accepted_total = 0
        for row, tree, (keep, kept_features, new_tokens) in zip(rows, trees, results):
            request = row.request
            row.committed += len(keep)
            row.root = new_tokens[-1]
            row.context.extend(new_tokens)
            if self.heads is not None:
                row.pending_features.append(kept_features)
                row.pending_tokens.extend(new_tokens)
            config = request.config
            out = truncate(new_tokens, config.max_new_tokens - len(request.token_ids), row.stop_ids)
            request.token_ids.extend(out)
            accepted_total += len(new_tokens)
            stats = StepStats(len(new_tokens) - 1, len(tree) - 1, (drafted - started) / batch, (verified - drafted) / batch,
                              batch=batch, policy=decision)
            request.steps.append(stats)
            output = StepOutput(out, row.text.push(out), stats)
            events.append((request, output))
            request.outputs.append(output)
            if out and out[-1] in row.stop_ids:
                self._finish(row, "stop")
            elif len(out) < len(new_tokens) or len(request.token_ids) >= config.max_new_tokens:
                self._finish(row, "length")
        drafting_rows = sum(1 for tree in trees if len(tree) > 1)
        if drafting_rows:
            self.policy.observe((accepted_total - (batch - drafting_rows)) / drafting_rows)
        self.policy.observe_step(batch, speculative, (time.perf_counter() - started - backlog_s) * 1e3)
        return events

    def _catch_up(self) -> float:
        """The head consumes every row's pending (feature, next token) pairs: first each row with more of
        them than the compiled catch-up width takes (a newly admitted prompt, many plain steps) on its own,
        eagerly; then the rest in one batched forward. Returns the seconds the first part took: a backlog
        paid once, not a cost of every speculative step (the policy leaves it out of the step times)."""
        width = self.decoder._widths()["advance"][0]
        rows = self.rows
        started = time.perf_counter()
        for index, row in enumerate(rows):
            if row.pending > width:
                features = torch.cat(row.pending_features)
                tokens = torch.tensor(row.pending_tokens, device=self.target.device)
                row.last_hidden = self.heads.prefill(features, tokens, self.head_cache.row(index), start=row.head_committed)[-1]
                self._consumed(row)
        backlog_s = time.perf_counter() - started
        if not any(row.pending for row in rows):
            return backlog_s
        device = self.target.device
        batch = len(rows)
        features = torch.zeros(batch, width, self.heads.lean.input_size, dtype=next(r for r in rows if r.pending).pending_features[0].dtype, device=device)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        counts = torch.tensor([row.pending for row in rows], device=device)
        for b, row in enumerate(rows):
            if row.pending:
                features[b, : row.pending] = torch.cat(row.pending_features)
                tokens[b, : row.pending] = torch.tensor(row.pending_tokens, device=device)
        prefix = torch.tensor([row.head_committed for row in rows], device=device)
        offsets = torch.arange(width, device=device)
        positions = prefix[:, None] + torch.minimum(offsets[None], (counts - 1).clamp(min=0)[:, None])
        slots = prefix[:, None] + offsets[None]
        real = offsets[None] < counts[:, None]  # [B, W]
        local = causal_allowed(width, 0, device)[None] & real[:, None, :] & real[:, :, None]
        local = local | torch.eye(width, dtype=torch.bool, device=device)[None]
        mask = rows_mask(prefix, real, local, int(prefix.max()) + width)[:, None]
        if self._single(batch):
            view = self.head_cache.row(0)
            hidden = self.heads.advance(width)(features, tokens, positions, slots[0], mask, view.keys, view.values)
        else:
            hidden = self.heads.rows_lean(features, tokens, positions, slots, mask, self.head_cache.keys, self.head_cache.values)
        for b, row in enumerate(rows):
            if row.pending:
                row.last_hidden = hidden[b, row.pending - 1]
                self._consumed(row)
        return backlog_s

    @staticmethod
    def _consumed(row: _Row) -> None:
        row.head_committed += row.pending
        row.pending_features.clear()
        row.pending_tokens.clear()

    def _root_only(self, row: _Row) -> DraftTree:
        return root_only(torch.tensor([row.root], device=self.target.device))

    def _draft(self, rows: list[_Row]) -> list[DraftTree]:
        device = self.target.device
        roots = torch.tensor([row.root for row in rows], device=device)
        prefix = torch.tensor([row.committed for row in rows], device=device)
        hidden = torch.stack([row.last_hidden for row in rows])
        return self._draft_rows(hidden, roots, prefix, [row.context for row in rows])

    def _draft_rows(self, hidden: torch.Tensor, roots: torch.Tensor, prefix: torch.Tensor, contexts: list[list[int]]) -> list[DraftTree]:
        tree = self.tree
        base = base_tree(tree)
        batch = roots.numel()
        if self._single(batch):  # the compiled single-row draft step on row 0
            view, lean = self.head_cache.row(0), self.heads.lean

            def expand(features, tokens, positions, slots, mask, k):
                out = self.heads.expand(base.expand_width)(features, tokens, positions, slots[0], mask, view.keys, view.values, k)
                return tuple(t[None] for t in out)
        else:
            lean = self.heads.rows_lean

            def expand(features, tokens, positions, slots, mask, k):
                return lean.expand_rows(features, tokens, positions, slots, mask, self.head_cache.keys, self.head_cache.values, k)
        trees = draft_trees(lean, expand, hidden, roots, prefix, base)
        if isinstance(tree, HybridTree):
            from eagle.ngram import add_branch

            trees = [add_branch(drafted, context, tree, width=1 + base.size) for drafted, context in zip(trees, contexts)]
        return trees

    def _verify(self, trees: list[DraftTree]) -> list[tuple[list[int], torch.Tensor, list[int]]]:
        """One target forward over every row's tree; per row (kept nodes incl. root, their features, new tokens)."""
        device = self.target.device
        rows = self.rows
        batch = len(rows)
        sizes = [len(tree) for tree in trees]
        width = self._verify_width(max(sizes) > 1)  # a tree (hybrid branch included) fits the tree's width
        ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        depths = torch.zeros(batch, width, dtype=torch.long, device=device)
        ancestry = torch.eye(width, dtype=torch.bool, device=device).repeat(batch, 1, 1)
        real = torch.zeros(batch, width, dtype=torch.bool, device=device)
        for b, tree in enumerate(trees):
            n = sizes[b]
            ids[b, :n] = tree.tokens
            depths[b, :n] = tree.depths
            ancestry[b, :n, :n] = tree.ancestors
            real[b, :n] = True
        start = torch.tensor([row.committed for row in rows], device=device)
        positions = start[:, None] + depths
        slots = start[:, None] + torch.arange(width, device=device)[None]
        mask = rows_mask(start, real, ancestry, int(start.max()) + width)[:, None]
        features, logits, greedy = self._target_rows(ids, positions, slots, mask)
        results, moves = [], []
        for b, (row, tree) in enumerate(zip(rows, trees)):
            sampling = row.request.config.sampling
            n = sizes[b]
            if sampling.greedy:
                acceptance = greedy_verify(tree, greedy[b, :n])
            else:
                acceptance = sample_verify(tree, ProcessedRows(logits[b], sampling), row.generator)
            keep = [0] + acceptance.path
            if acceptance.path:
                moves.append((b, row.committed, [node + row.committed for node in keep]))
            tokens = tree.host[0]
            new_tokens = [tokens[node] for node in acceptance.path] + [acceptance.bonus_token]
            results.append((keep, features[b, keep], new_tokens))
        if moves:
            self._compact(moves)
        return results

    def _compact(self, moves: list[tuple[int, int, list[int]]]) -> None:
        device = self.target.device
        length = max(len(source) for _, _, source in moves)
        source = torch.tensor([s + [s[-1]] * (length - len(s)) for _, _, s in moves], device=device)
        self.cache.compact_rows(
            torch.tensor([b for b, _, _ in moves], device=device), torch.tensor([k for _, k, _ in moves], device=device),
            source, torch.tensor([len(s) for _, _, s in moves], device=device),
        )

    def _finish(self, row: _Row, reason: str) -> None:
        row.request.finish_reason = reason
        row.request.done = True

    def _fail(self, request: BatchRequest, err: BaseException) -> None:
        request.error = err
        request.finish_reason = "error"
        request.done = True

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                kept = deque(r for r in self._queue if r.id not in cancelled)
                for r in self._queue:
                    if r.id in cancelled:
                        r.done, r.finish_reason = True, "cancelled"
                self._queue = kept
        for row in self.rows:
            if row.request.id in cancelled and not row.request.done:
                self._finish(row, "cancelled")

    def _retire(self) -> None:
        """Free the rows of finished requests: the last live row moves into each freed row."""
        index = 0
        while index < len(self.rows):
            if not self.rows[index].request.done:
                index += 1
                continue
            last = len(self.rows) - 1
            if index != last:
                moving = self.rows[last]
                self._move(last, index, moving)
                self.rows[index] = moving
            self.rows.pop()

    def _move(self, source: int, target: int, row: _Row) -> None:
        end = row.committed
        for buffer in (*self.cache.keys, *self.cache.values):
            buffer[target, :, :end] = buffer[source, :, :end]
        if self.head_cache is not None:
            end = row.head_committed
            for buffer in (*self.head_cache.keys, *self.head_cache.values):
                buffer[target, :, :end] = buffer[source, :, :end]
