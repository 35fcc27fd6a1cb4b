"""Where the jobs put things under a storage URI, and the formats of what they write.

```
<storage>/<target>/<dataset>/
    data/manifest.json                  format eagle-data/1: target, revision, tokenizer, source, counts
    data/token_counts.safetensors       counts[vocab] of the train split's loss-masked tokens (draft vocab)
    data/<split>/shard-00000.safetensors   input_ids int32, loss_mask uint8, offsets int64; meta "ids"
    features/manifest.json              format eagle-features/1: target, revision, tokenizer, dtype, counts
    features/<split>/shard-00000.safetensors  the data shard's tensors + features [tokens, hidden]
                                        (+ aux_features [tokens, 3*hidden] with EAGLE-3 low/mid/high layers)
```

``<split>`` is ``train`` or ``eval``. Feature shard i is made from data shard i of the same split, so a
rerun skips exactly the shards that exist. A manifest is written last: its presence means the stage is
complete (DESIGN.md "Names on disk").
"""

from __future__ import annotations

import json
from typing import Iterator

from eagle.errors import EagleError
from jobs.storage import Storage, unpack_records

DATA_FORMAT = "eagle-data/1"
FEATURES_FORMAT = "eagle-features/1"
DATA = "data"
FEATURES = "features"
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
TOKEN_COUNTS = "token_counts.safetensors"
STAGE_FORMATS = {DATA: DATA_FORMAT, FEATURES: FEATURES_FORMAT}
STAGE_JOBS = {DATA: "jobs.prepare_data", FEATURES: "jobs.featurize"}


def dataset_storage(storage_uri: str, target_name: str, dataset: str) -> Storage:
    """The root of one dataset of one target (both names checked: they become path components)."""
    from eagle_platform.registry import check_name

    return Storage(storage_uri).child(check_name(target_name, "target name"), check_name(dataset, "dataset name"))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"



def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__", {}) or {}


def shard_names(manifest: dict, split: str) -> list[str]:
    """Shard names of one split in a data or features manifest (entries are names or ``{"name": ...}`` dicts)."""
    entries = ((manifest.get("splits") or {}).get(split) or {}).get("shards") or []
    return [entry["name"] if isinstance(entry, dict) else str(entry) for entry in entries]


def read_manifest(dataset: Storage, stage: str) -> dict:
    """The manifest of ``stage`` (``DATA`` or ``FEATURES``) of a dataset root; ``EagleError`` when that stage has
    not completed there (no manifest) or was written in another format."""
    rel = f"{stage}/{MANIFEST}"
    if not dataset.exists(rel):
        raise EagleError(f"no {stage} at {dataset.url(stage)}: run {STAGE_JOBS[stage]} first")
    try:
        manifest = dataset.read_json(rel)
    except json.JSONDecodeError as err:
        raise EagleError(f"{dataset.url(rel)} is not valid JSON: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != STAGE_FORMATS[stage]:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise EagleError(f"{dataset.url(rel)} has format {found!r}, expected {STAGE_FORMATS[stage]!r}")
    return manifest


def iter_records(dataset: Storage, stage: str, split: str, *, rank: int = 0, world: int = 1) -> Iterator[dict]:
    """The one reader of a stage's shards, for every rank of every job: yields this rank's records of ``split``,
    one shard in memory at a time, in the manifest's order. Ranks get disjoint records that together are the
    whole split: shards ``rank::world`` when there are at least ``world`` shards, else records
    ``rank::world`` of the split (a split smaller than the world must not leave a rank idle or give two
    ranks the same records).

    Each record holds the shard's tensors sliced to it (``input_ids`` int32 [n], ``loss_mask`` uint8 [n];
    feature shards also ``features`` [n, hidden] and, made with ``aux_layers``, ``aux_features``
    [n, 3*hidden]) and ``id`` when the shard's metadata lists one id per record.
    """
    if not 0 <= rank < world:
        raise EagleError(f"rank {rank} is not in a world of {world}")
    manifest = read_manifest(dataset, stage)
    if split not in (manifest.get("splits") or {}):
        raise EagleError(f"the {stage} at {dataset.url(stage)} have no {split!r} split")
    shards = shard_names(manifest, split)
    by_shard = len(shards) >= world
    from safetensors.torch import load as st_load

    index = 0  # the record's position in the split (record-level sharing)
    for shard in shards[rank::world] if by_shard else shards:
        data = dataset.read_bytes(f"{stage}/{split}/{shard}")
        tensors = st_load(data)
        try:
            ids = json.loads(safetensors_metadata(data).get("ids", "null"))
        except (json.JSONDecodeError, TypeError):
            ids = None
        records = unpack_records(tensors)
        named = isinstance(ids, list) and len(ids) == len(records)
        for i, record in enumerate(records):
            mine = by_shard or index % world == rank
            index += 1
            if not mine:
                continue
            if named:
                record["id"] = ids[i]
            yield record


def load_records(dataset: Storage, stage: str, split: str, *, rank: int = 0, world: int = 1) -> list[dict]:
    """All of :func:`iter_records` as a list (fine for CPU-sized datasets)."""
    return list(iter_records(dataset, stage, split, rank=rank, world=world))
