"""What a request asks of the decode loop and what it gets back: settings, per-step output, the result.

Owns: ``GenerationConfig`` (one request's decoding settings and their checks), ``StepStats`` /
``StepOutput`` (what each step of ``eagle.batch.BatchDecoder`` hands a request), ``GenerationResult``
(a finished single request, ``eagle.generate.Decoder.generate``), ``TextDelta`` (incremental
detokenisation) and ``truncate`` (the stop rules: ``max_new_tokens`` and stop tokens).
Does not own: the loop (``eagle.batch``) or the single-request API (``eagle.generate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from eagle.errors import EagleError
from eagle.target import Target
from eagle.verify import SamplingConfig

MAX_SEED = 2**64  # torch.Generator.manual_seed takes unsigned 64-bit seeds


@dataclass(frozen=True)
class GenerationConfig:
    """One request's decoding settings.

    Attributes:
        max_new_tokens: upper bound on generated tokens (> 0).
        sampling: temperature / top-p / top-k of the target's distribution (temperature 0 = greedy).
        stop_token_ids: tokens that end generation (included in the output); None = the target's EOS ids.
        seed: in [0, 2**64); at T > 0 each step draws from a generator seeded by (seed, the step's position)
            (``eagle.admission.step_seed``) and the request decodes without drafting, so the same seed repeats the
            same output whatever the batch and the policy; a caller's own ``torch.Generator`` drafts instead.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise EagleError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < MAX_SEED):
            raise EagleError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")


@dataclass
class StepStats:
    """One target forward: ``accepted`` draft tokens the verifier kept, so the step produced ``accepted + 1``
    tokens (counted before the request's own cut by ``max_new_tokens`` or a stop token, which is what tau
    measures). ``draft_s`` covers drafting the tree and the head consuming the accepted tokens' features;
    ``verify_s`` the target forward, acceptance and cache compaction."""

    accepted: int
    tree_size: int  # draft nodes verified (0 for plain decoding)
    draft_s: float
    verify_s: float
    batch: int = 1  # requests in the step's target forward (``eagle.batch``; their times are split evenly)
    policy: str = "draft"  # what the batch's speculation policy chose: "draft", "explore" or "plain"


@dataclass
class StepOutput:
    """What ``stream`` yields: the new tokens, the text they add, and the step's stats (None for prefill)."""

    token_ids: list[int]
    text: str
    stats: StepStats | None


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    steps: list[StepStats]
    prefill_s: float
    total_s: float
    finish_reason: str  # "stop" (a stop token) or "length"

    @property
    def tau(self) -> float:
        """Average acceptance length: tokens per target forward after prefill (paper's tau)."""
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.total_s if self.total_s > 0 else 0.0

    @property
    def draft_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def verify_s(self) -> float:
        return sum(s.verify_s for s in self.steps)


def truncate(tokens: list[int], budget: int, stop_ids: set[int]) -> list[int]:
    """The first ``budget`` of ``tokens``, cut after the first stop token."""
    out = tokens[:budget]
    for i, token in enumerate(out):
        if token in stop_ids:
            return out[: i + 1]
    return out


class TextDelta:
    """Incremental detokenisation (as vLLM's ``detokenize_incrementally``): each push decodes only a short
    window — the tokens since the last emitted boundary plus the new ones — instead of the whole output, and
    holds text back while it ends in an incomplete character (U+FFFD). Decoding from the previous boundary
    (not from the new tokens alone) keeps tokenizer context such as a leading space's merge right."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.ids: list[int] = []
        self.prefix = 0  # window start: text of ids[prefix:read] has been emitted
        self.read = 0

    def push(self, ids: list[int]) -> str:
        if self.target.tokenizer is None:
            return ""
        self.ids.extend(ids)
        before = self.target.decode(self.ids[self.prefix : self.read])
        text = self.target.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]
