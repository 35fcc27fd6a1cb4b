"""When a decode step drafts: a measured cost model and the acceptance seen so far.

``SpeculationPolicy`` is the one rule every step of ``eagle.batch.BatchDecoder`` follows, at batch 1 as at
batch N (``eagle.generate.Decoder`` runs a batch of one): draft when the expected tokens of a speculative
step outweigh its measured cost against a plain step's, otherwise decode plainly and explore now and then.

Owns: ``SpeculationPolicy``, ``SPECULATE_MODES`` and their check (``check_speculate``). Does not own:
measuring the costs (``eagle.step_costs``) or the step itself (``eagle.batch``).
"""

from __future__ import annotations

import sys

from eagle.errors import EagleError

SPECULATE_MODES = ("auto", "always", "never")


def check_speculate(mode: str) -> str:
    """``mode`` if it is one of ``SPECULATE_MODES``, else an ``EagleError``: the one check of the setting."""
    if mode not in SPECULATE_MODES:
        raise EagleError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, got {mode!r}")
    return mode


class SpeculationPolicy:
    """Whether a batch drafts this step, from a measured cost model (not a constant).

    Costs: ``plain_ms[B]`` (one plain batched step) and ``speculative_ms[B]`` (catch-up + drafting +
    verification of the tree) measured at start-up for a few batch sizes and interpolated between them.
    A speculative step pays off when the expected tokens per row and step (``tau``) exceed the break-even
    ``speculative_ms[B] / plain_ms[B]``; ``tau`` starts at ``prior_tau`` and follows what speculative steps
    accept (an exponential moving average). While plain decoding wins, a step drafts anyway now and then so
    that a better-matching workload (say, repetitive text) can switch speculation back on: after
    ``explore_every x (break-even - 1)`` plain steps, i.e. exploring costs about one plain step in
    ``explore_every`` whatever a speculative step costs at this batch size (every 32nd step where drafting
    costs 2x, every 128th where it costs 5x). Each exploration that leaves drafting still behind doubles the
    next interval, up to ``explore_backoff`` times the first, so a head that stays below break-even costs
    less and less (at a fixed interval the EAGLE pair ran 4-9 % behind the target alone at 4-16 clients,
    docs/benchmarks.md section 7); a step that drafts for real resets it.
    Verification becomes compute-bound as the batch grows, so the break-even rises with B: the draft
    budget shrinks to nothing at the batch sizes where plain batched decoding is faster.

    ``live``: the start-up costs are synthetic steps (the forwards alone); a real step also pays for
    acceptance, compaction, detokenising and the loop's Python, which the synthetic ones leave out (on the
    AMX Xeon about 6 ms of a 21 ms plain token, docs/benchmarks.md section 6). A live policy corrects each
    kind's cost by the ratio of the step times it observes (``observe_step``) to the modelled ones (an
    exponential moving average per kind; drafting that was never observed takes plain decoding's ratio;
    the head's catch-up over a backlog of plain steps is paid once and left out), so the break-even it
    decides by is the one the requests actually see. ``eagle.step_costs.measure_policy`` makes
    live policies; a policy built by hand (tests) keeps its given costs."""

    def __init__(self, plain_ms: dict[int, float], speculative_ms: dict[int, float], *, mode: str = "auto",
                 prior_tau: float = 2.0, smoothing: float = 0.1, explore_every: int = 32, explore_backoff: int = 8,
                 live: bool = False) -> None:
        self.plain_ms = dict(sorted(plain_ms.items()))
        self.speculative_ms = dict(sorted(speculative_ms.items()))
        self.mode = check_speculate(mode)
        self.tau = prior_tau
        self.smoothing = smoothing
        self.explore_every = explore_every
        self.explore_backoff = explore_backoff
        self._explore_scale = 1  # doubles after each exploration while drafting stays behind, up to explore_backoff
        self._since_draft = 0
        self.decisions = {"draft": 0, "plain": 0, "explore": 0}
        self.live = live
        self._ratio: dict[str, float | None] = {"plain": None, "speculative": None}  # observed / modelled step time

    @staticmethod
    def _at(costs: dict[int, float], batch: int) -> float:
        sizes = list(costs)
        if batch <= sizes[0]:
            return costs[sizes[0]]
        for low, high in zip(sizes, sizes[1:]):
            if batch <= high:
                return costs[low] + (costs[high] - costs[low]) * (batch - low) / (high - low)
        if len(sizes) == 1:
            return costs[sizes[0]] * batch / sizes[0]
        low, high = sizes[-2], sizes[-1]  # extrapolate linearly
        return costs[high] + (costs[high] - costs[low]) * (batch - high) / (high - low)

    def _ratio_of(self, kind: str) -> float:
        return self._ratio[kind] or self._ratio["plain"] or 1.0

    def break_even(self, batch: int) -> float:
        """The tau at which drafting and plain decoding produce tokens equally fast at this batch size."""
        if not self.speculative_ms or not self.plain_ms:  # nothing to draft with (the target alone)
            return float("inf")
        speculative = self._at(self.speculative_ms, batch) * self._ratio_of("speculative")
        return speculative / (self._at(self.plain_ms, batch) * self._ratio_of("plain"))

    def observe_step(self, batch: int, speculative: bool, ms: float) -> None:
        """A real step of ``batch`` rows took ``ms`` (drafting or not): a live policy corrects that kind's cost."""
        costs = self.speculative_ms if speculative else self.plain_ms
        if not self.live or not costs or ms <= 0:
            return
        kind = "speculative" if speculative else "plain"
        ratio = ms / self._at(costs, batch)
        old = self._ratio[kind]
        self._ratio[kind] = ratio if old is None else old + self.smoothing * (ratio - old)

    def explore_interval(self, batch: int) -> int:
        """Steps from one exploring step to the next while plain decoding wins at this batch size (none while
        drafting has no measured cost)."""
        extra = self.break_even(batch) - 1
        return max(1, round(self.explore_every * extra * self._explore_scale)) if extra != float("inf") else sys.maxsize

    def choose(self, batch: int) -> str:
        """``"draft"``, ``"explore"`` (drafting to measure acceptance) or ``"plain"`` for this step."""
        if self.mode != "auto":
            decision = "draft" if self.mode == "always" else "plain"
        elif self.tau >= self.break_even(batch):
            decision = "draft"
            self._explore_scale = 1
        elif self._since_draft + 1 >= self.explore_interval(batch):
            decision = "explore"
            self._explore_scale = min(self._explore_scale * 2, self.explore_backoff)  # what it sees resets it on drafting
        else:
            decision = "plain"
        self._since_draft = 0 if decision != "plain" else self._since_draft + 1
        self.decisions[decision] += 1
        return decision

    def observe(self, tokens_per_row: float) -> None:
        """A speculative step's mean tokens per row (accepted + 1)."""
        self.tau += self.smoothing * (tokens_per_row - self.tau)

    def report(self) -> dict:
        """The policy's state and decisions so far, JSON-safe (no infinities: an unmeasured cost is None)."""
        finite = lambda v: round(v, 3) if v != float("inf") else None  # noqa: E731
        return {
            "mode": self.mode, "tau_estimate": round(self.tau, 3), "decisions": dict(self.decisions),
            "explore_scale": self._explore_scale,
            "live_ratio": {kind: None if r is None else round(r, 3) for kind, r in self._ratio.items()} if self.live else None,
            "plain_ms": {b: finite(v) for b, v in self.plain_ms.items()},
            "speculative_ms": {b: finite(v) for b, v in self.speculative_ms.items()},
            "break_even_tau": {b: finite(self.break_even(b)) for b in self.plain_ms},
        }
