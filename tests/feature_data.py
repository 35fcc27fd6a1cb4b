"""A small feature dataset written straight to the layout of jobs/layout.py, for training-job tests that
should not pay for the data and feature jobs (those have their own tests)."""

from __future__ import annotations

import torch

from eagle.data import load_sharegpt, split, tokenize, tokenizer_fingerprint
from eagle.head import default_aux_layers
from eagle.target import Target
from jobs import layout
from jobs.storage import pack_records


def write_feature_dataset(
    storage_uri: str, target: Target, dataset: str, *, conversations: int = 24, max_length: int = 96, aux_layers: bool = False
) -> None:
    """ShareGPT conversations -> records with the target's own features (bf16; with ``aux_layers`` also the
    EAGLE-3 layers' ``aux_features``), train/eval shards, token counts and both manifests, exactly as the data
    and feature jobs would write them."""
    aux = list(default_aux_layers(target.config.num_hidden_layers)) if aux_layers else None
    storage = layout.dataset_storage(storage_uri, target.name, dataset)
    convs = load_sharegpt(limit=conversations)
    train, held_out = split(convs, eval_fraction=0.2)
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    base = {"target": target.name, "target_revision": target.revision, "tokenizer": tokenizer_fingerprint(target.tokenizer)}
    splits = {}
    for name, part in (("train", train), ("eval", held_out)):
        records = []
        for conv in part:
            tok = tokenize(target.tokenizer, conv, max_length)
            ids = torch.tensor(tok.input_ids, dtype=torch.long)
            mask = torch.tensor(tok.loss_mask, dtype=torch.uint8)
            with torch.no_grad():
                out = target.backbone(input_ids=ids[None].to(target.device), output_hidden_states=aux is not None)
            record = {"input_ids": ids.to(torch.int32), "loss_mask": mask, "features": out.last_hidden_state[0].to(torch.bfloat16).cpu()}
            if aux is not None:
                record["aux_features"] = torch.cat([out.hidden_states[i][0] for i in aux], dim=-1).to(torch.bfloat16).cpu()
            records.append(record)
            if name == "train":
                counts += torch.bincount(ids[mask.bool()], minlength=target.vocab_size)
        shard = layout.shard_name(0)
        packed = pack_records(records)
        data_part = {k: v for k, v in packed.items() if k not in ("features", "aux_features")}
        storage.write_tensors(f"{layout.DATA}/{name}/{shard}", data_part)
        storage.write_tensors(f"{layout.FEATURES}/{name}/{shard}", packed)
        splits[name] = {"shards": [shard], "records": len(records), "tokens": int(packed["input_ids"].numel())}
    storage.write_tensors(f"{layout.DATA}/{layout.TOKEN_COUNTS}", {"counts": counts})
    storage.write_json(f"{layout.DATA}/{layout.MANIFEST}", {"format": layout.DATA_FORMAT, **base, "splits": splits})
    storage.write_json(
        f"{layout.FEATURES}/{layout.MANIFEST}",
        {"format": layout.FEATURES_FORMAT, **base, "dtype": "bfloat16", "hidden_size": target.hidden_size, "aux_layers": aux, "splits": splits},
    )
