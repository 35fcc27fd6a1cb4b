"""Draft trees: their shape, their masks and positions, how the head drafts them, and the tree factory.

Owns: ``DraftTree`` (node 0 is the root — the last token the target already chose, whose KV entry the
target has not computed yet; every other node is a draft token), the tree attention mask and position ids
shared by the head and the target, the tree policies, and ``build_tree`` (the one place that turns
settings — CLI flags, a Serve config, a preset — into a policy):

* ``StaticTree`` — EAGLE-1's fixed tree (Li et al., arXiv 2401.15077, section 4.2), given as paths of
  child *ranks*: ``(0, 1)`` is "the 2nd most likely child of the most likely depth-1 token". The default
  is the reference's ``mc_sim_7b_63`` tree: 25 nodes, depth 5.
* ``DynamicTree`` — EAGLE-2 (Li et al., arXiv 2406.16858, section 4): at every depth, expand the
  ``top_k`` nodes with the highest cumulative draft log-probability, each proposing its ``top_k`` best
  children; after ``depth`` levels rerank every drafted node by cumulative log-probability and keep the
  ``total_tokens`` best (a child never outranks its parent, so the kept set is a tree).
* ``AutoTree`` — a ``DynamicTree`` whose depth / top-k / size the decoder picks at start-up from measured
  costs and acceptance (EAGLE-2's ``total_token=-1``; ``eagle.autotree``).
* ``HybridTree`` — any of the above plus a branch proposed by n-gram matching (``eagle.ngram``).

Drafting is vectorised over requests and nodes (``draft_trees``, batch 1 being a batch of one): per depth,
one head call over a fixed number of rows, then tensor ops choose the next rows, build their attention masks
and rerank; nothing reads a tensor back to the host until the finished trees are verified.

Does not own: accepting tokens (``verify.py``) or the decode loop (``batch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Sequence, Union

import torch

from eagle.errors import EagleError

if TYPE_CHECKING:
    from eagle.head import LeanHead

# EAGLE-1's default static tree (``mc_sim_7b_63`` in the reference repo): paths of child ranks.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip

_DEPTH_TIE_BREAK = 1e-9  # rerank key = score - this * depth: a child (score <= its parent's) never ties its parent


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree of child ranks (EAGLE-1). ``paths`` must be prefix-closed."""

    paths: tuple[tuple[int, ...], ...] = MC_SIM_7B_63

    def __post_init__(self) -> None:
        known = set(self.paths)
        for path in self.paths:
            if not path or any(r < 0 for r in path):
                raise EagleError(f"static tree path {path} is empty or has a negative rank")
            if len(path) > 1 and path[:-1] not in known:
                raise EagleError(f"static tree is not prefix-closed: {path} has no parent {path[:-1]}")

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def top_k(self) -> int:
        """Children proposed per node: one more than the largest rank."""
        return 1 + max(r for p in self.paths for r in p)

    @property
    def expand_width(self) -> int:
        """Rows per draft step: the most nodes of one depth that have children."""
        return max(sum(1 for p in self.paths if len(p) == d and self.child_ranks(p)) for d in range(1, self.depth + 1)) or 1

    def child_ranks(self, path: tuple[int, ...]) -> list[int]:
        return sorted(p[-1] for p in self.paths if len(p) == len(path) + 1 and p[:-1] == path)


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's context-aware tree.

    Attributes:
        depth: draft levels (head forwards per step after the first).
        top_k: nodes expanded per level, and children proposed per expanded node.
        total_tokens: draft tokens kept after reranking (the verification forward is 1 + this).
    """

    depth: int = 5
    top_k: int = 4
    total_tokens: int = 15  # a 16-token verification: 1.8x a 1-token step on the AMX CPU (benchmarks §6, §4)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise EagleError("dynamic tree needs depth, top_k and total_tokens >= 1")
        if self.total_tokens > self.top_k + (self.depth - 1) * self.top_k**2:
            raise EagleError(
                f"dynamic tree of depth {self.depth} and top-k {self.top_k} drafts at most "
                f"{self.top_k + (self.depth - 1) * self.top_k ** 2} tokens, fewer than total_tokens={self.total_tokens}"
            )

    @property
    def size(self) -> int:
        return self.total_tokens

    @property
    def expand_width(self) -> int:
        return self.top_k


@dataclass(frozen=True)
class AutoTree:
    """A ``DynamicTree`` chosen at start-up by measurement (``eagle.autotree.choose_tree``) within these
    bounds; ``Decoder`` replaces it by the chosen tree before the first request."""

    max_depth: int = 6
    top_ks: tuple[int, ...] = (2, 3, 4)
    sizes: tuple[int, ...] = (7, 15, 23, 31)  # verification widths 8, 16, 24, 32: one compiled graph each

    def __post_init__(self) -> None:
        if self.max_depth < 1 or not self.top_ks or not self.sizes or min(self.top_ks) < 1 or min(self.sizes) < 1:
            raise EagleError("auto tree needs max_depth >= 1 and non-empty top_ks / sizes >= 1")

    @property
    def depth(self) -> int:
        return self.max_depth

    @property
    def size(self) -> int:
        return max(self.sizes)


@dataclass(frozen=True)
class HybridTree:
    """``base`` plus one branch below the root copied from the context (prompt and output so far) after the
    longest earlier match of its last ``max_ngram`` .. ``min_ngram`` tokens (prompt lookup, Saxena 2023),
    verified in the same forward (``eagle.ngram``). ``branch_tokens`` bounds the branch's length; its new
    nodes replace the base tree's lowest-scored ones, so the verification width is the base tree's."""

    base: Union[StaticTree, DynamicTree, AutoTree] = field(default_factory=DynamicTree)
    branch_tokens: int = 8
    max_ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.base, HybridTree):
            raise EagleError("a hybrid tree's base cannot itself be hybrid")
        if self.branch_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise EagleError("hybrid tree needs branch_tokens >= 1 and 1 <= min_ngram <= max_ngram")

    @property
    def depth(self) -> int:
        return max(self.base.depth, self.branch_tokens)

    @property
    def size(self) -> int:
        return self.base.size


TreeSpec = Union[StaticTree, DynamicTree, AutoTree, HybridTree]
TREE_KINDS = ("dynamic", "static", "auto", "hybrid")


def base_tree(tree: "TreeSpec") -> "TreeSpec":
    """The head-drafted part of ``tree``: a hybrid tree's base, any other tree itself."""
    return tree.base if isinstance(tree, HybridTree) else tree


def build_tree(
    kind: str = "dynamic",
    *,
    depth: int | None = None,
    top_k: int | None = None,
    total_tokens: int | None = None,
    branch_tokens: int | None = None,
) -> TreeSpec:
    """The tree policy for settings that may be None (= the default): every caller (``eaglectl``, the Serve
    pairs, ``jobs.evaluate``) goes through here. ``hybrid`` adds an n-gram branch to the dynamic tree;
    ``static`` and ``auto`` take no size settings."""
    if kind not in TREE_KINDS:
        raise EagleError(f"unknown tree {kind!r}: expected one of {', '.join(TREE_KINDS)}")
    sized = depth is not None or top_k is not None or total_tokens is not None
    if kind in ("static", "auto"):
        if sized:
            raise EagleError(f"the {kind} tree takes no depth / top-k / total-tokens settings")
        base: TreeSpec = StaticTree() if kind == "static" else AutoTree()
    else:
        default = DynamicTree()
        base = DynamicTree(depth=depth or default.depth, top_k=top_k or default.top_k, total_tokens=total_tokens or default.total_tokens)
    if kind == "hybrid":
        return HybridTree(base, branch_tokens=branch_tokens or HybridTree().branch_tokens)
    if branch_tokens is not None:
        raise EagleError("branch tokens apply to the hybrid tree only")
    return base


# --------------------------------------------------------------------------------------------------
# A drafted tree
# --------------------------------------------------------------------------------------------------


class DraftTree:
    """A drafted tree. Node 0 is the root; ``parents[i] < i`` for every other node, nodes are ordered by
    depth, and siblings in rank order (most likely first), which the sampling verifier relies on.

    ``tokens``, ``parents``, ``depths`` are tensors on the decoder's device; ``scores`` (when drafted) the
    cumulative draft log-probability of each node (the root's 0); ``ancestors`` is the ``[N, N]``
    self-inclusive ancestry (row i: node i and its ancestors); ``children`` and ``path_to`` are host views
    computed on first use. A hybrid tree's n-gram branch follows the head's nodes (``eagle.ngram``).
    """

    def __init__(
        self, tokens: torch.Tensor, parents: torch.Tensor | Sequence[int], depths: torch.Tensor | Sequence[int],
        ancestors: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> None:
        self.tokens = tokens
        self.parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
        self.depths = torch.as_tensor(depths, dtype=torch.long, device=tokens.device)
        self._ancestors = ancestors
        self.scores = scores

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def ancestors(self) -> torch.Tensor:
        if self._ancestors is None:
            self._ancestors = ancestry(self.parents, self.depths)
        return self._ancestors

    @cached_property
    def host(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) as lists: one transfer for every host-side walk of this tree."""
        return self.tokens.tolist(), self.parents.tolist()

    @property
    def children(self) -> list[list[int]]:
        parents = self.host[1]
        kids: list[list[int]] = [[] for _ in parents]
        for node, parent in enumerate(parents[1:], start=1):
            kids[parent].append(node)
        return kids

    def allowed(self, prefix_len: int) -> torch.Tensor:
        """Bool ``[N, prefix_len + N]``: every node sees the prefix and its own ancestry."""
        prefix = torch.ones(len(self), prefix_len, dtype=torch.bool, device=self.tokens.device)
        return torch.cat([prefix, self.ancestors], dim=1)

    def attention_mask(self, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive mask ``[1, 1, N, prefix_len + N]`` (for transformers' forward)."""
        return additive_mask(self.allowed(prefix_len).to(device), dtype)

    def position_ids(self, start: int) -> torch.Tensor:
        """``[1, N]``: the root sits at ``start``, a node at depth d at ``start + d``."""
        return (self.depths + start).unsqueeze(0)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (root excluded)."""
        parents = self.host[1]
        path = []
        while node > 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


def ancestry(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` bool, entry (i, j) True iff j is i or an ancestor of i; one vectorised pass per depth."""
    n = parents.numel()
    matrix = torch.eye(n, dtype=torch.bool, device=parents.device)
    for depth in range(1, int(depths.max()) + 1 if n > 1 else 1):
        rows = (depths == depth).nonzero().squeeze(-1)
        matrix[rows] |= matrix[parents[rows]]
    return matrix


def causal_mask(q: int, past: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive ``[1, 1, q, past + q]`` causal mask for ``q`` new positions after ``past`` cached ones."""
    return additive_mask(causal_allowed(q, past, device), dtype)


def causal_allowed(q: int, past: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[q, past + q]``: row i sees the ``past`` cached positions and new positions 0..i."""
    return torch.ones(q, past + q, dtype=torch.bool, device=device).tril(diagonal=past)


def padded_mask(ancestry: torch.Tensor, prefix_len: int, width: int) -> torch.Tensor:
    """Bool ``[width, prefix_len + width]``: rows of ``ancestry`` (``[n, n]``, n <= width) see the prefix and
    their ancestry; padding rows see only their own slot (never a real row's, and nobody sees theirs)."""
    n = ancestry.shape[0]
    device = ancestry.device
    mask = torch.zeros(width, prefix_len + width, dtype=torch.bool, device=device)
    mask[:n, :prefix_len] = True
    mask[:n, prefix_len : prefix_len + n] = ancestry
    pad = torch.arange(n, width, device=device)
    mask[pad, prefix_len + pad] = True
    return mask


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[q, kv]`` (True = may attend) -> additive ``[1, 1, q, kv]`` in ``dtype``."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def root_only(root: torch.Tensor) -> DraftTree:
    """The empty draft (``root``: a 1-element long tensor): plain decoding verifies just the root."""
    zero = torch.zeros(1, dtype=torch.long, device=root.device)
    return DraftTree(root, torch.full_like(zero, -1), zero, torch.ones(1, 1, dtype=torch.bool, device=root.device))


# --------------------------------------------------------------------------------------------------
# Drafting
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Level:
    """How the children of one depth are formed from the rows expanded at the depth before:
    ``(row, rank)`` pairs, row indexing the expanded rows, rank the child's rank among its row's proposals."""

    rows: torch.Tensor  # [n]
    ranks: torch.Tensor  # [n]


def _static_plan(spec: StaticTree, device) -> tuple[list[_Level], list[torch.Tensor]]:
    """For a static tree: the children of each depth as (expanded row, rank) pairs, and which of them are
    expanded next (indices into that depth's children)."""
    levels, expand = [], []
    expanded: list[tuple[int, ...]] = [()]
    for depth in range(1, spec.depth + 1):
        children = [(row, rank) for row, path in enumerate(expanded) for rank in spec.child_ranks(path)]
        paths = [expanded[row] + (rank,) for row, rank in children]
        levels.append(_Level(torch.tensor([r for r, _ in children], device=device), torch.tensor([k for _, k in children], device=device)))
        chosen = [i for i, path in enumerate(paths) if spec.child_ranks(path)]
        expand.append(torch.tensor(chosen, dtype=torch.long, device=device))
        expanded = [paths[i] for i in chosen]
    return levels, expand


def _build(root: torch.Tensor, keep: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor) -> DraftTree:
    """The tree of the kept candidates (ascending candidate index: by depth, siblings in rank order), with
    their parents renumbered: candidate c becomes node ``1 + position of c in keep``, the root node 0."""
    device = tokens.device
    renumber = torch.full((tokens.numel() + 1,), -1, dtype=torch.long, device=device)  # index c + 1; entry 0 = root
    renumber[0] = 0
    renumber[keep + 1] = torch.arange(1, keep.numel() + 1, device=device)
    node_parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), renumber[parents[keep] + 1]])
    node_depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths[keep]])
    node_scores = torch.cat([torch.zeros(1, dtype=scores.dtype, device=device), scores[keep]])
    return DraftTree(torch.cat([root.reshape(1), tokens[keep]]), node_parents, node_depths, scores=node_scores)


def rows_mask(prefix: torch.Tensor, sees_prefix: torch.Tensor, local: torch.Tensor, kv: int) -> torch.Tensor:
    """Bool ``[B, q, kv]`` for a batch whose rows sit at different lengths: in row b, query i sees the
    first ``prefix[b]`` slots when ``sees_prefix[b, i]``, and slot ``prefix[b] + j`` when ``local[b, i, j]``
    (``local``: ``[B, q, L]``); nothing past ``prefix[b] + L``. Row b of ``padded_mask`` generalised to
    per-row prefixes: the tree (or causal) block of every row sits right after its own prefix."""
    batch, q, length = local.shape
    rel = torch.arange(kv, device=prefix.device)[None, None] - prefix[:, None, None]  # [B, 1, kv]
    inside = (rel >= 0) & (rel < length)
    block = local.gather(2, rel.clamp(0, length - 1).expand(batch, q, kv)) & inside
    return block | ((rel < 0) & sees_prefix[:, :, None])


@torch.inference_mode()
def draft_trees(
    head: "LeanHead",
    expand,  # callable(features [B, W, hidden], tokens [B, W], positions [B, W], slots [B, W], mask [B, 1, W, kv], k)
    last_hidden: torch.Tensor,  # [B, hidden]: head output at each root's position (predicts the root's feature)
    roots: torch.Tensor,  # [B] long: the root tokens
    prefix: torch.Tensor,  # [B] long: committed head positions of each row
    spec: StaticTree | DynamicTree,
) -> list[DraftTree]:
    """Draft one tree below each of B roots (B >= 1); the heads' committed caches are left as they were.

    ``expand`` is one draft step of the head over ``W = spec.expand_width`` nodes per row, writing their keys
    and values into the head's cache (``LeanHead.expand_rows`` over the batch's cache, or the compiled
    single-row ``LeanHead.expand`` for a batch of one: ``eagle.batch``). Row b's cache holds ``prefix[b]``
    committed positions; the root's pair (f_{L-1}, root) is the last of them. A node fed to the head sits at
    position ``prefix[b] + depth - 1`` and takes its parent's predicted feature and its own token; its
    output is its own predicted feature, whose draft distribution proposes its children. Nodes of depth d
    are fed in slots ``prefix[b] + (d - 1) * W + i`` (padding nodes see only themselves), scratch slots past
    the committed ones. Per depth: one head call for every row, then tensor ops choose the next nodes,
    build their masks and rerank; nothing is read back to the host until the trees are built.
    """
    device = last_hidden.device
    batch = roots.numel()
    static = isinstance(spec, StaticTree)
    width, k = spec.expand_width, spec.top_k
    plan, plan_expand = _static_plan(spec, device) if static else (None, None)
    hidden_size = last_hidden.shape[-1]
    logp, ids = head.propose(last_hidden, k)  # [B, k]
    logp, ids = logp[:, None], ids[:, None]  # [B, E=1, k]
    hidden_rows = last_hidden[:, None]  # [B, E, hidden]
    expanded_score = torch.zeros(batch, 1, dtype=torch.float64, device=device)
    expanded_node = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    expanded_ancestry = torch.zeros(batch, 1, 0, dtype=torch.bool, device=device)  # [B, E, fed so far]
    tokens, scores, parents, depths = [], [], [], []
    count = 0
    own = torch.eye(width, dtype=torch.bool, device=device)[None].expand(batch, width, width)
    for depth in range(1, spec.depth + 1):
        if static:
            level = plan[depth - 1]
        else:
            rows = torch.arange(expanded_node.shape[1], device=device)
            level = _Level(rows.repeat_interleave(k), torch.arange(k, device=device).repeat(rows.numel()))
        child_score = expanded_score[:, level.rows] + logp[:, level.rows, level.ranks].double()  # [B, n]
        tokens.append(ids[:, level.rows, level.ranks])
        scores.append(child_score)
        parents.append(expanded_node[:, level.rows])
        depths.append(torch.full_like(tokens[-1], depth))
        child_nodes = torch.arange(count, count + level.rows.numel(), device=device)
        count += level.rows.numel()
        if depth == spec.depth:
            break
        if static:
            chosen = plan_expand[depth - 1][None].expand(batch, -1)
        else:
            chosen = child_score.topk(min(k, child_score.shape[1]), dim=1).indices  # [B, e]
        if chosen.shape[1] == 0:
            break
        e = chosen.shape[1]
        parent_rows = level.rows[chosen]  # [B, e]
        feed_features = torch.zeros(batch, width, hidden_size, dtype=hidden_rows.dtype, device=device)
        feed_features[:, :e] = hidden_rows.gather(1, parent_rows[..., None].expand(batch, e, hidden_size))
        feed_tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        feed_tokens[:, :e] = tokens[-1].gather(1, chosen)
        fed_before = (depth - 1) * width
        ancestry_rows = torch.zeros(batch, width, fed_before, dtype=torch.bool, device=device)
        if fed_before:
            ancestry_rows[:, :e] = expanded_ancestry.gather(1, parent_rows[..., None].expand(batch, e, fed_before))
        expanded_ancestry = torch.cat([ancestry_rows, own], dim=2)  # [B, W, fed_before + W]
        kv = int(prefix.max()) + fed_before + width
        sees = torch.ones(batch, width, dtype=torch.bool, device=device)
        mask = rows_mask(prefix, sees, expanded_ancestry, kv)
        slots = prefix[:, None] + fed_before + torch.arange(width, device=device)[None]
        positions = (prefix + depth - 1)[:, None].expand(batch, width).contiguous()
        hidden_rows, logp, ids = expand(feed_features, feed_tokens, positions, slots, mask[:, None], k)
        hidden_rows, logp, ids = hidden_rows[:, :e], logp[:, :e], ids[:, :e]
        expanded_ancestry = expanded_ancestry[:, :e]
        expanded_score = child_score.gather(1, chosen)
        expanded_node = child_nodes[chosen]

    all_tokens, all_scores = torch.cat(tokens, dim=1), torch.cat(scores, dim=1)
    all_parents, all_depths = torch.cat(parents, dim=1), torch.cat(depths, dim=1)
    if static:
        keep = torch.arange(all_tokens.shape[1], device=device)[None].expand(batch, -1)
    else:
        key = all_scores - _DEPTH_TIE_BREAK * all_depths.double()
        keep = key.topk(min(spec.total_tokens, key.shape[1]), dim=1).indices.sort(dim=1).values
    return [_build(roots[b], keep[b], all_tokens[b], all_parents[b], all_depths[b], all_scores[b]) for b in range(batch)]
