"""Admission to the decode loop: the waiting requests, their randomness, and the prefill that gives one a row.

A request is submitted from any thread (``RequestQueue``: a lock, a queue, the cancelled ids) and joins the
batch between steps: ``prefill`` runs the target over its prompt into a free row of the batch's KV cache
and picks its first token (the root of its first tree). The head does not run here: the prompt's (feature,
next token) pairs wait in the row until its first speculative step (``eagle.batch.BatchDecoder._catch_up``),
so a request the policy never drafts for never runs the head.

Seeding: a request with a ``seed`` draws each step's randomness from a generator seeded with (seed, the
absolute position of the step's first new token) (``step_seed``), and at T > 0 it decodes without
drafting (``seeded_sampling``), so its output is a function of the prompt, the settings, the seed and the
tokens so far, whatever the batch and the policy, and a request resumed from the tokens already sent
continues as the uninterrupted run would (``serve`` failover). Unseeded sampling draws from streams seeded
by torch's global generator; a request given its own generator draws every step from it.

Owns: ``BatchRequest``, ``Row``, ``RequestQueue``, ``prefill``, ``step_seed``, ``seeded_sampling``, ``generator_for``,
``reseed``. Does not own: the step (``eagle.batch``), the request checks (``generate.Decoder``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from eagle.request import GenerationConfig, StepOutput, StepStats, TextDelta
from eagle.verify import processed_probs, sample_token

if TYPE_CHECKING:
    from eagle.generate import Decoder
    from eagle.model import KVCache

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment (splitmix64): spreads (seed, position) pairs


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

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.done = True

    def fail(self, err: BaseException) -> None:
        self.error = err
        self.finish("error")


@dataclass
class Row:
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

    def consumed(self) -> None:
        """The head has consumed every pending pair."""
        self.head_committed += self.pending
        self.pending_features.clear()
        self.pending_tokens.clear()


def seeded_sampling(request: BatchRequest) -> bool:
    """A seeded request at T > 0 never drafts: speculative sampling draws a different (equally distributed)
    sample than plain sampling from the same random stream, so a seeded row that drafted in some steps
    and not in others (the policy follows the batch and the measured costs) would not repeat its output.
    A request given its own generator drafts: its caller asked for one stream, not for a repeatable output."""
    return request.config.seed is not None and request.generator is None and not request.config.sampling.greedy


def generator_for(request: BatchRequest, position: int, device: torch.device) -> torch.Generator | None:
    """The random stream of ``request``'s step at ``position`` (None when greedy)."""
    if request.config.sampling.greedy:
        return None
    if request.generator is not None:
        return request.generator
    generator = torch.Generator(device=device)
    seed = request.config.seed
    # unseeded: a fresh stream drawn from torch's global generator (``torch.manual_seed`` repeats a run)
    generator.manual_seed(step_seed(seed, position) if seed is not None else int(torch.randint(1 << 62, ())))
    return generator


def reseed(row: Row) -> None:
    """A seeded row's generator, seeded for the step that starts at its current position."""
    if row.generator is not None and row.request.config.seed is not None and row.request.generator is None:
        row.generator.manual_seed(step_seed(row.request.config.seed, len(row.context)))


class RequestQueue:
    """The requests waiting for a row, and the ids cancelled since the last step; safe from any thread."""

    def __init__(self) -> None:
        self._waiting: deque[BatchRequest] = deque()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()

    def push(self, request: BatchRequest) -> None:
        with self._lock:
            self._waiting.append(request)

    def pop(self) -> BatchRequest | None:
        """The longest-waiting request, or None."""
        with self._lock:
            return self._waiting.popleft() if self._waiting else None

    def cancel(self, request: BatchRequest) -> None:
        with self._lock:
            self._cancelled.add(request.id)

    def take_cancelled(self) -> set[int]:
        """The ids cancelled since the last call; waiting requests among them finish "cancelled" here."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                for request in self._waiting:
                    if request.id in cancelled:
                        request.finish("cancelled")
                self._waiting = deque(r for r in self._waiting if r.id not in cancelled)
        return cancelled

    def empty(self) -> bool:
        with self._lock:
            return not self._waiting


def prefill(decoder: Decoder, request: BatchRequest, cache: KVCache, with_head: bool) -> tuple[Row, StepOutput | None]:
    """Prefill ``request`` into ``cache`` (its row of the batch's cache): its ``Row`` and first output
    (None for a resumed request, whose next token comes from the next step). The request finishes here
    when its first token is a stop token or its budget."""
    runtime, target = decoder.runtime, decoder.target
    resumed = request.resumed
    prompt = request.prompt_ids + resumed[:-1]  # a resumed request's last token is the next root
    features, head_input = runtime.prefill(torch.tensor(prompt, device=target.device), cache)  # [n, hidden], [n, head input]
    sampling = request.config.sampling
    generator = generator_for(request, len(prompt), target.device)
    if resumed:
        root = resumed[-1]
    else:
        last = features[-1:]
        logits = runtime.model.lm_head(last)
        if sampling.greedy:
            root = int(runtime.model.greedy(last, logits)[0])
        else:
            root = sample_token(processed_probs(logits[0].float(), sampling), generator)
    row = Row(request, decoder.stop_ids(request.config), generator, len(prompt), root, prompt + [root], TextDelta(target))
    if with_head:
        # the head's prefill waits for the row's first speculative step (``BatchDecoder._catch_up``): while
        # the policy decodes plainly a request can finish without ever running the head
        row.pending_features.append(head_input)
        row.pending_tokens.extend(prompt[1:] + [root])
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
        request.finish("stop" if root in row.stop_ids else "length")
    return row, output
