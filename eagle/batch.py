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

Admission (the queue, the prefill, seeding) is ``eagle.admission``; the policy's measured costs
``eagle.step_costs``.

Owns: ``BatchDecoder`` (the step: catch-up, drafting, verification, acceptance, compaction; its rows and
caches), ``check_graphs``. Does not own: admission and seeding (``eagle.admission``), the policy's rule
(``eagle.policy``) and its measured costs (``eagle.step_costs``), the decoder's functions, tree, widths and
request checks (``generate.Decoder``), the request and output types (``eagle.request``), HTTP or threads
(``serve.pair`` drives ``step``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

from eagle.admission import BatchRequest, RequestQueue, Row, prefill, reseed, seeded_sampling
from eagle.errors import ContextLengthError, EagleError
from eagle.policy import SpeculationPolicy, check_speculate
from eagle.request import GenerationConfig, StepOutput, StepStats, truncate
from eagle.step_costs import measure_policy, synthetic_verify
from eagle.tree import DraftTree, HybridTree, base_tree, causal_allowed, draft_trees, root_only, rows_mask
from eagle.verify import ProcessedRows, greedy_verify, sample_verify

if TYPE_CHECKING:
    from eagle.generate import Decoder

logger = logging.getLogger(__name__)

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
        self.rows: list[Row] = []
        self.queue = RequestQueue()
        self.speculate = check_speculate(speculate or decoder.speculate) if self.heads is not None else "never"
        # unmeasured (break-even 1) until ``warmup``: drafts every step
        self.policy = policy or SpeculationPolicy({1: 1.0}, {1: 1.0}, mode=self.speculate)
        self.steps = 0
        # called after each step's verification with every row's tree and kept nodes (the root included):
        # what ``eagle.autotree`` calibrates from
        self.trace: Callable[[list[DraftTree], list[list[int]]], None] | None = None

    # ---- widths and warm-up -----------------------------------------------------------------------

    @staticmethod
    def single(batch: int) -> bool:
        """Whether a step of ``batch`` rows runs the single-request functions on row 0 (compiled under
        ``compile="on"``, the lean modules eagerly otherwise): a batch of one."""
        return batch == 1

    def verify_width(self, speculative: bool) -> int:
        """The tokens a row verifies in a step: the tree's widest (a drafting step) or one (a plain step)."""
        return max(self.decoder._widths()["verify"]) if speculative else 1

    @torch.inference_mode()
    def warmup(self, *, measure: bool = True, sizes: Sequence[int] | None = None, repeats: int = 3) -> dict:
        """Run (compile) every batched function once, then measure the policy's costs at a few batch sizes
        (``sizes``; default 1, 2, 4, ... up to ``max_batch``; ``eagle.step_costs.measure_policy``); returns
        the policy report."""
        self.decoder.warmup(measure=False)  # resolves an auto tree; compiles the single-request graphs a batch of one runs
        for batch in self.graphs:  # compiled here, not in a request's step
            synthetic_verify(self, batch, 1)
        self.policy = self.measure(sizes=sizes, repeats=repeats if measure else 1)
        report = self.policy.report()
        logger.info("batch policy: %s", report)
        return report

    def measure(self, *, sizes: Sequence[int] | None = None, repeats: int = 3) -> SpeculationPolicy:
        """A ``SpeculationPolicy`` over this loop's measured plain and speculative step costs at ``sizes``
        (``eagle.step_costs.measure_policy``)."""
        return measure_policy(self, sizes, repeats)

    def _graph(self, batch: int, width: int) -> int | None:
        """The compiled batch size a plain step of ``batch`` rows pads to, or None (eager)."""
        if width != 1 or self.single(batch):
            return None
        return next((size for size in self.graphs if size >= batch), None)

    def target_rows(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One target forward over rows ``0..B-1`` of the cache (``ids`` ``[B, q]``, ``slots`` ``[B, q]``, ``mask``
        ``[B, 1, q, kv]``): (head input ``[B, q, ..]``, logits ``[B, q, V]``, greedy ``[B, q]``). A batch of one
        runs the single-request graph, a plain step of a size in ``graphs`` (padded up) its graph, the rest
        the eager batched step."""
        batch, width = ids.shape
        if self.single(batch):
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
        self.queue.push(request)
        return request

    def cancel(self, request: BatchRequest) -> None:
        """Drop ``request`` before the next step (its row is freed then)."""
        self.queue.cancel(request)

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def idle(self) -> bool:
        return not self.rows and self.queue.empty()

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
                row.request.fail(err)
            self.rows.clear()
        self._retire()
        return events

    @torch.inference_mode()
    def admit(self, on_admit: Callable[[], None] | None = None) -> list[tuple[BatchRequest, StepOutput]]:
        """Prefill queued requests into free rows (up to ``max_batch``) and retire those already finished;
        returns their first tokens. ``step`` does this before each step."""
        events: list[tuple[BatchRequest, StepOutput]] = []
        while len(self.rows) < self.max_batch:
            request = self.queue.pop()
            if request is None:
                break
            started = time.perf_counter()
            request.queue_s = started - request.submitted_at
            try:
                row, output = prefill(self.decoder, request, self.cache.row(len(self.rows)), self.heads is not None)
                self.rows.append(row)
            except Exception as err:  # noqa: BLE001 - a request that cannot start fails alone
                request.fail(err)
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

    def _advance(self) -> list[tuple[BatchRequest, StepOutput]]:
        rows = self.rows
        batch = len(rows)
        started = time.perf_counter()
        decision = self.policy.choose(batch) if self.heads is not None else "plain"
        speculative = decision != "plain"
        for row in rows:
            reseed(row)
        backlog_s = 0.0
        if speculative:
            backlog_s = self._catch_up()
            trees = [self._root_only(row) if seeded_sampling(row.request) else tree for row, tree in zip(rows, self._draft(rows))]
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
                request.finish("stop")
            elif len(out) < len(new_tokens) or len(request.token_ids) >= config.max_new_tokens:
                request.finish("length")
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
                row.consumed()
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
        if self.single(batch):
            view = self.head_cache.row(0)
            hidden = self.heads.advance(width)(features, tokens, positions, slots[0], mask, view.keys, view.values)
        else:
            hidden = self.heads.rows_lean(features, tokens, positions, slots, mask, self.head_cache.keys, self.head_cache.values)
        for b, row in enumerate(rows):
            if row.pending:
                row.last_hidden = hidden[b, row.pending - 1]
                row.consumed()
        return backlog_s

    def _root_only(self, row: Row) -> DraftTree:
        return root_only(torch.tensor([row.root], device=self.target.device))

    def _draft(self, rows: list[Row]) -> list[DraftTree]:
        device = self.target.device
        roots = torch.tensor([row.root for row in rows], device=device)
        prefix = torch.tensor([row.committed for row in rows], device=device)
        hidden = torch.stack([row.last_hidden for row in rows])
        return self.draft_rows(hidden, roots, prefix, [row.context for row in rows])

    def draft_rows(self, hidden: torch.Tensor, roots: torch.Tensor, prefix: torch.Tensor, contexts: list[list[int]]) -> list[DraftTree]:
        """Every row's tree below ``roots`` from the head's last outputs ``hidden`` (``eagle.tree.draft_trees``:
        one head call per depth for all rows; a batch of one runs the compiled single-row draft step on row
        0), each row's n-gram branch added for a hybrid tree (``contexts``: the rows' tokens so far)."""
        tree = self.tree
        base = base_tree(tree)
        batch = roots.numel()
        if self.single(batch):  # the compiled single-row draft step on row 0
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
        width = self.verify_width(max(sizes) > 1)  # a tree (hybrid branch included) fits the tree's width
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
        features, logits, greedy = self.target_rows(ids, positions, slots, mask)
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

    def _drop_cancelled(self) -> None:
        cancelled = self.queue.take_cancelled()
        for row in self.rows:
            if row.request.id in cancelled and not row.request.done:
                row.request.finish("cancelled")

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

    def _move(self, source: int, target: int, row: Row) -> None:
        end = row.committed
        for buffer in (*self.cache.keys, *self.cache.values):
            buffer[target, :, :end] = buffer[source, :, :end]
        if self.head_cache is not None:
            end = row.head_committed
            for buffer in (*self.head_cache.keys, *self.head_cache.values):
                buffer[target, :, :end] = buffer[source, :, :end]
