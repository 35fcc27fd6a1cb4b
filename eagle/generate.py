"""The single-request API over the one decode loop: a ``Decoder`` is a (target, head, tree) pair with its
compiled functions, and each request runs as a batch of one on ``eagle.batch.BatchDecoder``.

One step = one target forward. With a head, the head drafts a tree below the last chosen token (the
root), the target scores root + tree in one forward under the tree mask, the verifier accepts a path and
adds a bonus token, the target's KV cache is compacted to the accepted path (no recomputation of the
accepted prefix), and the head consumes the target's true features of the accepted tokens before drafting
again (EAGLE, arXiv 2401.15077, section 4; EAGLE-2, arXiv 2406.16858). Whether a step drafts at all is the
``SpeculationPolicy``'s call (``eagle.policy``): measured costs and the acceptance seen, the same rule at
batch 1 as at batch N. Without a head the tree is the root alone and a step is exactly one plain decoding
step, so baselines share this code path.

Owns: ``Decoder`` (its tree, widths, cache sizes, warm-up and measured policy), ``Decoder.stream`` /
``Decoder.generate``. Does not own: the step (``eagle.batch``), the request and result types
(``eagle.request``), tokenisation beyond calling the target's tokenizer, or serving.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

import torch

from eagle.batch import BatchDecoder
from eagle.compile import CompileConfig
from eagle.errors import ContextLengthError, EagleError
from eagle.head import EagleHead
from eagle.policy import SpeculationPolicy, check_speculate
from eagle.request import GenerationConfig, GenerationResult, StepOutput, StepStats, TextDelta  # noqa: F401 - the API's types
from eagle.runtime import HeadRuntime, TargetRuntime, context_limit, head_runtime, step_inputs, target_runtime
from eagle.target import Target
from eagle.tree import AutoTree, DynamicTree, HybridTree, TreeSpec, base_tree

logger = logging.getLogger(__name__)

DEFAULT_TREE: TreeSpec = DynamicTree()


class Decoder:
    """EAGLE speculative decoding for one (target, head) pair; ``head=None`` is plain decoding.

    Every request runs as a batch of one (``eagle.batch.BatchDecoder``) with KV caches sized for its prompt,
    its token budget and the tree's scratch slots. ``compile="on"`` runs the hot functions compiled
    (``eagle.compile``; ``eaglectl`` and the Serve pairs default to it, paying the compile once per process
    in ``warmup``); ``"off"``, the library default, runs the same functions eagerly.

    ``speculate`` ("auto", the default; "always"; "never"): whether steps draft. Under "auto" the
    ``policy`` decides per step from the costs ``warmup`` measured on this machine and the acceptance
    seen on this decoder's requests so far (it persists across requests); a decoder that was never warmed
    up has no measured costs and drafts every step.
    """

    def __init__(
        self,
        target: Target,
        head: EagleHead | None = None,
        tree: TreeSpec | None = None,
        *,
        compile: CompileConfig | str = "off",
        speculate: str = "auto",
    ) -> None:
        check_speculate(speculate)
        self.target = target
        self.head = head
        self.compile = compile if isinstance(compile, CompileConfig) else CompileConfig(mode=compile)
        self.tree_spec: TreeSpec = tree or DEFAULT_TREE
        self.runtime: TargetRuntime = target_runtime(target, self.compile, head.config.head_layers if head is not None else ())
        self.head_runtime: HeadRuntime | None = head_runtime(head, target, self.compile) if head is not None else None
        self._tree: TreeSpec | None = None if isinstance(base_tree(self.tree_spec), AutoTree) else self.tree_spec
        self.auto_report: dict | None = None  # what ``--tree auto`` measured and chose
        self.speculate = speculate if head is not None else "never"
        # unmeasured (break-even 1): drafts every step until ``warmup`` measures this machine's costs
        self.policy = SpeculationPolicy({1: 1.0}, {1: 1.0}, mode=self.speculate)

    # ---- the tree -----------------------------------------------------------------------------------

    @property
    def tree(self) -> TreeSpec:
        """The tree in use: the given one, or for ``AutoTree`` the one measurement chose (resolved on first
        use; ``warmup`` does it up front)."""
        if self._tree is None:
            from eagle.autotree import choose_tree

            chosen, self.auto_report = choose_tree(self, base_tree(self.tree_spec))
            self._tree = HybridTree(chosen, **_hybrid_settings(self.tree_spec)) if isinstance(self.tree_spec, HybridTree) else chosen
        return self._tree

    def _widths(self) -> dict[str, list[int]]:
        """Every width a request can run each compiled function at."""
        if self.head is None:
            return {"verify": [1], "expand": [], "advance": []}
        tree = self.tree
        base = base_tree(tree)
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

    @torch.inference_mode()
    def warmup(self, *, measure: bool = True) -> dict[str, float]:
        """Resolve an auto tree, then run every function a request can reach once at each of its widths
        (compiling it under ``compile="on"``); with ``measure``, time a plain and a speculative step of one
        request on this machine for the ``policy`` (``BatchDecoder.measure``). Returns the compile seconds
        per function."""
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
                            self.head_runtime.expand(width)(*args, base_tree(tree).top_k)
                        else:
                            self.head_runtime.advance(width)(*args)
            seconds.update(self.head_runtime.compile_seconds())
        if measure and self.head_runtime is not None:
            self.policy = BatchDecoder(self, max_batch=1, max_context=min(256, self.context_window // 2)).measure(sizes=[1])
            logger.info("speculation policy: %s", self.policy.report())
        return seconds

    # ---- public API -------------------------------------------------------------------------------

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[StepOutput]:
        """Yield the prefill's token, then each step's accepted tokens + bonus token, with text deltas.

        The request runs alone on a ``BatchDecoder`` that shares this decoder's functions and ``policy``.
        At T > 0, ``generator`` is the request's one random stream (it drafts as the policy says); without
        one, ``config.seed`` seeds each step from the position (``eagle.admission.step_seed``) and the request
        decodes plainly, so the same seed repeats the same output whatever the policy chose."""
        config = config or GenerationConfig()
        prompt_ids = list(prompt_ids)
        self._check_request(prompt_ids, config)
        tokens = len(prompt_ids) + config.max_new_tokens
        engine = BatchDecoder(self, max_batch=1, max_context=None if self.target.device.type == "cuda" else tokens,
                              policy=self.policy)
        request = engine.submit(prompt_ids, config, generator=generator)
        while not request.done:
            for _, output in engine.step():
                yield output
        if request.error is not None:
            raise request.error

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
        finish = "stop" if token_ids and token_ids[-1] in self.stop_ids(config) else "length"
        text = self.target.decode(token_ids) if self.target.tokenizer is not None else ""
        return GenerationResult(list(prompt_ids), token_ids, text, steps, prefill_s, total_s, finish)

    def stop_ids(self, config: GenerationConfig) -> set[int]:
        """The tokens that end ``config``'s request: its stop ids, else the target's EOS ids."""
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


def _hybrid_settings(tree: HybridTree) -> dict:
    return {"branch_tokens": tree.branch_tokens, "max_ngram": tree.max_ngram, "min_ngram": tree.min_ngram}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple




