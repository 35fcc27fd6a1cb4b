"""Hybrid trees: a branch copied from the context joins the EAGLE tree and is verified in the same forward.

Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``) proposes, after the last
``n`` tokens of the context, the tokens that followed their most recent earlier occurrence. Where text
repeats (a second turn rewriting the first answer, code edits, quoting), those copies are long and right,
and a head trained on chat rarely drafts them as far. Here the copy becomes one more branch below the root
of the drafted tree: where its first tokens equal a path the head already drafted it follows that path,
and the rest hangs below it. Verification is unchanged and stays lossless: greedy acceptance follows the
target's argmax through whichever branch holds it, and recursive rejection treats the branch's nodes as
further deterministic proposals (point masses) among their siblings, as it does the head's.

Owns: ``lookup`` (the n-gram match) and ``add_branch`` (the merge into a ``DraftTree``).
Does not own: drafting (``tree.py``) or verification (``verify.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from eagle.tree import DraftTree

if TYPE_CHECKING:
    from eagle.tree import HybridTree


def lookup(context: Sequence[int], *, max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Up to ``max_tokens`` tokens that followed the most recent earlier occurrence of the context's last
    ``n`` tokens, for the largest ``n`` in ``max_ngram .. min_ngram`` that occurs; ``[]`` when none does."""
    tokens = np.asarray(context, dtype=np.int64)
    length = tokens.size
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every n-gram that has a successor
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return tokens[start : start + max_tokens].tolist()
    return []


def add_branch(tree: DraftTree, context: Sequence[int], spec: "HybridTree") -> DraftTree:
    """``tree`` plus the n-gram branch below its root (``context`` ends with the root token). The branch
    follows existing nodes while their tokens agree, then adds new nodes; ``tree`` itself when there is no
    match or the head drafted the whole branch already."""
    branch = lookup(context, max_ngram=spec.max_ngram, min_ngram=spec.min_ngram, max_tokens=spec.branch_tokens)
    if not branch:
        return tree
    tokens, parents = tree.host
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(parents[1:], start=1):
        children.setdefault(parent, {}).setdefault(tokens[node], node)
    node, merged = 0, 0
    while merged < len(branch) and branch[merged] in children.get(node, {}):
        node = children[node][branch[merged]]
        merged += 1
    rest = branch[merged:]
    if not rest:
        return tree
    device = tree.tokens.device
    first = len(tokens)
    depth = int(tree.depths[node])
    new_parents = [node] + list(range(first, first + len(rest) - 1))
    return DraftTree(
        torch.cat([tree.tokens, torch.tensor(rest, dtype=tree.tokens.dtype, device=device)]),
        torch.cat([tree.parents, torch.tensor(new_parents, dtype=torch.long, device=device)]),
        torch.cat([tree.depths, torch.arange(depth + 1, depth + 1 + len(rest), device=device)]),
    )
