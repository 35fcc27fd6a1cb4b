"""The side-by-side benchmark: report fields and their consistency, report files, prompt files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eagle import Decoder, DynamicTree, EagleError, EagleHead, GenerationConfig, SamplingConfig, StaticTree, load_target
from eagle.bench import (
    BenchPrompt,
    acceptance_counts,
    default_prompts_path,
    divergence,
    load_prompts,
    n_alpha,
    run_bench,
    write_report,
)
from heads import good_head
from tests.tiny import tiny_target

GREEDY = SamplingConfig(temperature=0.0)
SPEEDUP_KEYS = {"eagle_vs_plain", "eagle_vs_hf", "plain_vs_hf", "prompt_lookup_vs_plain"}


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("llama", dtype=torch.float64)


@pytest.fixture(scope="module")
def greedy_report():
    # a head trained on the target's own continuations (tests/heads.py): its drafts are accepted, so the report
    # has depths to count; an untrained head's acceptance depends on the luck of its random init
    target = tiny_target("llama", vocab_size=8, dtype=torch.float64)
    head = good_head(target)
    prompts = [
        BenchPrompt("a", None, "repeat", [1, 5, 7, 2, 3, 5, 7, 2, 3]),
        BenchPrompt("b", None, None, [4, 2, 6, 1, 3, 7]),
    ]
    return run_bench(target, head, prompts, max_new_tokens=12, sampling=GREEDY, tree=DynamicTree(depth=3, top_k=2,
                     total_tokens=6), progress=False, head_label="trained", speculate="always")


def _check_timing(entry):
    assert entry["tokens"] > 0 and entry["seconds"] > 0
    assert entry["tokens_per_second"] == pytest.approx(entry["tokens"] / entry["seconds"])


def test_greedy_report_fields_are_consistent(greedy_report):
    report = greedy_report
    assert report["methods"] == ["plain", "eagle", "hf", "prompt-lookup"]
    config = report["config"]
    assert config["target"] == "tiny-llama" and config["dtype"] == "float64" and config["head"] == "trained"
    assert config["tree"]["type"] == "DynamicTree" and config["tree"]["depth"] == 3
    assert config["sampling"]["temperature"] == 0.0 and config["max_new_tokens"] == 12
    assert {"torch", "threads", "machine", "date", "target_revision"} <= set(config)
    assert config["speculate"] == "always" and config["policy"]["decisions"]["plain"] == 0
    assert report["aggregate"]["drafted_share"] == 1.0 and all(r["drafted_share"] == 1.0 for r in report["prompts"])

    assert len(report["prompts"]) == 2
    for record in report["prompts"]:
        assert record["prompt_tokens"] > 0
        for name in report["methods"]:
            _check_timing(record["methods"][name])
            assert record["methods"][name]["tokens"] == 12  # no EOS on tiny targets: every method runs to the budget
        assert set(record["speedup"]) == SPEEDUP_KEYS
        rates = {n: e["tokens_per_second"] for n, e in record["methods"].items()}
        assert record["speedup"]["eagle_vs_plain"] == pytest.approx(rates["eagle"] / rates["plain"])
        assert record["speedup"]["prompt_lookup_vs_plain"] == pytest.approx(rates["prompt-lookup"] / rates["plain"])
        counts = record["accepted_counts"]
        produced = sum((k + 1) * c for k, c in enumerate(counts))  # the steps' accepted + 1, before the budget's cut
        assert record["tau"] == pytest.approx(produced / sum(counts))
        assert len(record["n_alpha"]) == 3
        assert all(a is None or 0 <= a <= 1 for a in record["n_alpha"])
        eagle = record["methods"]["eagle"]
        assert eagle["draft_s"] >= 0 and eagle["verify_s"] > 0 and eagle["steps"] == sum(record["accepted_counts"])
        # the prefill's token plus (accepted + 1) per step reach the budget; only the last step goes past it, by
        # at most its own accepted drafts (depth 3)
        assert 12 - 1 <= produced <= 12 - 1 + 3
        assert record["outputs_match_plain"] is True and record["divergence"] is None
        assert record["hf_matches_plain"] is True and record["prompt_lookup_matches_plain"] is True

    aggregate = report["aggregate"]
    assert aggregate["all_outputs_match_plain"] is True and aggregate["all_hf_match_plain"] is True
    for name in report["methods"]:
        entry = aggregate["methods"][name]
        _check_timing(entry)
        assert entry["tokens"] == sum(r["methods"][name]["tokens"] for r in report["prompts"])
        assert entry["seconds"] == pytest.approx(sum(r["methods"][name]["seconds"] for r in report["prompts"]))
    assert aggregate["speedup"]["plain_vs_hf"] == pytest.approx(
        aggregate["methods"]["plain"]["tokens_per_second"] / aggregate["methods"]["hf"]["tokens_per_second"]
    )
    assert aggregate["tau_mean"] > 1  # drafts were accepted, and the outputs still matched plain decoding
    assert aggregate["n_alpha_pooled"][0] > 0
    assert aggregate["tau_mean"] == pytest.approx(sum(r["tau"] for r in report["prompts"]) / 2)
    assert all(a is None or 0 <= a <= 1 for a in aggregate["n_alpha_mean"] + aggregate["n_alpha_pooled"])
    assert aggregate["accepted_counts"] == [sum(c) for c in zip(*(r["accepted_counts"] for r in report["prompts"]))]
    counts = aggregate["accepted_counts"]
    assert aggregate["tau_pooled"] == pytest.approx(sum((k + 1) * c for k, c in enumerate(counts)) / sum(counts))


def test_write_report_writes_json_markdown_and_plot(greedy_report, tmp_path):
    paths = write_report(greedy_report, tmp_path / "out" / "bench.json")
    assert paths == {
        "json": tmp_path / "out" / "bench.json",
        "markdown": tmp_path / "out" / "bench.md",
        "plot": tmp_path / "out" / "bench.png",
    }
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(greedy_report))
    table = paths["markdown"].read_text()
    assert "| **all** |" in table and "| a | repeat |" in table and "| b |" in table
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(EagleError, match="bench.md"):
        write_report(greedy_report, tmp_path / "bench.md")


def test_plain_only_and_sampling(tiny, tmp_path):
    """head=None benchmarks plain decoding alone; at T > 0 the match fields are null and HF samples."""
    prompts = [BenchPrompt("p", None, None, [3, 1, 4, 1, 5, 9, 2, 6])]
    report = run_bench(tiny, None, prompts, max_new_tokens=6, sampling=SamplingConfig(temperature=0.8, top_k=20),
                       tree=None, baselines=("hf",), seed=3, progress=False)
    assert report["methods"] == ["plain", "hf"]
    record = report["prompts"][0]
    assert record["tau"] is None and record["n_alpha"] is None and record["outputs_match_plain"] is None
    assert record["hf_matches_plain"] is None and record["speedup"]["eagle_vs_plain"] is None
    assert report["aggregate"]["all_outputs_match_plain"] is None and report["config"]["head"] == "none"
    _check_timing(report["aggregate"]["methods"]["hf"])
    paths = write_report(report, tmp_path / "plain.json")
    assert json.loads(paths["json"].read_text())["aggregate"]["speedup"]["eagle_vs_plain"] is None
    assert paths["plot"].stat().st_size > 0


def test_run_bench_rejects_bad_input(tiny):
    prompts = [BenchPrompt("p", None, None, [1, 2, 3])]
    with pytest.raises(EagleError, match="unknown baseline"):
        run_bench(tiny, None, prompts, max_new_tokens=4, sampling=GREEDY, tree=None, baselines=("vllm",),
                  progress=False)
    with pytest.raises(EagleError, match="no tokenizer"):
        run_bench(tiny, None, [BenchPrompt("t", "hello", None)], max_new_tokens=4, sampling=GREEDY, tree=None,
                  progress=False)
    with pytest.raises(EagleError, match="no prompts"):
        run_bench(tiny, None, [], max_new_tokens=4, sampling=GREEDY, tree=None, progress=False)


def test_n_alpha_is_the_conditional_acceptance_rate_per_depth():
    # 4 steps reach depth 0; 3 accept >= 1; 2 of those accept >= 2; 1 of those accepts >= 3; none >= 4.
    assert n_alpha([0, 1, 2, 3], 5) == [0.75, pytest.approx(2 / 3), 0.5, 0.0, None]
    assert n_alpha([], 2) == [None, None]
    assert acceptance_counts([0, 1, 2, 3, 0], 3) == [2, 1, 1, 1]


def test_divergence_reports_position_tokens_and_plain_top2_margin(tiny):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = Decoder(tiny, None).generate(prompt, GenerationConfig(max_new_tokens=8)).token_ids
    assert divergence(tiny, prompt, plain, list(plain)) is None
    other = plain[:3] + [(plain[3] + 1) % tiny.vocab_size] + plain[4:]
    found = divergence(tiny, prompt, plain, other)
    # the margin, recomputed by the model's own full forward over prompt + plain[:3]
    logits = tiny.model(torch.tensor([prompt + plain[:3]])).logits[0, -1]
    top2 = logits.topk(2).values
    assert found["position"] == 3 and found["plain_token"] == plain[3] and found["eagle_token"] == other[3]
    assert found["plain_top2_margin"] == pytest.approx(float(top2[0] - top2[1]), rel=1e-6)
    # one output stopping early: it parts at the shorter length
    assert divergence(tiny, prompt, plain, plain[:5])["eagle_token"] is None


def test_load_prompts_reads_mtbench_and_plain_formats(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}\n'
        "\n"
        '{"prompt": "Say hi.", "id": "greet"}\n'
        '{"prompt": "No id here."}\n'
    )
    prompts = load_prompts(path)
    assert prompts == [
        BenchPrompt("81", "Write a poem.", "writing"),
        BenchPrompt("greet", "Say hi.", None),
        BenchPrompt("4", "No id here.", None),
    ]
    assert load_prompts(path, limit=1) == prompts[:1]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "ok"}', "{not json"], r"prompts\.jsonl:2: not valid JSON"),
        (['{"prompt": "ok"}', '{"prompt": "fine"}', '{"text": "no"}'], r"prompts\.jsonl:3: expected MT-bench"),
        (['{"turns": []}'], r"prompts\.jsonl:1: 'turns'"),
        (['["a list"]'], r"prompts\.jsonl:1: expected a JSON object"),
        (["", "  "], r"prompts\.jsonl holds no prompts"),
    ],
)
def test_load_prompts_names_the_bad_line(tmp_path, lines, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(EagleError, match=message) as caught:
        load_prompts(path)
    assert "\n" not in str(caught.value)


def test_load_prompts_rejects_missing_file_and_bad_limit(tmp_path):
    with pytest.raises(EagleError, match="cannot read prompts"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(EagleError, match="limit"):
        load_prompts(tmp_path / "missing.jsonl", limit=0)


def test_default_prompts_are_mtbench():
    assert default_prompts_path().name == "question.jsonl"
    prompts = load_prompts(limit=3)
    assert len(prompts) == 3 and all(p.text and p.category for p in prompts)
    assert len(load_prompts()) == 80


def test_spread_prompts_take_the_first_of_every_category_in_turn():
    every = load_prompts()
    categories = list(dict.fromkeys(p.category for p in every))
    assert len(categories) == 8
    forty = load_prompts(limit=40, spread=True)
    assert [p.id for p in forty] == [p.id for p in every if sum(q.category == p.category for q in every[: every.index(p)]) < 5]
    two = load_prompts(limit=2, spread=True)  # one from each of the first two categories, not two writing prompts
    assert [p.category for p in two] == categories[:2] and two[0] == every[0]
    eleven = load_prompts(limit=11, spread=True)
    counts = {c: sum(p.category == c for p in eleven) for c in categories}
    assert list(counts.values()) == [2, 2, 2, 1, 1, 1, 1, 1] and eleven == sorted(eleven, key=every.index)


@pytest.mark.nightly  # SmolLM2 through the whole bench
def test_smollm2_eagle_matches_plain_greedy():
    target = load_target("smollm2-135m", dtype="float32")
    head = EagleHead.for_target(target, seed=0)
    prompts = load_prompts(limit=2)
    for tree, baselines in ((StaticTree(), ("hf",)), (DynamicTree(), ())):  # HF once: it does not depend on the tree
        report = run_bench(target, head, prompts, max_new_tokens=24, sampling=GREEDY, tree=tree, baselines=baselines,
                           progress=False)
        aggregate = report["aggregate"]
        assert aggregate["all_outputs_match_plain"] is True, [r["divergence"] for r in report["prompts"]]
        assert aggregate["all_hf_match_plain"] is (True if baselines else None)
        assert math.isfinite(aggregate["methods"]["eagle"]["tokens_per_second"])
