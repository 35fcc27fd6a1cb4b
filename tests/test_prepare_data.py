"""jobs.prepare_data: layout, manifest, loss masks, token counts, regeneration on Ray workers, resume, bad input.

Real components throughout: the packaged ShareGPT file, SmolLM2 and a local Ray cluster (2 CPUs). Tiny
datasets (12 conversations, 128 tokens, 8 answer tokens) keep each test to seconds.
"""

import json
import logging
import os
from dataclasses import replace

import pytest
import ray
import torch

from eagle.data import is_eval, load_sharegpt, tokenize
from eagle.errors import EagleError
from eagle.runtime import native_bf16, preferred_dtype
from jobs import layout
from jobs.prepare_data import (
    generate_answers,
    RegenStats,
    ShardWork,
    chat_prompt,
    main,
    prepare,
    regenerate_conversations,
    trim_at_eos,
    write_shard,
)
from jobs.presets import DataConfig, get_preset
from jobs.storage import Storage, unpack_records

TARGET = "smollm2-135m"
SMALL = dict(conversations=12, max_length=128, shard_records=4, eval_fraction=0.25)
REGEN = dict(SMALL, regenerate=True, regen_max_new_tokens=8, regen_batch_size=4)


def _preset(dataset="test", **data):
    return replace(get_preset("quick").with_overrides(data=data), dataset=dataset)


def _data(root) -> Storage:
    return layout.dataset_storage(str(root), TARGET, "test").child(layout.DATA)


def _shards(data: Storage, split: str) -> dict[str, tuple[list[str], list[dict]]]:
    """shard name -> (ids, records)."""
    out = {}
    for name in data.list(split):
        rel = f"{split}/{name}"
        ids = json.loads(data.read_tensor_metadata(rel)["ids"])
        out[name] = (ids, unpack_records(data.read_tensors(rel)))
    return out


def _assistant_runs(record) -> list[list[int]]:
    runs, current = [], []
    for token, masked in zip(record["input_ids"].tolist(), record["loss_mask"].tolist()):
        if masked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.fixture(scope="module")
def ray_cluster():
    if ray.is_initialized():  # an earlier test of this module ran a job in-process
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def conversations():
    return {c.id: c for c in load_sharegpt(limit=SMALL["conversations"])}


# ---- layout, manifest, masks, counts ------------------------------------------------------------------


def test_layout_manifest_masks_and_counts(tmp_path, smollm2, conversations):
    manifest = prepare(_preset(**SMALL), str(tmp_path), progress=False)
    data = _data(tmp_path)
    assert data.list() == sorted(["eval", "manifest.json", "token_counts.safetensors", "train"])
    assert data.read_json("manifest.json") == manifest
    assert manifest["format"] == layout.DATA_FORMAT
    assert manifest["target"] == TARGET and manifest["target_revision"].startswith("gguf-sha256:")
    assert manifest["tokenizer"].startswith("sha256:") and manifest["vocab_size"] == 49152
    assert manifest["source"] == "sharegpt" and manifest["source_file"].endswith(".json")
    assert manifest["config"]["conversations"] == 12 and manifest["regeneration"] is None

    tokenizer = smollm2.tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seen = {}
    for split in layout.SPLITS:
        shards = _shards(data, split)
        entry = manifest["splits"][split]
        assert entry["shards"] == sorted(shards) == [layout.shard_name(i) for i in range(len(shards))]
        raw = data.read_tensors(f"{split}/{entry['shards'][0]}")
        assert (raw["input_ids"].dtype, raw["loss_mask"].dtype, raw["offsets"].dtype) == (torch.int32, torch.uint8, torch.int64)
        records = [(i, r) for ids, recs in shards.values() for i, r in zip(ids, recs, strict=True)]
        assert entry["records"] == len(records) and entry["conversations"] >= len(records)
        assert entry["tokens"] == sum(len(r["input_ids"]) for _, r in records)
        assert entry["loss_tokens"] == sum(int(r["loss_mask"].sum()) for _, r in records)
        for conv_id, record in records:
            expected = tokenize(tokenizer, conversations[conv_id], SMALL["max_length"])
            assert record["input_ids"].tolist() == expected.input_ids
            assert record["loss_mask"].tolist() == expected.loss_mask
            assert len(record["input_ids"]) <= SMALL["max_length"] and record["loss_mask"].any()
            # Masked runs are exactly the assistant turns: each follows "<|im_start|>assistant\n" and ends with
            # "<|im_end|>" (unless max_length cut it).
            ids, mask = record["input_ids"].tolist(), record["loss_mask"].tolist()
            starts = [p for p in range(len(ids)) if mask[p] and (p == 0 or not mask[p - 1])]
            ends = [p for p in range(len(ids)) if mask[p] and (p + 1 == len(ids) or not mask[p + 1])]
            for start, end in zip(starts, ends, strict=True):
                assert tokenizer.decode(ids[:start]).endswith("<|im_start|>assistant\n")
                assert ids[end] == im_end or end + 1 == SMALL["max_length"]
            assert len(starts) <= sum(role == "assistant" for role, _ in conversations[conv_id].turns)
            assert is_eval(conv_id, SMALL["eval_fraction"]) == (split == "eval")
        seen[split] = {conv_id for conv_id, _ in records}
    assert seen["train"] and seen["eval"] and not seen["train"] & seen["eval"]

    counts = data.read_tensors("token_counts.safetensors")["counts"]
    assert counts.dtype == torch.int64 and counts.shape == (49152,)
    assert int(counts.sum()) == manifest["splits"]["train"]["loss_tokens"]


def test_complete_dataset_is_not_redone_and_other_settings_are_refused(tmp_path, caplog):
    first = prepare(_preset(**SMALL), str(tmp_path), progress=False)
    data = _data(tmp_path)
    mtimes = {name: os.stat(data.path("train", name)).st_mtime_ns for name in data.list("train")}
    with caplog.at_level(logging.INFO, logger="jobs.prepare_data"):
        again = prepare(_preset(**dict(SMALL, regen_workers=2)), str(tmp_path), progress=False)  # execution-only
    assert again == first and "already complete" in caplog.text
    assert mtimes == {name: os.stat(data.path("train", name)).st_mtime_ns for name in data.list("train")}
    with pytest.raises(EagleError, match=r"\(max_length differ\): choose another --dataset"):
        prepare(_preset(**dict(SMALL, max_length=96)), str(tmp_path), progress=False)


def test_shards_of_other_settings_are_not_mixed_in(tmp_path):
    prepare(_preset(**SMALL), str(tmp_path), progress=False)
    _data(tmp_path).fs.rm(_data(tmp_path).path("manifest.json"))
    with pytest.raises(EagleError, match="other settings"):
        prepare(_preset(**dict(SMALL, max_length=96)), str(tmp_path), progress=False)


# ---- regeneration -------------------------------------------------------------------------------------


def _greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    output = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=target.eos_token_ids,
        pad_token_id=target.eos_token_ids[0],
    )
    return trim_at_eos(output[0, len(prompt):].tolist(), target.eos_token_ids)


@pytest.mark.e2e  # Ray start-up + a target per worker: ~30-200 s on a shared 2-core machine
@pytest.mark.nightly
@pytest.mark.parametrize("workers", [1, 2])
def test_regeneration_on_ray_workers_is_greedy_decoding_by_the_target(tmp_path, ray_cluster, smollm2, conversations, workers):
    """fp32 so that batched (left-padded) greedy equals single-prompt greedy exactly (STACK.md)."""
    preset = _preset(**dict(REGEN, regen_workers=workers))
    manifest = prepare(preset, str(tmp_path), regen_dtype="float32", progress=False)
    regen = manifest["regeneration"]
    assert regen["dtype"] == "float32" and regen["answer_tokens"] > 0 and regen["tokens_per_second"] > 0
    tokenizer, eos = smollm2.tokenizer, smollm2.eos_token_ids
    compared = 0
    for split in layout.SPLITS:
        for ids, records in _shards(_data(tmp_path), split).values():
            for conv_id, record in zip(ids, records, strict=True):
                runs = _assistant_runs(record)
                assert len(runs) == 1  # regen_turns=1: one user turn, one answer
                question, original = conversations[conv_id].turns[0][1], conversations[conv_id].turns[1][1]
                expected = _greedy(smollm2, chat_prompt(tokenizer, [{"role": "user", "content": question}]), 8)
                assert expected[-1] in eos or len(expected) == 8  # stopped at EOS or hit the cap
                answer = tokenizer.decode(runs[0], skip_special_tokens=True).strip()
                assert answer == tokenizer.decode(expected, skip_special_tokens=True).strip()
                assert answer != original.strip()
                compared += 1
    assert compared == manifest["splits"]["train"]["records"] + manifest["splits"]["eval"]["records"] >= 6


def test_continuous_batching_regenerates_what_hf_generate_does(smollm2, conversations):
    """engine="eagle" (eagle.batch.BatchDecoder: answers leave the batch when done, the next prompt joins)
    gives HF generate's greedy answers token for token in float32, in the prompts' order."""
    tokenizer = smollm2.tokenizer
    prompts = [chat_prompt(tokenizer, [{"role": "user", "content": c.turns[0][1][:200]}]) for c in list(conversations.values())[:6]]
    assert len({len(p) for p in prompts}) > 1  # different lengths: rows finish and join at different steps
    hf = generate_answers(smollm2, prompts, max_new_tokens=20, batch_size=3)
    ours = generate_answers(smollm2, prompts, max_new_tokens=20, batch_size=3, engine="eagle")
    assert ours == hf
    # under max_length each prompt gets what fits after it (HF caps a whole batch by its shortest prompt)
    cap = max(map(len, prompts)) + 3
    capped = generate_answers(smollm2, prompts, max_new_tokens=20, batch_size=2, max_length=cap, engine="eagle")
    assert all(len(p) + len(a) <= cap and a == h[: len(a)] for p, a, h in zip(prompts, capped, hf))
    assert sorted(len(a) for a in capped) != sorted(len(a) for a in hf)  # the cap bound some answers
    with pytest.raises(EagleError, match="unknown regeneration engine"):
        generate_answers(smollm2, prompts, max_new_tokens=4, engine="vllm")


@pytest.mark.parametrize("engine", ["hf", "eagle"])
def test_multi_turn_regeneration_answers_each_turn_after_its_own_previous_answer(smollm2, engine):
    from eagle.data import Conversation

    # questions SmolLM2 answers within 16 tokens (a cut answer ends its conversation: the next test)
    conversations = [
        Conversation("a", (("user", "What is 2+2?"), ("assistant", "4."), ("user", "What is the capital of France?"), ("assistant", "Paris."))),
        Conversation("b", (("user", "Hi"), ("assistant", "Hi."), ("user", "Reply with one word: yes or no?"), ("assistant", "Yes."))),
    ]
    config = DataConfig(max_length=256, regenerate=True, regen_turns=2, regen_max_new_tokens=16, regen_batch_size=2, regen_engine=engine)
    regenerated, stats = regenerate_conversations(smollm2, conversations, config, seed=0)
    assert isinstance(stats, RegenStats) and stats.answers == 4 and stats.answer_tokens <= 4 * 16
    tokenizer = smollm2.tokenizer
    for before, after in zip(conversations, regenerated, strict=True):
        assert [role for role, _ in after.turns] == ["user", "assistant", "user", "assistant"]
        assert (after.turns[0], after.turns[2]) == (before.turns[0], before.turns[2])
        messages = [{"role": role, "content": text} for role, text in after.turns[:3]]
        expected = _greedy(smollm2, chat_prompt(tokenizer, messages), 16)
        assert expected[-1] in smollm2.eos_token_ids  # the premise: a finished answer
        assert after.turns[3][1] == tokenizer.decode(expected, skip_special_tokens=True)
        assert not after.unfinished


def test_an_answer_cut_at_the_token_cap_is_written_without_an_end_of_turn_marker(tmp_path, smollm2):
    """A regenerated answer that hit regen_max_new_tokens before EOS was never ended by the target: its record
    must not append <|im_end|> (the head would learn to draft a token the target did not say), and no later
    turn is asked after it. An answer that stopped at EOS keeps its <|im_end|>, inside the loss mask."""
    from eagle.data import Conversation

    conversations = [
        Conversation("finished", (("user", "What is the capital of France?"), ("assistant", "x"))),
        Conversation("cut", (("user", "Write a long essay about the history of the Roman Empire."), ("assistant", "x"), ("user", "Hi"), ("assistant", "x"))),
    ]
    cap = 16
    config = DataConfig(max_length=256, regenerate=True, regen_turns=2, regen_max_new_tokens=cap, regen_batch_size=2)
    regenerated, _ = regenerate_conversations(smollm2, conversations, config, seed=0)
    tokenizer, eos = smollm2.tokenizer, smollm2.eos_token_ids
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = [_greedy(smollm2, chat_prompt(tokenizer, [{"role": "user", "content": c.turns[0][1]}]), cap) for c in conversations]
    assert expected[0][-1] in eos and expected[1][-1] not in eos and len(expected[1]) == cap  # the premise
    by_id = {c.id: c for c in regenerated}
    assert (by_id["finished"].unfinished, by_id["cut"].unfinished) == (False, True)
    assert [role for role, _ in by_id["cut"].turns] == ["user", "assistant"]  # "Hi" is not asked after the cut

    shard = ShardWork("train", 0, tuple(conversations), seed=0)
    storage = Storage(str(tmp_path))
    assert write_shard(storage, shard, regenerated, tokenizer, config, "sha256:test") == 2
    ids = json.loads(storage.read_tensor_metadata(shard.rel)["ids"])
    records = dict(zip(ids, unpack_records(storage.read_tensors(shard.rel)), strict=True))
    for conv_id, answer in zip(("finished", "cut"), expected, strict=True):
        input_ids, mask = records[conv_id]["input_ids"].tolist(), records[conv_id]["loss_mask"].tolist()
        [run] = _assistant_runs(records[conv_id])
        assert tokenizer.decode(run, skip_special_tokens=True) == tokenizer.decode(answer, skip_special_tokens=True)
        if conv_id == "finished":
            assert run[-1] == im_end and input_ids.count(im_end) == 3  # system, user and the answer each end
        else:  # the record ends on the answer's last token, as the target left it
            assert im_end not in run and mask[-1] == 1 and input_ids.count(im_end) == 2


def test_prompts_that_leave_no_room_are_dropped(smollm2):
    from eagle.data import Conversation

    long_question = "Explain this. " * 80
    conversations = [Conversation("long", (("user", long_question), ("assistant", "x"))), Conversation("ok", (("user", "Hi"), ("assistant", "x")))]
    config = DataConfig(max_length=64, regenerate=True, regen_max_new_tokens=4)
    regenerated, stats = regenerate_conversations(smollm2, conversations, config, seed=0)
    assert [c.id for c in regenerated] == ["ok"] and stats.answers == 1


# ---- resume -------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.nightly
def test_rerun_rewrites_only_the_missing_shard(tmp_path, ray_cluster, monkeypatch):
    preset = _preset(**REGEN)
    first = prepare(preset, str(tmp_path), progress=False)
    # the default "auto" resolved on this driver: the dtype that ran is what the manifest and identity record
    assert first["regeneration"]["dtype"] == preferred_dtype("auto") == ("bfloat16" if native_bf16() else "float32")
    data = _data(tmp_path)
    names = data.list("train")
    assert len(names) >= 2
    mtimes = {name: os.stat(data.path("train", name)).st_mtime_ns for name in names}
    eval_mtimes = {name: os.stat(data.path("eval", name)).st_mtime_ns for name in data.list("eval")}
    before = data.read_tensors(f"train/{names[1]}")
    data.fs.rm(data.path("train", names[1]))
    data.fs.rm(data.path("manifest.json"))

    import jobs.prepare_data as job

    regenerated = []
    real = job.regenerate_shards
    monkeypatch.setattr(job, "regenerate_shards", lambda todo, *a, **k: (regenerated.extend(s.rel for s in todo), real(todo, *a, **k)))
    second = prepare(preset, str(tmp_path), progress=False)
    assert regenerated == [f"data/train/{names[1]}"]
    assert {n: os.stat(data.path("train", n)).st_mtime_ns for n in names if n != names[1]} == {n: t for n, t in mtimes.items() if n != names[1]}
    assert {n: os.stat(data.path("eval", n)).st_mtime_ns for n in data.list("eval")} == eval_mtimes
    after = data.read_tensors(f"train/{names[1]}")
    assert all(torch.equal(before[k], after[k]) for k in before)  # greedy: the same answers again
    assert second["splits"] == first["splits"]
    assert second["regeneration"]["answer_tokens"] == first["regeneration"]["answer_tokens"]


# ---- bad input ----------------------------------------------------------------------------------------


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("prepare_data: error: ")
    return err[0]


def test_unknown_target_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--target", "no-such-model", "--storage", str(tmp_path / "store"), "--conversations", "4"]) == 2
    assert "unknown target 'no-such-model'" in _one_error_line(capsys)
    assert not (tmp_path / "store").exists()


def test_unwritable_storage_is_one_line_and_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["--storage", str(blocker / "store"), "--conversations", "4"]) == 2
    assert "cannot write" in _one_error_line(capsys)
    assert blocker.read_text() == "not a folder" and list(tmp_path.iterdir()) == [blocker]


def test_missing_sharegpt_file_and_bad_settings_are_one_line(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["--storage", str(store), "--sharegpt", str(tmp_path / "missing.json")]) == 2
    assert "missing.json does not exist" in _one_error_line(capsys)
    assert main(["--storage", str(store), "--regen-batch-size", "0"]) == 2
    assert "regen_batch_size must be >= 1" in _one_error_line(capsys)
    assert main(["--storage", str(store), "--preset", "nope"]) == 2
    assert "unknown preset" in _one_error_line(capsys)
    assert not [p for p in store.rglob("*") if p.is_file()]


def test_the_cli_ends_with_the_manifest_summary_on_stdout(tmp_path, capsys):
    assert main(["--storage", str(tmp_path), "--dataset", "cli", "--conversations", "6", "--max-length", "128", "--shard-records", "4"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = layout.dataset_storage(str(tmp_path), TARGET, "cli").read_json(f"{layout.DATA}/{layout.MANIFEST}")
    assert summary["splits"] == manifest["splits"] and summary["dataset"] == "cli" and summary["regeneration"] is None


def test_cli_overrides_reach_the_data_config(tmp_path):
    from jobs.prepare_data import build_parser, preset_from_args

    args = build_parser().parse_args(
        ["--preset", "quick", "--dataset", "d", "--conversations", "7", "--regenerate", "--regen-temperature", "0.5",
         "--regen-max-new-tokens", "9", "--regen-batch-size", "3", "--regen-workers", "2", "--max-length", "99"]
    )
    preset = preset_from_args(args)
    assert preset.dataset == "d" and preset.target == TARGET
    data = preset.data
    assert (data.conversations, data.regenerate, data.regen_temperature, data.regen_max_new_tokens) == (7, True, 0.5, 9)
    assert (data.regen_batch_size, data.regen_workers, data.max_length) == (3, 2, 99)
    assert preset_from_args(build_parser().parse_args([])).data == get_preset("quick").data


def test_regeneration_on_a_gpu_is_another_dataset_and_needs_one(tmp_path, capsys):
    """``regen_gpus``: how fast, not what, except that GPU kernels round differently, so a dataset regenerated
    on a GPU has its own identity (a CPU one keeps the identity it had before the field); a worker that sees
    no GPU fails at load with one line, and a negative count is refused."""
    from jobs.prepare_data import RegenerationWorker, content_settings

    cpu = DataConfig(regenerate=True)
    assert content_settings(cpu, "bfloat16") == content_settings(replace(cpu, regen_workers=4), "bfloat16")
    assert "regen_gpus" not in content_settings(cpu, "bfloat16") and "regen_device" not in content_settings(cpu, "bfloat16")
    assert content_settings(replace(cpu, regen_gpus=1), "bfloat16")["regen_device"] == "cuda"
    assert content_settings(replace(cpu, regen_gpus=0.5), "bfloat16") == content_settings(replace(cpu, regen_gpus=1), "bfloat16")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not visible:
        with pytest.raises(EagleError, match="this process sees 0 CUDA GPU"):
            RegenerationWorker(TARGET, "bfloat16", replace(cpu, regen_gpus=1), threads=1)
    assert main(["--storage", str(tmp_path / "store"), "--regen-gpus", "-1"]) == 2
    assert "regen_gpus must be >= 0" in _one_error_line(capsys)
