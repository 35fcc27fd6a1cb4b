"""The feature job (jobs/featurize.py) on a tiny random-weight LLaMA saved as a Hugging Face directory.

One 2-worker Ray Train run (gloo, DeepSpeed ZeRO-3) on 3 train shards + 1 eval shard is shared by the
module: each rank must hold about half of the parameters, the features must equal the plain unsharded
model's (fp32), reruns must skip the shards that exist. Input validation runs in-process without Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from eagle.data import tokenizer_fingerprint
from eagle.errors import EagleError
from eagle.target import directory_revision, resolve_target
from jobs import layout
from jobs.featurize import batch_by_tokens, featurize, main
from eagle.head import default_aux_layers
from jobs.presets import get_preset
from jobs.storage import Storage, pack_records

VOCAB = 49152  # SmolLM2's tokenizer, saved beside the tiny model so load_target / fingerprints work
LAYERS = 8  # aux layers 2, 4, 5: distinct
DATASET = "tiny-set"


def make_tiny_target_dir(root: Path, *, layers: int = LAYERS, hidden: int = 32) -> Path:
    """A random-weight LLaMA (fp32 safetensors) + the SmolLM2 tokenizer, as a local target directory."""
    from transformers import AutoTokenizer

    from tests.tiny import tiny_target

    directory = root / "tiny-llama"
    if (directory / "config.json").is_file():
        return directory
    target = tiny_target("llama", vocab_size=VOCAB, hidden_size=hidden, layers=layers, dtype=torch.float32, seed=3)
    target.model.save_pretrained(directory, safe_serialization=True)
    smol_dir, _, _ = resolve_target("smollm2-135m")
    AutoTokenizer.from_pretrained(smol_dir, local_files_only=True).save_pretrained(directory)
    return directory


def write_data(storage_uri: str, target_dir: Path, *, shards: dict[str, list[int]], seed: int = 0, revision: str | None = None) -> dict:
    """Data shards + data/manifest.json as jobs.prepare_data writes them; ``shards[split]`` = records per
    shard. Returns {(split, shard name): [records]}."""
    from transformers import AutoTokenizer

    dataset = Storage(storage_uri).child(target_dir.name, DATASET)
    generator = torch.Generator().manual_seed(seed)
    written = {}
    manifest_splits = {}
    for split, counts in shards.items():
        entries = []
        for index, count in enumerate(counts):
            records = []
            for _ in range(count):
                n = int(torch.randint(3, 40, (1,), generator=generator))
                records.append({
                    "input_ids": torch.randint(0, VOCAB, (n,), generator=generator, dtype=torch.int32),
                    "loss_mask": (torch.rand(n, generator=generator) > 0.4).to(torch.uint8),
                })
            name = layout.shard_name(index)
            ids = [f"{split}-{index}-{i}" for i in range(count)]
            dataset.write_tensors(f"{layout.DATA}/{split}/{name}", pack_records(records), metadata={"ids": json.dumps(ids)})
            entries.append({"name": name, "records": count, "tokens": sum(len(r["input_ids"]) for r in records)})
            written[(split, name)] = records
        manifest_splits[split] = {"shards": entries}
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    dataset.write_json(f"{layout.DATA}/{layout.MANIFEST}", {
        "format": layout.DATA_FORMAT,
        "target": target_dir.name,
        "target_revision": revision or directory_revision(target_dir),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "splits": manifest_splits,
    })
    return written


def tiny_preset(**features):
    # persistence_threshold 0: every parameter partitions (the tiny model's layers sit below DeepSpeed's default
    # 1e5 elements and would stay whole on every rank, leaving only the embedding and LM head to split)
    settings = {"workers": 2, "zero_stage": 3, "dtype": "float32", "batch_tokens": 96, "aux_layers": True, "persistence_threshold": 0, **features}
    preset = get_preset("quick").with_overrides(features=settings)
    import dataclasses

    return dataclasses.replace(preset, dataset=DATASET)


def reference_features(target_dir: Path, records: list[dict], aux: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The plain (unsharded, unbatched) fp32 model's last hidden state and aux hidden states per record."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = []
    with torch.no_grad():
        for record in records:
            result = model.model(record["input_ids"].long()[None], output_hidden_states=True)
            aux_states = torch.cat([result.hidden_states[i][0] for i in aux], dim=-1)
            out.append((result.last_hidden_state[0], aux_states))
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_target_dir(tmp_path_factory.mktemp("targets"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dir):
    """One 2-worker ZeRO-3 run: 3 train shards (rank 0 gets 2, rank 1 one -> dummy forwards) + 1 eval."""
    storage = str(tmp_path_factory.mktemp("storage"))
    data = write_data(storage, tiny_dir, shards={"train": [7, 5, 6], "eval": [4]})
    started = time.perf_counter()
    manifest = featurize(tiny_preset(), storage, target_spec=str(tiny_dir), progress=False)
    return {"storage": storage, "data": data, "manifest": manifest, "seconds": time.perf_counter() - started}


def dataset_of(run_, tiny_dir) -> Storage:
    return Storage(run_["storage"]).child(tiny_dir.name, DATASET)


# ---- pure helpers --------------------------------------------------------------------------------------


def test_batches_respect_the_padded_token_budget():
    lengths = [5, 30, 12, 12, 40, 3, 100, 0]
    batches = batch_by_tokens(lengths, 48)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths) - 1))  # the empty record needs no forward
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 48
    assert [6] in batches  # longer than the budget: alone


def test_aux_layers_are_eagle3_low_mid_high():
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(30) == (2, 15, 27)
    assert all(0 <= i < 2 for i in default_aux_layers(2))


# ---- validation (no Ray) ---------------------------------------------------------------------------------


def test_missing_data_manifest_is_one_line_exit_2(tmp_path, tiny_dir, capsys):
    code = main(["--target", str(tiny_dir), "--dataset", DATASET, "--storage", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "run jobs.prepare_data first" in err


def test_mismatched_data_revision_is_one_line_exit_2(tmp_path, tiny_dir, capsys):
    write_data(str(tmp_path), tiny_dir, shards={"train": [2]}, revision="dir-sha256:someoneelse")
    code = main(["--target", str(tiny_dir), "--dataset", DATASET, "--storage", str(tmp_path), "--workers", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "revision" in err and "someoneelse" in err
    assert not Storage(str(tmp_path)).child(tiny_dir.name, DATASET).exists(layout.FEATURES)


def _writable(directory: Path) -> bool:
    probe = directory / ".probe"
    try:
        probe.write_bytes(b"")
    except OSError:
        return False
    probe.unlink()
    return True


def test_unwritable_storage_is_one_line_exit_2(tmp_path, tiny_dir, capsys):
    write_data(str(tmp_path), tiny_dir, shards={"train": [2]})
    dataset_dir = tmp_path / tiny_dir.name / DATASET
    os.chmod(dataset_dir, 0o555)
    immutable = False
    try:
        if _writable(dataset_dir):  # root ignores modes: make the folder immutable instead
            immutable = subprocess.run(["chattr", "+i", str(dataset_dir)], capture_output=True).returncode == 0
            if not immutable or _writable(dataset_dir):
                pytest.skip("cannot make a folder unwritable here")
        code = main(["--target", str(tiny_dir), "--dataset", DATASET, "--storage", str(tmp_path)])
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(dataset_dir)], check=False)
        os.chmod(dataset_dir, 0o755)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot write" in err


# ---- the 2-worker ZeRO-3 run -----------------------------------------------------------------------------


@pytest.mark.e2e  # shares the ~1 minute 2-worker Ray run
@pytest.mark.nightly
def test_zero3_partitions_the_target_across_the_two_ranks(run):
    partition = run["manifest"]["partition"]
    total = partition["total_numel"]
    per_rank = partition["per_rank_numel"]
    assert len(per_rank) == 2
    for numel in per_rank:
        assert abs(numel - total / 2) <= 0.01 * total, (per_rank, total)
    # and after the forward passes, not only at load: each rank holds its half and nothing stayed gathered
    for resident in partition["per_rank_resident_numel"]:
        assert abs(resident - total / 2) <= 0.01 * total, (partition["per_rank_resident_numel"], total)
    # every rank ran the same number of forward passes (real + dummy): the collectives stayed in step
    steps = [f + d for f, d in zip(partition["forwards"], partition["dummy_forwards"])]
    assert steps[0] == steps[1] and sum(partition["dummy_forwards"]) > 0


@pytest.mark.e2e  # shares the ~1 minute 2-worker Ray run
@pytest.mark.nightly
def test_manifest_describes_the_features(run, tiny_dir):
    manifest = run["manifest"]
    dataset = dataset_of(run, tiny_dir)
    assert dataset.read_json(f"{layout.FEATURES}/{layout.MANIFEST}") == manifest == layout.read_manifest(dataset, layout.FEATURES)
    assert manifest["format"] == layout.FEATURES_FORMAT
    assert manifest["target"] == tiny_dir.name and manifest["target_revision"] == directory_revision(tiny_dir)
    assert manifest["dtype"] == "float32" and manifest["hidden_size"] == 32 and manifest["layers"] == LAYERS
    assert manifest["aux_layers"] == list(default_aux_layers(LAYERS))
    assert manifest["workers"] == 2 and manifest["zero_stage"] == 3
    assert manifest["data_manifest_sha256"].startswith("sha256:")
    assert manifest["throughput"]["tokens_per_s"] > 0
    for split, counts in {"train": [7, 5, 6], "eval": [4]}.items():
        entry = manifest["splits"][split]
        assert [s["records"] for s in entry["shards"]] == counts and entry["records"] == sum(counts)
        expected_tokens = sum(len(r["input_ids"]) for (s, _), recs in run["data"].items() if s == split for r in recs)
        assert entry["tokens"] == expected_tokens


@pytest.mark.e2e  # shares the ~1 minute 2-worker Ray run
@pytest.mark.nightly
def test_sharded_features_equal_the_unsharded_model(run, tiny_dir):
    dataset = dataset_of(run, tiny_dir)
    aux = run["manifest"]["aux_layers"]
    for split in ("train", "eval"):
        records = layout.load_records(dataset, layout.FEATURES, split)
        source = [r for (s, _), recs in sorted(run["data"].items()) if s == split for r in recs]
        assert len(records) == len(source)
        reference = reference_features(tiny_dir, source, aux)
        for got, want, (features, aux_features) in zip(records, source, reference):
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
            assert got["features"].dtype == torch.float32 and got["features"].shape == (len(want["input_ids"]), 32)
            torch.testing.assert_close(got["features"], features, atol=1e-4, rtol=1e-4)
            assert got["aux_features"].shape == (len(want["input_ids"]), 96)
            torch.testing.assert_close(got["aux_features"], aux_features, atol=1e-4, rtol=1e-4)
        assert records[0]["id"] == f"{split}-0-0"


@pytest.mark.e2e  # shares the ~1 minute 2-worker Ray run
@pytest.mark.nightly
def test_trainer_ranks_read_disjoint_shards(run, tiny_dir):
    """Through ``jobs.layout.iter_records``, the reader jobs.train_head calls on every rank."""
    dataset = dataset_of(run, tiny_dir)
    rank0 = [r["id"] for r in layout.iter_records(dataset, layout.FEATURES, "train", rank=0, world=2)]
    rank1 = [r["id"] for r in layout.iter_records(dataset, layout.FEATURES, "train", rank=1, world=2)]
    assert len(rank0) == 7 + 6 and len(rank1) == 5 and not set(rank0) & set(rank1)


def _stage(tmp_path, shards: list[int]):
    """A data stage of one split with ``shards[i]`` records in shard i (ids ``s<i>-<j>``) and its manifest."""
    dataset = Storage(str(tmp_path))
    names = []
    for i, count in enumerate(shards):
        records = [{"input_ids": torch.arange(3 + j, dtype=torch.int32), "loss_mask": torch.ones(3 + j, dtype=torch.uint8)} for j in range(count)]
        ids = [f"s{i}-{j}" for j in range(count)]
        dataset.write_tensors(f"{layout.DATA}/train/{layout.shard_name(i)}", pack_records(records), metadata={"ids": json.dumps(ids)})
        names.append(layout.shard_name(i))
    dataset.write_json(f"{layout.DATA}/{layout.MANIFEST}", {"format": layout.DATA_FORMAT, "splits": {"train": {"shards": names}}})
    return dataset


@pytest.mark.parametrize("shards, world", [([4, 3, 2], 2), ([4, 3, 2], 3), ([5], 2), ([2, 3], 4), ([1], 3)])
def test_the_one_reader_gives_every_rank_disjoint_records_that_cover_the_split(tmp_path, shards, world):
    dataset = _stage(tmp_path, shards)
    per_rank = [[r["id"] for r in layout.iter_records(dataset, layout.DATA, "train", rank=rank, world=world)] for rank in range(world)]
    everything = [r["id"] for r in layout.load_records(dataset, layout.DATA, "train")]
    assert len(everything) == sum(shards)
    assert sorted(sum(per_rank, [])) == sorted(everything)  # disjoint and complete
    if sum(shards) >= world:
        assert all(per_rank), per_rank  # no idle rank (fewer shards than ranks: records are shared out)
    record = layout.load_records(dataset, layout.DATA, "train")[-1]  # sliced at its own offsets
    assert record["id"] == f"s{len(shards) - 1}-{shards[-1] - 1}" and record["input_ids"].tolist() == list(range(2 + shards[-1]))


def test_the_reader_refuses_a_missing_or_foreign_manifest(tmp_path):
    dataset = Storage(str(tmp_path))
    with pytest.raises(EagleError, match="run jobs.prepare_data first"):
        layout.load_records(dataset, layout.DATA, "train")
    dataset.write_json(f"{layout.FEATURES}/{layout.MANIFEST}", {"format": "eagle-features/0"})
    with pytest.raises(EagleError, match="expected 'eagle-features/1'"):
        layout.load_records(dataset, layout.FEATURES, "train")


@pytest.mark.e2e  # shares the ~1 minute 2-worker Ray run
@pytest.mark.nightly
def test_rerun_skips_completed_shards(run, tiny_dir):
    dataset = dataset_of(run, tiny_dir)
    shard_dir = Path(dataset.path(layout.FEATURES, "train"))
    before = {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    started = time.perf_counter()
    manifest = featurize(tiny_preset(), run["storage"], target_spec=str(tiny_dir), progress=False)
    assert time.perf_counter() - started < 15  # no workers started
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()} == before
    assert manifest["splits"] == run["manifest"]["splits"]
    assert manifest["throughput"] == run["manifest"]["throughput"]  # what the computing run measured


@pytest.mark.e2e
@pytest.mark.nightly
def test_rerun_recomputes_only_a_missing_shard(run, tiny_dir):
    dataset = dataset_of(run, tiny_dir)
    shard_dir = Path(dataset.path(layout.FEATURES, "train"))
    original = dataset.read_tensors(f"{layout.FEATURES}/train/shard-00001.safetensors")
    (shard_dir / "shard-00001.safetensors").unlink()
    others = {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    # the replicated path (zero_stage 0, no DeepSpeed) must produce the same features
    manifest = featurize(tiny_preset(workers=1, zero_stage=0), run["storage"], target_spec=str(tiny_dir), progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir() if p.name in others} == others
    assert manifest["throughput"]["shards"] == 1 and manifest["workers"] == 1 and manifest["zero_stage"] == 0
    again = dataset.read_tensors(f"{layout.FEATURES}/train/shard-00001.safetensors")
    torch.testing.assert_close(again["features"], original["features"], atol=1e-4, rtol=1e-4)
