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

from eagle.compile import CompileConfig
from eagle.errors import ContextLengthError, EagleError
from eagle.head import EagleHead
from eagle.model import KVCache
from eagle.runtime import HeadRuntime, TargetRuntime, context_limit, head_runtime, step_inputs, target_runtime
from eagle.target import Target
from eagle.tree import AutoTree, DraftTree, DynamicTree, HybridTree, TreeSpec, causal_allowed, draft_tree, padded_mask, root_only
from eagle.verify import ProcessedRows, SamplingConfig, greedy_verify, processed_probs, sample_token, sample_verify

logger = logging.getLogger(__name__)

DEFAULT_TREE: TreeSpec = DynamicTree()
MAX_SEED = 2**64  # torch.Generator.manual_seed takes unsigned 64-bit seeds


@dataclass(frozen=True)
class GenerationConfig:
    """One request's decoding settings.

    Attributes:
        max_new_tokens: upper bound on generated tokens (> 0).
        sampling: temperature / top-p / top-k of the target's distribution (temperature 0 = greedy).
        stop_token_ids: tokens that end generation (included in the output); None = the target's EOS ids.
        seed: seeds the explicit ``torch.Generator`` used for sampling and acceptance tests; in [0, 2**64).
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


@dataclass
class _State:
    """Per-request mutable state: caches are owned by one request, never shared."""

    target_cache: KVCache
    head_cache: KVCache | None
    committed: int  # positions in the target cache (= head cache) that are final
    root: int  # last chosen token, not yet run through the target
    last_hidden: torch.Tensor | None  # head output at the root's position [hidden]
    context: list[int] = field(default_factory=list)  # prompt + every token emitted, the root included


class Decoder:
    """EAGLE speculative decoding for one (target, head) pair; ``head=None`` is plain decoding.

    Every request owns preallocated KV caches (``eagle.model.KVCache``) for the target and the head, sized
    for its prompt, its token budget and the tree's scratch slots. ``compile="on"`` runs the hot functions
    compiled (``eagle.compile``; ``eaglectl`` and the Serve pairs default to it, paying the compile once per
    process in ``warmup``); ``"off"``, the library default, runs the same functions eagerly.
    """

    def __init__(
        self,
        target: Target,
        head: EagleHead | None = None,
        tree: TreeSpec | None = None,
        *,
        compile: CompileConfig | str = "off",
    ) -> None:
        self.target = target
        self.head = head
        self.compile = compile if isinstance(compile, CompileConfig) else CompileConfig(mode=compile)
        self.tree_spec: TreeSpec = tree or DEFAULT_TREE
        self.runtime: TargetRuntime = target_runtime(target, self.compile, head.config.head_layers if head is not None else ())
        self.head_runtime: HeadRuntime | None = head_runtime(head, target, self.compile) if head is not None else None
        self._tree: TreeSpec | None = None if isinstance(_base(self.tree_spec), AutoTree) else self.tree_spec
        self.auto_report: dict | None = None  # what ``--tree auto`` measured and chose

    # ---- the tree -----------------------------------------------------------------------------------

    @property
    def tree(self) -> TreeSpec:
        """The tree in use: the given one, or for ``AutoTree`` the one measurement chose (resolved on first
        use; ``warmup`` does it up front)."""
        if self._tree is None:
            from eagle.autotree import choose_tree

            chosen, self.auto_report = choose_tree(self, _base(self.tree_spec))
            self._tree = HybridTree(chosen, **_hybrid_settings(self.tree_spec)) if isinstance(self.tree_spec, HybridTree) else chosen
        return self._tree

    def _widths(self) -> dict[str, list[int]]:
        """Every width a request can run each compiled function at."""
        if self.head is None:
            return {"verify": [1], "expand": [], "advance": []}
        tree = self.tree
        base = _base(tree)
        verify = [1 + base.size]  # a hybrid tree's branch replaces head nodes: the same width
        deepest = base.depth
        if isinstance(tree, HybridTree):
            deepest = max(deepest, min(tree.branch_tokens, base.size))
        expand = [base.expand_width] if base.depth > 1 else []
        return {"verify": verify, "expand": expand, "advance": [deepest + 1]}

    def _scratch(self) -> int:
        """Slots a step may write past the committed length (tree verification, drafting, the catch-up)."""
        widths = self._widths()
        drafting = self.tree.depth * max(widths["expand"], default=0)
        return max(max(widths["verify"]), drafting, max(widths["advance"], default=0))

    def _capacity(self, tokens: int, scratch: int | None = None) -> int:
        """KV slots for a request of ``tokens`` committed tokens at most: those plus the ``scratch`` a step
        writes (default: this decoder's tree's), rounded up; on CUDA always the whole context window, so
        that every request has the same shapes (static graphs, CUDA graphs)."""
        scratch = self._scratch() if scratch is None else scratch
        if self.target.device.type == "cuda":
            return _round_up(self.context_window + scratch + 1, 64)
        return _round_up(tokens + scratch + 1, 64)

    # ---- phases -----------------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, greedy: torch.Tensor, sampling: SamplingConfig, generator) -> int:
        if sampling.greedy:
            return int(greedy)
        return sample_token(processed_probs(logits, sampling), generator)

    @torch.inference_mode()
    def _prefill(self, prompt_ids: list[int], sampling: SamplingConfig, generator, capacity: int | None = None) -> _State:
        device = self.target.device
        capacity = capacity or self._capacity(len(prompt_ids) + 1)
        ids = torch.tensor(prompt_ids, device=device)  # [n]
        cache = self.runtime.new_cache(capacity)
        features, head_input = self.runtime.prefill(ids, cache)  # [n, hidden], [n, head input]
        last = features[-1:]
        logits = self.runtime.model.lm_head(last)
        root = self._choose(logits[0].float(), self.runtime.model.greedy(last, logits)[0], sampling, generator)
        state = _State(cache, None, len(prompt_ids), root, None, list(prompt_ids) + [root])
        if self.head_runtime is not None:
            state.head_cache = self.head_runtime.new_cache(capacity)
            next_tokens = torch.cat([ids[1:], torch.tensor([root], device=device)])  # x_{j+1}
            state.last_hidden = self.head_runtime.prefill(head_input, next_tokens, state.head_cache)[-1]
        return state

    @torch.inference_mode()
    def _draft(self, state: _State) -> DraftTree:
        root = torch.tensor([state.root], device=self.target.device)
        if self.head_runtime is None:
            return root_only(root)
        tree = self.tree
        base = _base(tree)
        expand = self.head_runtime.expand(base.expand_width) if base.depth > 1 else None
        drafted = draft_tree(self.head_runtime.lean, expand, state.head_cache, state.last_hidden, root, state.committed, base)
        if isinstance(tree, HybridTree):
            from eagle.ngram import add_branch

            drafted = add_branch(drafted, state.context, tree, width=1 + base.size)
        return drafted

    @torch.inference_mode()
    def _verify(self, state: _State, tree: DraftTree, sampling: SamplingConfig, generator) -> tuple[list[int], torch.Tensor, list[int]]:
        """Target forward over root + tree (padded to a compiled width); returns (kept tree nodes incl. root,
        their features, new tokens)."""
        device = self.target.device
        n, start = len(tree), state.committed
        width = min(w for w in self._widths()["verify"] if w >= n)
        ids = torch.zeros(width, dtype=torch.long, device=device)
        ids[:n] = tree.tokens
        positions = torch.full((width,), start, dtype=torch.long, device=device)
        positions[:n] += tree.depths
        slots = torch.arange(start, start + width, device=device)
        mask = padded_mask(tree.ancestors, start, width)
        features, logits, greedy = self.runtime.step(width)(ids[None], positions[None], slots, mask[None, None], state.target_cache.keys, state.target_cache.values)
        if sampling.greedy:
            acceptance = greedy_verify(tree, greedy[:n])
        else:
            acceptance = sample_verify(tree, ProcessedRows(logits, sampling), generator)
        keep = [0] + acceptance.path
        if acceptance.path:
            state.target_cache.compact(start, torch.tensor(keep, device=device) + start)
        tokens = tree.host[0]
        new_tokens = [tokens[node] for node in acceptance.path] + [acceptance.bonus_token]
        return keep, features[keep], new_tokens

    @torch.inference_mode()
    def _advance_head(self, state: _State, start: int, kept_features: torch.Tensor, new_tokens: list[int]) -> None:
        """Feed the head the target's features of the kept tokens (from position ``start``) paired with the
        token after each: (f(root), a_1), (f(a_1), a_2), ..., (f(a_k), bonus)."""
        device = self.target.device
        q = len(new_tokens)
        width = self._widths()["advance"][0]
        features = torch.zeros(width, kept_features.shape[-1], dtype=kept_features.dtype, device=device)
        features[:q] = kept_features
        tokens = torch.zeros(width, dtype=torch.long, device=device)
        tokens[:q] = torch.tensor(new_tokens, device=device)
        positions = torch.full((width,), start, dtype=torch.long, device=device)
        positions[:q] = torch.arange(start, start + q, device=device)
        slots = torch.arange(start, start + width, device=device)
        ancestry = torch.eye(width, dtype=torch.bool, device=device)
        ancestry[:q, :q] = causal_allowed(q, 0, device)
        mask = padded_mask(ancestry, start, width)
        hidden = self.head_runtime.advance(width)(features[None], tokens[None], positions[None], slots, mask[None, None], state.head_cache.keys, state.head_cache.values)
        state.last_hidden = hidden[0, q - 1]

    @torch.inference_mode()
    def warmup(self) -> dict[str, float]:
        """Resolve an auto tree, then run every function a request can reach once at each of its widths
        (compiling it under ``compile="on"``); returns the compile seconds per function."""
        tree = self.tree if self.head is not None else None
        device, prefix, widths = self.target.device, 4, self._widths()
        cache = self.runtime.new_cache(self._capacity(prefix + 1))
        for width in widths["verify"]:
            self.runtime.step(width)(*step_inputs(width, prefix, device), cache.keys, cache.values)
        seconds = dict(self.runtime.compile_seconds())
        if self.head_runtime is not None and tree is not None:
            head_cache = self.head_runtime.new_cache(cache.capacity)
            dtype = self.runtime.model.lm_head.weight.dtype
            for width in widths["expand"] + widths["advance"]:
                ids, positions, slots, mask = step_inputs(width, prefix, device)
                lean = self.head_runtime.lean
                for size, name in ((lean.hidden_size, "expand"), (lean.input_size, "advance")):  # own output / target's
                    if width in widths[name]:
                        features = torch.zeros(1, width, size, dtype=dtype, device=device)
                        args = (features, ids, positions, slots, mask, head_cache.keys, head_cache.values)
                        if name == "expand":
                            self.head_runtime.expand(width)(*args, _base(tree).top_k)
                        else:
                            self.head_runtime.advance(width)(*args)
            seconds.update(self.head_runtime.compile_seconds())
        return seconds

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
        text = TextDelta(self.target)

        state = self._prefill(prompt_ids, config.sampling, generator, self._capacity(len(prompt_ids) + config.max_new_tokens))
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
            state.context.extend(new_tokens)
            out = _truncate(new_tokens, config.max_new_tokens - len(emitted), stop_ids)
            emitted.extend(out)
            done = len(out) < len(new_tokens) or len(emitted) >= config.max_new_tokens or out[-1] in stop_ids
            head_s = 0.0
            if self.head_runtime is not None and not done:
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

    @property
    def context_window(self) -> int:
        return context_limit(self.target)

    def _check_request(self, prompt_ids: list[int], config: GenerationConfig) -> None:
        if not prompt_ids:
            raise EagleError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.target.vocab_size:
            raise EagleError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        tree_size = self.tree.size if self.head is not None else 0
        needed = len(prompt_ids) + config.max_new_tokens + tree_size + 1
        if needed > self.context_window:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceed the target's "
                f"context window of {self.context_window} tokens"
            )


def _base(tree: TreeSpec) -> TreeSpec:
    return tree.base if isinstance(tree, HybridTree) else tree


def _hybrid_settings(tree: HybridTree) -> dict:
    return {"branch_tokens": tree.branch_tokens, "max_ngram": tree.max_ngram, "min_ngram": tree.min_ngram}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _truncate(tokens: list[int], budget: int, stop_ids: set[int]) -> list[int]:
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
