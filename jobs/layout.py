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

from jobs.storage import Storage

DATA_FORMAT = "eagle-data/1"
FEATURES_FORMAT = "eagle-features/1"
DATA = "data"
FEATURES = "features"
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
TOKEN_COUNTS = "token_counts.safetensors"


def dataset_storage(storage_uri: str, target_name: str, dataset: str) -> Storage:
    """The root of one dataset of one target (both names checked: they become path components)."""
    from eagle_platform.registry import check_name

    return Storage(storage_uri).child(check_name(target_name, "target name"), check_name(dataset, "dataset name"))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"

