"""The decode loop: prefill, draft, verify, accept, compact — and plain decoding through the same loop.

One step = one target forward. With a head, the head drafts a tree below the last chosen token (the
root), the target scores root + tree in one forward under the tree mask, the verifier accepts a path and
adds a bonus token, the target's KV cache is compacted to the accepted path (no recomputation of the
accepted prefix), and the head consumes the target's true features of the accepted tokens before drafting
again (EAGLE, arXiv 2401.15077, section 4; EAGLE-2, arXiv 2406.16858). Without a head the tree is the root
alone and a step is exactly one plain decoding step, so baselines share this code path.

Owns: ``Decoder.stream`` (per-step tokens, text deltas and stats), ``Decoder.generate``, the stop rules.
Does not own: tokenisation beyond calling the target's tokenizer, or any notion of batching or serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from eagle.errors import EagleError
from eagle.head import EagleHead
from eagle.target import Target, compact_cache
from eagle.tree import DraftTree, DynamicTree, TreeSpec, causal_mask, draft_tree, root_only
from eagle.verify import SamplingConfig, greedy_verify, processed_probs, sample_token, sample_verify

logger = logging.getLogger(__name__)

DEFAULT_TREE: TreeSpec = DynamicTree()


@dataclass(frozen=True)
class GenerationConfig:
    """One request's decoding settings.

    Attributes:
        max_new_tokens: upper bound on generated tokens (> 0).
        sampling: temperature / top-p / top-k of the target's distribution (temperature 0 = greedy).
        stop_token_ids: tokens that end generation (included in the output); None = the target's EOS ids.
        seed: seeds the explicit ``torch.Generator`` used for sampling and acceptance tests.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise EagleError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")


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


@dataclass
class _State:
    """Per-request mutable state: caches are owned by one request, never shared."""

    target_cache: object
    head_cache: object | None
    committed: int  # positions in the target cache (= head cache) that are final
    root: int  # last chosen token, not yet run through the target
    last_hidden: torch.Tensor | None  # head output at the root's position [hidden]


class Decoder:
    """EAGLE speculative decoding for one (target, head) pair; ``head=None`` is plain decoding."""

    def __init__(self, target: Target, head: EagleHead | None = None, tree: TreeSpec | None = None) -> None:
        self.target = target
        self.head = head
        self.tree = tree or DEFAULT_TREE

    # ---- phases -----------------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig, generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return sample_token(processed_probs(logits, sampling), generator)

    @torch.inference_mode()
    def _prefill(self, prompt_ids: list[int], sampling: SamplingConfig, generator) -> _State:
        device = self.target.device
        ids = torch.tensor([prompt_ids], device=device)  # [1, n]
        cache = self.target.new_cache()
        features = self.target.forward(ids, cache)  # [1, n, hidden]
        root = self._choose(self.target.logits(features[0, -1]), sampling, generator)
        state = _State(cache, None, len(prompt_ids), root, None)
        if self.head is not None:
            state.head_cache = self.head.new_cache()
            next_tokens = torch.cat([ids[:, 1:], torch.tensor([[root]], device=device)], dim=1)  # x_{j+1}
            positions = torch.arange(len(prompt_ids), device=device).unsqueeze(0)
            hidden = self.head(features, next_tokens, state.head_cache, positions, causal_mask(len(prompt_ids), 0, features.dtype, device))
            state.last_hidden = hidden[0, -1]
        return state

    @torch.inference_mode()
    def _draft(self, state: _State) -> DraftTree:
        if self.head is None:
            return root_only(state.root, self.target.device)
        return draft_tree(self.head, state.head_cache, state.last_hidden, state.root, state.committed, self.tree)

    @torch.inference_mode()
    def _verify(self, state: _State, tree: DraftTree, sampling: SamplingConfig, generator) -> tuple[list[int], torch.Tensor, list[int]]:
        """Target forward over root + tree; returns (kept tree nodes incl. root, their features, new tokens)."""
        device = self.target.device
        mask = tree.attention_mask(state.committed, self.target.dtype, device) if len(tree) > 1 else None
        features = self.target.forward(
            tree.tokens.unsqueeze(0), state.target_cache, tree.position_ids(state.committed), mask
        )  # [1, N, hidden]
        logits = self.target.logits(features[0])  # [N, V]
        if sampling.greedy:
            acceptance = greedy_verify(tree, logits)
        else:
            acceptance = sample_verify(tree, processed_probs(logits, sampling), generator)
        keep = [0] + acceptance.path
        if len(tree) > 1:
            compact_cache(state.target_cache, state.committed, torch.tensor(keep, device=device) + state.committed)
        tokens = tree.tokens.tolist()
        new_tokens = [tokens[n] for n in acceptance.path] + [acceptance.bonus_token]
        return keep, features[0, keep], new_tokens

    @torch.inference_mode()
    def _advance_head(self, state: _State, start: int, kept_features: torch.Tensor, new_tokens: list[int]) -> None:
        """Feed the head the target's features of the kept tokens (from position ``start``) paired with the
        token after each: (f(root), a_1), (f(a_1), a_2), ..., (f(a_k), bonus)."""
        device = self.target.device
        q = len(new_tokens)
        positions = torch.arange(start, start + q, device=device).unsqueeze(0)
        hidden = self.head(
            kept_features.unsqueeze(0),
            torch.tensor([new_tokens], device=device),
            state.head_cache,
            positions,
            causal_mask(q, start, kept_features.dtype, device),
        )
        state.last_hidden = hidden[0, -1]

    # ---- public API -------------------------------------------------------------------------------

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[StepOutput]:
        """Yield the prefill's token, then each step's accepted tokens + bonus token, with text deltas."""
        config = config or GenerationConfig()
        prompt_ids = list(prompt_ids)
        self._check_request(prompt_ids, config)
        if generator is None and config.seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(config.seed)
        stop_ids = self._stop_ids(config)
        text = _TextDelta(self.target)

        state = self._prefill(prompt_ids, config.sampling, generator)
        emitted = [state.root]
        yield StepOutput([state.root], text.push([state.root]), None)
        if state.root in stop_ids:
            return
        while len(emitted) < config.max_new_tokens:
            started = time.perf_counter()
            tree = self._draft(state)
            drafted = time.perf_counter()
            keep, kept_features, new_tokens = self._verify(state, tree, config.sampling, generator)
            verified = time.perf_counter()
            start = state.committed
            state.committed += len(keep)
            state.root = new_tokens[-1]
            out = _truncate(new_tokens, config.max_new_tokens - len(emitted), stop_ids)
            emitted.extend(out)
            done = len(out) < len(new_tokens) or len(emitted) >= config.max_new_tokens or out[-1] in stop_ids
            head_s = 0.0
            if self.head is not None and not done:
                self._advance_head(state, start, kept_features, new_tokens)
                head_s = time.perf_counter() - verified
            stats = StepStats(len(new_tokens) - 1, len(tree) - 1, drafted - started + head_s, verified - drafted)
            yield StepOutput(out, text.push(out), stats)
            if done:
                return

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> GenerationResult:
        config = config or GenerationConfig()
        started = time.perf_counter()
        token_ids: list[int] = []
        steps: list[StepStats] = []
        prefill_s = 0.0
        for output in self.stream(prompt_ids, config, generator):
            token_ids.extend(output.token_ids)
            if output.stats is None:
                prefill_s = time.perf_counter() - started
            else:
                steps.append(output.stats)
        total_s = time.perf_counter() - started
        finish = "stop" if token_ids and token_ids[-1] in self._stop_ids(config) else "length"
        text = self.target.decode(token_ids) if self.target.tokenizer is not None else ""
        return GenerationResult(list(prompt_ids), token_ids, text, steps, prefill_s, total_s, finish)

    def _stop_ids(self, config: GenerationConfig) -> set[int]:
        return set(self.target.eos_token_ids if config.stop_token_ids is None else config.stop_token_ids)

    def _check_request(self, prompt_ids: list[int], config: GenerationConfig) -> None:
        if not prompt_ids:
            raise EagleError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.target.vocab_size:
            raise EagleError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        tree_size = self.tree.size if self.head is not None else 0
        needed = len(prompt_ids) + config.max_new_tokens + tree_size + 1
        if needed > self.target.max_positions:
            raise EagleError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceed the target's "
                f"context window of {self.target.max_positions} tokens"
            )


def _truncate(tokens: list[int], budget: int, stop_ids: set[int]) -> list[int]:
    out = tokens[:budget]
    for i, token in enumerate(out):
        if token in stop_ids:
            return out[: i + 1]
    return out


class _TextDelta:
    """Incremental detokenisation: yields only complete characters (holds back a trailing U+FFFD)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: list[int]) -> str:
        if self.target.tokenizer is None:
            return ""
        self.ids.extend(ids)
        text = self.target.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
