"""Tree attention and drafting: masks, positions, path scoring through the lean forward, KV-cache compaction
against fresh prefills, and the vectorised drafting against a node-by-node reference of EAGLE-1/2."""

import pytest
import torch

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig, StaticTree
from eagle.batch import BatchDecoder
from eagle.errors import EagleError
from eagle.model import LeanModel
from eagle.tree import MC_SIM_7B_63, padded_mask, AutoTree, DraftTree, HybridTree, build_tree, causal_allowed, causal_mask
from tiny import ARCHITECTURES, tiny_target

PROMPT = [5, 17, 3, 42, 8, 23, 11, 60, 2, 31]


def _random_tree(size: int, vocab: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents, depths = [-1], [0]
    for node in range(1, size):
        parent = int(torch.randint(0, node, (1,), generator=g))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    order = sorted(range(size), key=lambda n: (depths[n], n))  # by depth, as drafting produces them
    index = {old: new for new, old in enumerate(order)}
    tokens = torch.randint(0, vocab, (size,), generator=g)
    return DraftTree(tokens[order], [-1] + [index[parents[n]] for n in order[1:]], [depths[n] for n in order])


def _leaves(tree: DraftTree) -> list[int]:
    return [n for n, kids in enumerate(tree.children) if not kids]


def test_mask_lets_each_node_see_prefix_and_ancestry_only():
    tree = DraftTree(torch.tensor([9, 1, 2, 3, 4]), [-1, 0, 0, 1, 3], torch.tensor([0, 1, 1, 2, 3]))
    allowed = tree.attention_mask(prefix_len=3, dtype=torch.float32)[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 1, 0, 0],
            [1, 1, 1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 1, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected) and torch.equal(tree.allowed(3), expected)
    assert tree.position_ids(3).tolist() == [[3, 4, 4, 5, 6]]
    assert tree.path_to(4) == [1, 3, 4]
    padded = padded_mask(tree.ancestors, 3, 7)  # two padding rows: each sees its own slot only
    assert torch.equal(padded[:5, :8], expected) and not padded[:5, 8:].any()
    assert padded[5].nonzero().squeeze(-1).tolist() == [8] and padded[6].nonzero().squeeze(-1).tolist() == [9]


def _lean(target):
    return LeanModel(target.backbone, target.lm_head, target.config, 256)


def _prefill(model, cache, ids):
    n = len(ids)
    positions = torch.arange(n)
    return model(torch.tensor([ids]), positions[None], positions, causal_allowed(n, 0)[None, None], cache.keys, cache.values)[0]


def _tree_forward(model, cache, tree, start, width):
    n = len(tree)
    ids = torch.zeros(width, dtype=torch.long)
    ids[:n] = tree.tokens
    positions = torch.full((width,), start)
    positions[:n] += tree.depths
    mask = padded_mask(tree.ancestors, start, width)
    return model(ids[None], positions[None], torch.arange(start, start + width), mask[None, None], cache.keys, cache.values)[0]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@torch.inference_mode()  # the decoder's caches are inference tensors
def test_tree_forward_scores_every_path_like_sequential_decoding(model_type):
    """One padded forward over a random tree (the decoder's verification) gives every node the features a
    plain forward over its path gives, through transformers' own forward as the reference."""
    target = tiny_target(model_type)
    model = _lean(target)
    tree = _random_tree(14, target.vocab_size, seed=3)
    cache = model.new_cache(64)
    n = len(PROMPT)
    torch.testing.assert_close(_prefill(model, cache, PROMPT), target.forward(torch.tensor([PROMPT]), target.new_cache())[0], rtol=1e-10, atol=1e-10)
    features = _tree_forward(model, cache, tree, n, 16)
    leaves = _leaves(tree)
    assert len(leaves) >= 3
    for leaf in leaves:
        path = [0] + tree.path_to(leaf)
        sequence = PROMPT + tree.tokens[path].tolist()
        fresh = target.forward(torch.tensor([sequence]), target.new_cache())[0, n:]
        torch.testing.assert_close(features[path], fresh, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@torch.inference_mode()  # the decoder's caches are inference tensors
def test_compacted_cache_equals_fresh_prefill_of_accepted_tokens(model_type):
    target = tiny_target(model_type)
    model = _lean(target)
    tree = _random_tree(12, target.vocab_size, seed=5)
    n = len(PROMPT)
    cache = model.new_cache(64)
    _prefill(model, cache, PROMPT)
    _tree_forward(model, cache, tree, n, 12)
    leaf = max(_leaves(tree), key=lambda node: len(tree.path_to(node)))
    keep = [0] + tree.path_to(leaf)[:-1]  # an accepted path that stops above the leaf
    assert len(keep) >= 3
    cache.compact(n, torch.tensor(keep) + n)
    fresh = model.new_cache(64)
    _prefill(model, fresh, PROMPT + tree.tokens[keep].tolist())
    length = n + len(keep)
    for got, want in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        torch.testing.assert_close(got[:, :, :length], want[:, :, :length], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout", [{}, {"fc_bias": False, "input_norm": False}, {"kind": "eagle3"}], ids=["default", "vllm-layout", "eagle3"])
@pytest.mark.parametrize("tree_spec", [StaticTree(), DynamicTree(depth=4, top_k=3, total_tokens=10), HybridTree(DynamicTree(depth=3, top_k=2, total_tokens=6))])
def test_decode_loop_keeps_both_caches_equal_to_fresh_prefills(tree_spec, layout):
    """After every step the target cache's committed slots hold exactly the committed tokens' keys and
    values, and the head cache's equal a fresh head prefill over the target's true features of them."""
    target = tiny_target("llama", logit_scale=4.0)
    head = EagleHead.for_target(target, seed=2, **layout)
    decoder = Decoder(target, head, tree_spec)
    engine = BatchDecoder(decoder, max_batch=1, max_context=128, speculate="always")
    prompt = PROMPT + PROMPT[:4]  # a repeat, so a hybrid tree finds an n-gram branch
    engine.submit(prompt, GenerationConfig(max_new_tokens=40, stop_token_ids=[]))
    for _ in range(6):
        engine.step()
        engine.draft()  # the head catches up on the step's accepted tokens (drafting writes scratch slots only)
        row = engine.rows[0]
        committed, root = row.context[:-1], row.root
        n = len(committed)
        assert row.committed == row.head_committed == n
        assert row.context[: len(prompt)] == prompt
        fresh = decoder.runtime.new_cache(192)
        _, features = decoder.runtime.prefill(torch.tensor(committed), fresh)  # the head input
        for got, want in zip(engine.cache.keys + engine.cache.values, fresh.keys + fresh.values):
            torch.testing.assert_close(got[:, :, :n], want[:, :, :n], rtol=1e-9, atol=1e-9)
        head_cache = decoder.head_runtime.new_cache(192)
        hidden = decoder.head_runtime.prefill(features, torch.tensor(committed[1:] + [root]), head_cache)
        for got, want in zip(engine.head_cache.keys + engine.head_cache.values, head_cache.keys + head_cache.values):
            torch.testing.assert_close(got[:, :, :n], want[:, :, :n], rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(row.last_hidden, hidden[-1], rtol=1e-8, atol=1e-8)
        # and the lean head equals the training-time head (transformers' layer, a DynamicCache)
        with torch.no_grad():
            reference = head(features[None], torch.tensor([committed[1:] + [root]]), head.new_cache(), torch.arange(n)[None], causal_mask(n, 0, target.dtype))
        torch.testing.assert_close(hidden, reference[0], rtol=1e-9, atol=1e-9)


# ---- drafting against a node-by-node reference ------------------------------------------------------------


@torch.no_grad()
def _reference_tree(head, last_hidden, root, prefix_features, prefix_tokens, spec):
    """EAGLE-1 / EAGLE-2 drafting node by node with the training-time head (transformers' layer over a fresh
    DynamicCache of the prefix), as the engine drafted before it was vectorised: the ground truth for
    ``eagle.tree.draft_tree``. Returns (tokens, parents, depths) of the tree in the engine's node order."""
    static = isinstance(spec, StaticTree)
    n = len(prefix_tokens)
    cache = head.new_cache()
    head(prefix_features[None], torch.tensor([prefix_tokens]), cache, torch.arange(n)[None], causal_mask(n, 0, prefix_features.dtype))
    tokens, parents, depths, scores, paths = [root], [-1], [0], [0.0], [()]
    fed_slot, feature = {}, {0: last_hidden}
    expand, logp = [0], torch.log_softmax(head.draft_logits(last_hidden[None]), -1)
    max_rank = spec.top_k
    for depth in range(1, spec.depth + 1):
        top = logp.topk(min(max_rank, logp.shape[-1]), dim=-1)
        top_ids = head.draft_to_target(top.indices)
        new = []
        for row, parent in enumerate(expand):
            for rank in (spec.child_ranks(paths[parent]) if static else range(top_ids.shape[1])):
                tokens.append(int(top_ids[row, rank]))
                parents.append(parent)
                depths.append(depth)
                scores.append(scores[parent] + float(top.values[row, rank]))
                paths.append(paths[parent] + (rank,))
                new.append(len(tokens) - 1)
        if depth == spec.depth:
            break
        to_feed = [m for m in new if spec.child_ranks(paths[m])] if static else sorted(new, key=lambda m: -scores[m])[: spec.top_k]
        if not to_feed:
            break
        before = len(fed_slot)
        allowed = torch.zeros(len(to_feed), n + before + len(to_feed), dtype=torch.bool)
        allowed[:, :n] = True
        for row, node in enumerate(to_feed):
            allowed[row, n + before + row] = True
            ancestor = parents[node]
            while ancestor > 0:
                allowed[row, n + fed_slot[ancestor]] = True
                ancestor = parents[ancestor]
        for row, node in enumerate(to_feed):
            fed_slot[node] = before + row
        mask = torch.zeros(allowed.shape, dtype=prefix_features.dtype).masked_fill(~allowed, torch.finfo(prefix_features.dtype).min)
        hidden = head(
            torch.stack([feature[parents[m]] for m in to_feed])[None], torch.tensor([[tokens[m] for m in to_feed]]), cache,
            torch.full((1, len(to_feed)), n + depth - 1), mask[None, None],
        )[0]
        for row, node in enumerate(to_feed):
            feature[node] = hidden[row]
        expand, logp = to_feed, torch.log_softmax(head.draft_logits(hidden), -1)
    if static:
        keep = list(range(1, len(tokens)))
    else:
        order = sorted(range(1, len(tokens)), key=lambda m: (-scores[m], depths[m], m))
        kept, keep = {0}, []
        for node in order:
            if len(keep) == spec.total_tokens:
                break
            if parents[node] in kept:
                kept.add(node)
                keep.append(node)
    keep = sorted(keep)
    index = {0: 0, **{node: i for i, node in enumerate(keep, start=1)}}
    return [root] + [tokens[m] for m in keep], [-1] + [index[parents[m]] for m in keep], [0] + [depths[m] for m in keep]


@pytest.mark.parametrize(
    "spec", [StaticTree(), DynamicTree(), DynamicTree(depth=4, top_k=3, total_tokens=9), DynamicTree(depth=3, top_k=8, total_tokens=40)],
    ids=["static", "dynamic", "dynamic-small", "dynamic-wide"],
)
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_vectorised_drafting_equals_the_node_by_node_reference(model_type, spec, kind):
    target = tiny_target(model_type, logit_scale=3.0)
    head = EagleHead.for_target(target, seed=1, kind=kind)
    engine = BatchDecoder(Decoder(target, head, spec), max_batch=1, max_context=64)
    engine.submit(PROMPT, GenerationConfig(max_new_tokens=16))
    engine.admit()
    tree, = engine.draft()
    row = engine.rows[0]
    _, features = engine.runtime.prefill(torch.tensor(PROMPT), engine.runtime.new_cache(64))  # the head input
    tokens, parents, depths = _reference_tree(head, row.last_hidden, row.root, features, PROMPT[1:] + [row.root], spec)
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    assert tree.depths.tolist() == depths
    assert len(tree) == 1 + spec.size
    for kids in tree.children:  # siblings are distinct tokens
        assert len(set(tree.tokens[kids].tolist())) == len(kids)


def test_static_default_is_the_reference_25_node_depth_5_tree():
    spec = StaticTree()
    assert spec.size == 25 and spec.depth == 5 and spec.paths == MC_SIM_7B_63 and spec.top_k == 4


def test_static_tree_must_be_prefix_closed():
    with pytest.raises(EagleError, match="prefix-closed"):
        StaticTree(paths=((0,), (1, 1)))


def test_build_tree_is_the_one_factory():
    assert build_tree() == DynamicTree()
    assert build_tree("dynamic", depth=3) == DynamicTree(depth=3, top_k=4, total_tokens=15)
    assert build_tree("static") == StaticTree()
    assert build_tree("auto") == AutoTree()
    assert build_tree("hybrid", total_tokens=8, branch_tokens=6) == HybridTree(DynamicTree(total_tokens=8), branch_tokens=6)
    for bad, message in (
        (lambda: build_tree("bushy"), "unknown tree"),
        (lambda: build_tree("static", depth=3), "takes no depth"),
        (lambda: build_tree("dynamic", branch_tokens=4), "hybrid tree only"),
        (lambda: build_tree("dynamic", depth=2, top_k=2, total_tokens=9), "at most 6 tokens"),
    ):
        with pytest.raises(EagleError, match=message):
            bad()
