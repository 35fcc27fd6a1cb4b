"""Pieces of the fast decode path: incremental detokenisation, bf16 near-tie rescoring, grouped-query attention,
n-gram branches, the auto tree's acceptance estimate, and the request-level behaviour of static caches."""

from __future__ import annotations

import random

import pytest
import torch

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig
import eagle.autotree
from eagle.autotree import _accepted, choose_tree
from eagle.generate import TextDelta
from eagle.model import LeanModel, attention
from eagle.ngram import add_branch, lookup
from eagle.tree import AutoTree, DraftTree, HybridTree
from tiny import tiny_target


# ---- incremental detokenisation ------------------------------------------------------------------------


def test_text_deltas_concatenate_to_the_decoded_text_and_decode_short_windows(smollm2):
    text = "Héllo wörld! 你好，世界。 Emoji: 🦅🚀 and code: def f(x):\n    return x ** 2  # ünïcode\n" * 8
    ids = smollm2.tokenizer.encode(text)
    windows: list[int] = []
    decode = smollm2.decode

    class Spy:
        tokenizer = smollm2.tokenizer

        def decode(self, token_ids):
            windows.append(len(token_ids))
            return decode(token_ids)

    rng = random.Random(0)
    for _ in range(5):
        delta, parts, position = TextDelta(Spy()), [], 0
        while position < len(ids):
            size = rng.randint(1, 6)  # a step emits 1..6 tokens
            parts.append(delta.push(ids[position : position + size]))
            position += size
        assert "".join(parts) == decode(ids)
    assert len(ids) > 300 and max(windows) <= 40, f"decoded windows up to {max(windows)} tokens of {len(ids)}"


# ---- bf16 near ties --------------------------------------------------------------------------------------


def test_rescoring_breaks_bf16_ties_by_the_float32_dot_product():
    target = tiny_target("llama", vocab_size=16, hidden_size=32, dtype=torch.bfloat16)
    with torch.no_grad():
        weight = target.lm_head.weight
        weight.fill_(-0.5)
        weight[3] = 0.1
        weight[7] = 0.1
        weight[7, 0] = weight[7, 0] + 2.0**-11  # one bf16 ulp more (0.1 = 1.6 x 2^-4, 7 mantissa bits)
    assert weight[7, 0] > weight[3, 0]
    model = LeanModel(target.backbone, target.lm_head, target.config, 64)
    features = torch.ones(1, 32, dtype=torch.bfloat16)
    logits = target.lm_head(features)
    assert logits[0, 3] == logits[0, 7] and int(logits.argmax()) == 3  # an exact tie in bf16: argmax takes the first
    assert int(model.greedy(features, logits)[0]) == 7  # float32 sees row 7's extra ulp
    fp32 = LeanModel(target.backbone, target.lm_head, target.config, 64)
    fp32.rescore = False
    assert int(fp32.greedy(features, logits)[0]) == 3


# ---- n-gram branches --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_attention_equals_grouped_query_sdpa(dtype):
    """``eagle.model.attention`` folds the heads of a kv head into the query length in bf16 / fp16: the values
    of ``enable_gqa`` bit for bit, per row, under a per-row mask, at decode (q = 1) and tree (q = 5) widths."""
    generator = torch.Generator().manual_seed(0)
    for batch, q, kv in ((1, 1, 7), (4, 1, 9), (3, 5, 12)):
        query = torch.randn(batch, 6, q, 8, generator=generator).to(dtype)
        keys, values = (torch.randn(batch, 2, 16, 8, generator=generator).to(dtype)[:, :, :kv] for _ in range(2))
        mask = torch.rand(batch, 1, q, kv, generator=generator) > 0.4
        mask[..., 0] = True
        want = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=True)
        assert torch.equal(attention(query, keys, values, mask, 0.3), want)
        # head i reads kv head i // 3: a change in kv head 1 moves heads 3-5 only
        keys2 = keys.clone()
        keys2[:, 1] += 1
        moved = (attention(query, keys2, values, mask, 0.3) != want).flatten(2).any(-1)  # [B, heads]
        assert not moved[:, :3].any() and moved[:, 3:].any()


def test_lookup_takes_the_longest_most_recent_match():
    context = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert lookup(context, max_ngram=3, min_ngram=2, max_tokens=3) == [4, 5, 7]  # (2, 3) most recently at 6..7
    assert lookup([5, 1, 2, 3, 6, 8, 1, 2, 3], max_ngram=3, min_ngram=1, max_tokens=2) == [6, 8]
    assert lookup([1, 2, 3, 4], max_ngram=3, min_ngram=2, max_tokens=4) == []
    assert lookup([4, 4, 4, 4], max_ngram=2, min_ngram=2, max_tokens=5) == [4]  # the overlapping match
    assert lookup([7], max_ngram=3, min_ngram=1, max_tokens=4) == []


def test_a_branch_follows_the_drafted_path_then_adds_nodes():
    spec = HybridTree(DynamicTree(depth=2, top_k=2, total_tokens=4), branch_tokens=4, max_ngram=2, min_ngram=2)
    #            root  a  b   a->c  a->d
    tree = DraftTree(torch.tensor([0, 10, 11, 12, 13]), [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2])
    context = [5, 0, 10, 12, 14, 15, 8, 5, 0]  # tail (5, 0) -> 10, 12, 14, 15
    merged = add_branch(tree, context, spec, width=7)  # room for both new nodes
    assert merged.tokens.tolist() == [0, 10, 11, 12, 13, 14, 15]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 1, 3, 5] and merged.depths.tolist() == [0, 1, 1, 2, 2, 3, 4]
    assert merged.path_to(6) == [1, 3, 5, 6]
    # at the tree's own width the new nodes replace the head's lowest-scored nodes off the branch's path
    scored = DraftTree(tree.tokens, tree.parents, tree.depths, scores=torch.tensor([0.0, -0.5, -1.0, -0.7, -0.6], dtype=torch.float64))
    three = HybridTree(spec.base, branch_tokens=3, max_ngram=2, min_ngram=2)  # branch 10, 12, 14: one new node
    fitted = add_branch(scored, context, three)
    assert len(fitted) == 5 and fitted.tokens.tolist() == [0, 10, 12, 13, 14]  # 11 (-1.0) made room for 14
    assert fitted.parents.tolist() == [-1, 0, 1, 1, 2] and fitted.depths.tolist() == [0, 1, 2, 2, 3]
    assert add_branch(tree, [1, 2, 3], spec) is tree  # no match: the tree itself
    short = HybridTree(spec.base, branch_tokens=2, max_ngram=2, min_ngram=2)
    assert add_branch(tree, [9, 0, 10, 12, 9, 0], short) is tree  # the head drafted the whole branch already


# ---- the auto tree's estimate ------------------------------------------------------------------------------


def test_the_auto_estimate_accepts_the_prefix_of_the_wide_path_a_smaller_tree_holds():
    # wide tree (k = 2, depth 3): root -> 1, 2; 1 -> 3, 4; 2 -> 5, 6; 3 -> 7, 8; 5 -> 9, 10; accepted 1, 3, 8
    step = {
        "parents": [-1, 0, 0, 1, 1, 2, 2, 3, 3, 5, 5],
        "depths": [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3],
        "ranks": [0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1],
        "scores": [0, -0.1, -1.0, -0.3, -1.2, -1.1, -2.0, -0.9, -1.3, -1.4, -2.2],
        "path": [1, 3, 8],
    }
    assert _accepted(step, depth=3, k=2, size=10) == 3
    assert _accepted(step, depth=2, k=2, size=6) == 2  # depth 2 cannot hold node 8
    assert _accepted(step, depth=3, k=1, size=3) == 2  # top-1 children only: 1, 3, 7 (8 is rank 1)
    assert _accepted(step, depth=3, k=2, size=4) == 2  # the 4 best: 1 (-0.1), 3 (-0.3), 7 (-0.9), 2 (-1.0)
    assert _accepted(step, depth=1, k=2, size=2) == 1


def test_the_auto_tree_takes_the_best_measured_rate_and_warns_when_plain_decoding_is_faster(monkeypatch, caplog):
    """choose_tree's arithmetic on fixed measurements: a head whose calibration accepted one token per step
    (tau 2 for every candidate), target steps costing 10 ms + 1 ms per token; then a head that accepts nothing."""
    step = {"parents": [-1, 0, 0], "depths": [0, 1, 1], "ranks": [0, 0, 1], "scores": [0, -0.1, -0.2], "path": [1]}
    monkeypatch.setattr(eagle.autotree, "_calibrate", lambda decoder, spec: [step] * 4)
    monkeypatch.setattr(eagle.autotree, "_verify_costs", lambda decoder, widths: {w: 10.0 + w for w in widths})
    monkeypatch.setattr(eagle.autotree, "_head_costs", lambda decoder, spec: {"propose": 1.0, "advance": 1.0, "expand": {2: 1.0, 3: 1.0}})
    with caplog.at_level("WARNING", logger="eagle.autotree"):
        chosen, report = choose_tree(None, AutoTree(max_depth=2, top_ks=(2, 3), sizes=(2, 4)))
    # tau 2 everywhere; the cheapest tree wins: depth 1, 2 tokens -> 2 / (1 + 13 + 1) ms = 133 tok/s < 1000 / 11
    assert (chosen.depth, chosen.total_tokens) == (1, 2) and report["expected_tau"] == 2.0
    assert report["expected_tokens_per_s"] == 133.3 and report["plain_tokens_per_s"] == 90.9
    assert not any("beats plain" in r.message for r in caplog.records)
    monkeypatch.setattr(eagle.autotree, "_calibrate", lambda decoder, spec: [])  # accepts nothing: tau 1
    with caplog.at_level("WARNING", logger="eagle.autotree"):
        choose_tree(None, AutoTree(max_depth=2, top_ks=(2, 3), sizes=(2, 4)))
    assert any("no tree beats plain decoding" in r.message for r in caplog.records)


# ---- static caches at the request level -------------------------------------------------------------------


def test_a_request_allocates_its_caches_once_and_leaves_them_sized_for_its_budget():
    target = tiny_target("llama", logit_scale=3.0)
    head = EagleHead.for_target(target, seed=0)
    decoder = Decoder(target, head, DynamicTree(depth=3, top_k=2, total_tokens=5))
    allocated = []
    original = decoder.runtime.new_cache

    def spy(capacity, rows=1):
        assert rows == 1  # a request runs as a batch of one
        allocated.append(capacity)
        return original(capacity, rows)

    decoder.runtime.new_cache = spy
    result = decoder.generate([1, 2, 3, 4], GenerationConfig(max_new_tokens=60, stop_token_ids=[]))
    assert len(result.token_ids) == 60
    assert len(allocated) == 1 and 4 + 60 + decoder._scratch() <= allocated[0] <= 4 + 60 + decoder._scratch() + 64


def test_auto_dtype_follows_the_cpus_bf16_flags(tmp_path, monkeypatch):
    from eagle.runtime import native_bf16, preferred_dtype

    monkeypatch.delenv("EAGLE_NATIVE_BF16", raising=False)

    def cpuinfo(flags: str):
        path = tmp_path / f"cpuinfo-{len(list(tmp_path.iterdir()))}"
        path.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
        return str(path)

    assert not native_bf16(cpuinfo("fpu sse2 avx avx2 fma"))  # AVX2 only: bf16 matmuls are emulated
    assert not native_bf16(cpuinfo("avx2 avx512f avx512bw"))  # AVX-512 without its bf16 extension
    assert native_bf16(cpuinfo("avx2 avx512f avx512_bf16"))
    assert native_bf16(cpuinfo("avx2 amx_tile amx_bf16"))
    assert native_bf16(str(tmp_path / "missing"))  # flags unreadable (not Linux): bf16, as before "auto" existed
    assert preferred_dtype("float32") == "float32" and preferred_dtype("bfloat16") == "bfloat16"  # explicit wins
    assert preferred_dtype("auto", gpu=True) == "bfloat16"
    assert preferred_dtype("auto") == ("bfloat16" if native_bf16() else "float32")
    monkeypatch.setenv("EAGLE_NATIVE_BF16", "0")  # the override the tests use to run an AVX2 CPU's path
    assert not native_bf16(cpuinfo("avx2 amx_tile amx_bf16")) and preferred_dtype("auto") == "float32"
    monkeypatch.setenv("EAGLE_NATIVE_BF16", "1")
    assert native_bf16(cpuinfo("fpu sse2 avx avx2 fma")) and preferred_dtype("auto") == "bfloat16"
