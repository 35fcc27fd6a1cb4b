"""Feature stage of offline EAGLE head training: the frozen target turns data shards into feature shards.

``python -m jobs.featurize --preset quick [--target SPEC] [--dataset NAME] [--storage URI] [--workers N]
[--aux-layers]``

What it does (layout: ``jobs/layout.py``):

1. Validates before any worker starts: the target resolves and its architecture is supported, the data
   manifest ``<storage>/<target>/<dataset>/data/manifest.json`` exists and names the same target revision
   and tokenizer fingerprint, the storage root is writable. Any of these -> one line, exit 2.
2. Runs ``workers`` Ray Train workers (``TorchTrainer``; gloo on CPU, nccl on GPU). Each builds the frozen
   target under DeepSpeed ZeRO-3 (``jobs.frozen_target.load_frozen_target_zero3``): the weights are *partitioned* across
   the ranks (each holds ~1/N of every parameter) and gathered one module at a time during the forward.
   ZeRO-3 all-gathers are collective, so every rank runs the same number of forward passes: pending shards
   go round-robin to the ranks and each step all ranks agree (one all-reduce of a flag) whether anyone still
   has a batch; a rank that has none runs a one-token dummy forward.
3. Per data shard ``data/<split>/shard-i``: records are batched by padded tokens (``batch_tokens``, right
   padding + attention mask), the backbone runs under ``torch.no_grad`` and the post-final-norm last
   hidden state (the feature feeding the LM head, EAGLE arXiv 2401.15077 s3) is kept for each record's real
   tokens. With ``aux_layers``, the inputs of decoder layers ``2, L//2, L-3`` (EAGLE-3's low/mid/high
   features, arXiv 2503.01840) are stored too as ``aux_features [tokens, 3*hidden]``. The shard is written
   as ``features/<split>/shard-i`` as soon as it is done (atomic), so a rerun skips the shards that exist
   (and recomputes one whose metadata names another target revision, dtype or data manifest).
4. The driver writes ``features/manifest.json`` (``eagle-features/1``) last.

Reading features back for training: ``jobs.layout.iter_records`` / ``load_records`` (the one reader of
every stage's shards, the trainer's too). The frozen target under ZeRO-3 (``load_frozen_target_zero3``,
``FeatureExtractor``) is in ``jobs/frozen_target.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from eagle.errors import EagleError
from eagle.head import default_aux_layers
from eagle.runtime import preferred_dtype, use_threads
from jobs import layout
from eagle.target import cache_root
from jobs.common import init_ray, job_parser, run_job, setup_logging, torch_extensions_dir
from jobs.frozen_target import DTYPES, load_frozen_target_zero3, partition_numel, resident_numel, zero3_config
from jobs.presets import Preset, get_preset
from jobs.storage import Storage

logger = logging.getLogger("jobs.featurize")

# Environment variables a worker needs to reach the same storage and caches as the driver (the driver's
# values win over the worker's).
FORWARDED_ENV = (
    "EAGLE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION", "EAGLE_CACHE_DIR",
    "HF_HUB_OFFLINE", "TORCH_EXTENSIONS_DIR", "TOKENIZERS_PARALLELISM",
)
# Credentials are forwarded only to a Ray instance this process started on its own host (no RAY_ADDRESS):
# on a real cluster (``ray job submit``) workers take them from their own environment or instance role, so
# secrets never travel through the job's config.
FORWARDED_LOCAL_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


# ---------------------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------------------


def batch_by_tokens(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group record indices so that ``len(batch) * longest <= batch_tokens`` (a longer record goes alone);
    records are taken longest first, so batches hold similar lengths and little padding. Empty records
    need no forward and are left out."""
    order = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


@dataclasses.dataclass(frozen=True)
class FeatureJob:
    """What the driver hands every featurize worker (Ray pickles it to them as it is)."""

    hf_dir: str
    dataset_uri: str
    dtype: str
    zero_stage: int
    use_gpu: bool
    batch_tokens: int
    hidden_size: int
    target_revision: str
    data_manifest_sha256: str
    aux_layers: list[int] | None = None  # the layers an EAGLE-3 head reads, stored beside the final features
    persistence_threshold: int | None = None
    progress: bool = False
    verbose: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # the driver's storage endpoint, caches, credentials
    tasks: tuple[tuple[str, str], ...] = ()  # (split, shard) to compute, split across the ranks


def _expected_meta(job: FeatureJob) -> dict[str, str]:
    return {
        "format": layout.FEATURES_FORMAT,
        "target_revision": job.target_revision,
        "dtype": job.dtype,
        "aux_layers": json.dumps(list(job.aux_layers or [])),
        "data_manifest_sha256": job.data_manifest_sha256,
    }


def _shard_is_current(storage: Storage, rel: str, expected: dict[str, str]) -> bool:
    if not storage.exists(rel):
        return False
    try:
        meta = storage.read_tensor_metadata(rel)
    except Exception:  # an unreadable header: recompute it
        return False
    stale = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
    if stale:
        logger.warning("recomputing %s: made with other settings %s", storage.url(rel), stale)
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# The Ray Train worker
# ---------------------------------------------------------------------------------------------------------


class _ShardWork:
    """One data shard being featurized on this rank: its batches and the features filled in so far."""

    def __init__(self, storage: Storage, split: str, name: str, job: FeatureJob) -> None:
        self.split, self.name = split, name
        data = storage.read_bytes(f"{layout.DATA}/{split}/{name}")
        from safetensors.torch import load as st_load

        self.meta = layout.safetensors_metadata(data)
        self.tensors = st_load(data)
        offsets = self.tensors["offsets"].tolist()
        self.spans = list(zip(offsets[:-1], offsets[1:]))
        self.tokens = offsets[-1]
        lengths = [b - a for a, b in self.spans]
        self.batches = batch_by_tokens(lengths, job.batch_tokens)
        self.done = 0
        dtype = DTYPES[job.dtype]
        self.features = torch.empty(self.tokens, job.hidden_size, dtype=dtype)
        self.aux = torch.empty(self.tokens, 3 * job.hidden_size, dtype=dtype) if job.aux_layers else None

    def batch(self, index: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        records = self.batches[index]
        longest = max(self.spans[r][1] - self.spans[r][0] for r in records)
        ids = torch.zeros(len(records), longest, dtype=torch.long)
        mask = torch.zeros(len(records), longest, dtype=torch.long)
        for row, r in enumerate(records):
            a, b = self.spans[r]
            ids[row, : b - a] = self.tensors["input_ids"][a:b].long()
            mask[row, : b - a] = 1
        return records, ids, mask

    def store(self, records: list[int], features: torch.Tensor, aux: torch.Tensor | None) -> None:
        for row, r in enumerate(records):
            a, b = self.spans[r]
            self.features[a:b] = features[row, : b - a].to("cpu", self.features.dtype)
            if self.aux is not None:
                self.aux[a:b] = aux[row, : b - a].to("cpu", self.aux.dtype)

    def write(self, storage: Storage, job: FeatureJob) -> dict[str, Any]:
        tensors = {
            "input_ids": self.tensors["input_ids"],
            "loss_mask": self.tensors["loss_mask"],
            "offsets": self.tensors["offsets"],
            "features": self.features,
        }
        if self.aux is not None:
            tensors["aux_features"] = self.aux
        meta = dict(self.meta)
        meta.update(_expected_meta(job))
        meta.update({"records": str(len(self.spans)), "tokens": str(self.tokens), "source": f"{layout.DATA}/{self.split}/{self.name}"})
        storage.write_tensors(f"{layout.FEATURES}/{self.split}/{self.name}", tensors, metadata=meta)
        return {"split": self.split, "name": self.name, "records": len(self.spans), "tokens": self.tokens}


def _worker_threads() -> int:
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    except Exception:  # pragma: no cover - outside Ray
        cpus = 1
    return max(1, int(round(cpus)))


def featurize_worker(config: dict) -> dict[str, Any] | None:
    """``train_loop_per_worker``: featurize this rank's share of ``config["job"].tasks`` (a :class:`FeatureJob`);
    rank 0 returns the gathered per-rank statistics (partition sizes, shards written, tokens, seconds)."""
    import torch.distributed as dist

    job: FeatureJob = config["job"]
    os.environ.update(job.env)  # the driver's storage endpoint, caches (and local credentials)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())  # DeepSpeed's CPU comm op compiles once, cached here
    setup_logging(job.verbose)
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = use_threads(_worker_threads())

    device = torch.device("cpu")
    if job.use_gpu:
        import ray.train.torch

        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)

    started = time.perf_counter()
    ds_config = zero3_config(job.dtype, stage=job.zero_stage, persistence_threshold=job.persistence_threshold)
    model = load_frozen_target_zero3(job.hf_dir, job.dtype, ds_config, aux_layers=job.aux_layers, device=device)
    root = model.module if hasattr(model, "module") else model
    local_numel, total_numel = partition_numel(root)
    load_seconds = time.perf_counter() - started
    logger.info(
        "rank %d/%d: target loaded in %.1f s, holds %d of %d parameter elements (%d threads, %s)",
        rank, world, load_seconds, local_numel, total_numel, threads, device,
    )

    storage = Storage(job.dataset_uri)
    mine = job.tasks[rank::world]
    flag = torch.zeros(1, dtype=torch.long, device=device)
    written: list[dict] = []
    tokens_done = 0
    forwards = dummy = 0
    pbar = None
    if rank == 0 and job.progress:
        from tqdm import tqdm

        pbar = tqdm(total=0, unit="tok", unit_scale=True, desc=f"features rank0/{world}", file=sys.stderr, mininterval=2.0)

    work: _ShardWork | None = None
    queue = list(mine)
    loop_started = time.perf_counter()
    last_log = loop_started
    with torch.no_grad():
        while True:
            while work is None and queue:
                split, name = queue.pop(0)
                work = _ShardWork(storage, split, name, job)
                if pbar is not None:
                    pbar.total += work.tokens
                    pbar.refresh()
                if not work.batches:  # only empty records: nothing to run
                    written.append(work.write(storage, job))
                    work = None
            flag.fill_(1 if work is not None else 0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if int(flag.item()) == 0:
                break
            if work is None:  # keep the collective all-gathers of ZeRO-3 in step with the other ranks
                model(torch.zeros(1, 1, dtype=torch.long, device=device), torch.ones(1, 1, dtype=torch.long, device=device))
                dummy += 1
                continue
            records, ids, mask = work.batch(work.done)
            features, aux = model(ids.to(device), mask.to(device))
            work.store(records, features, aux)
            forwards += 1
            batch_real = int(mask.sum())
            tokens_done += batch_real
            if pbar is not None:
                pbar.update(batch_real)
            work.done += 1
            if work.done == len(work.batches):
                written.append(work.write(storage, job))
                now = time.perf_counter()
                if rank == 0 or now - last_log > 30:
                    logger.info(
                        "rank %d: wrote %s/%s (%d records, %d tokens); %.0f tok/s on this rank",
                        rank, work.split, work.name, len(work.spans), work.tokens, tokens_done / max(now - loop_started, 1e-9),
                    )
                    last_log = now
                work = None
    seconds = time.perf_counter() - loop_started
    if pbar is not None:
        pbar.close()
    stats = {
        "rank": rank, "local_numel": local_numel, "total_numel": total_numel, "resident_numel": resident_numel(root), "written": written,
        "tokens": tokens_done, "seconds": seconds, "forwards": forwards, "dummy_forwards": dummy,
        "load_seconds": load_seconds, "threads": threads,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, stats)
    return {"ranks": gathered} if rank == 0 else None


# ---------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------


def _forwarded_env() -> dict[str, str]:
    names = FORWARDED_ENV + (() if os.environ.get("RAY_ADDRESS") else FORWARDED_LOCAL_SECRETS)
    return {k: os.environ[k] for k in names if os.environ.get(k)}


def _load_tokenizer_fingerprint(hf_dir: Path) -> str:
    from transformers import AutoTokenizer

    from eagle.data import tokenizer_fingerprint

    if not ((hf_dir / "tokenizer.json").is_file() or (hf_dir / "tokenizer_config.json").is_file()):
        raise EagleError(f"target directory {hf_dir} has no tokenizer: the data manifest cannot be checked against it")
    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(hf_dir, local_files_only=True))


def _check_data_manifest(dataset: Storage, name: str, revision: str, fingerprint: str) -> tuple[dict, str]:
    manifest = layout.read_manifest(dataset, layout.DATA)
    rel = f"{layout.DATA}/{layout.MANIFEST}"
    if manifest.get("target_revision") != revision:
        raise EagleError(
            f"the data at {dataset.url(layout.DATA)} was made for target revision {manifest.get('target_revision')!r}, "
            f"not {revision!r} ({name}): rerun jobs.prepare_data for this target"
        )
    if manifest.get("tokenizer") != fingerprint:
        raise EagleError(
            f"the data at {dataset.url(layout.DATA)} was tokenised with {manifest.get('tokenizer')!r}, but target "
            f"{name!r} has tokenizer {fingerprint!r}: rerun jobs.prepare_data for this target"
        )
    if not any(layout.shard_names(manifest, split) for split in layout.SPLITS):
        raise EagleError(f"{dataset.url(rel)} lists no shards")
    return manifest, "sha256:" + hashlib.sha256(dataset.read_bytes(rel)).hexdigest()


def featurize(preset: Preset | str, storage_uri: str, *, target_spec: str | None = None, progress: bool = True, verbose: bool = False) -> dict:
    """Featurize ``preset.dataset`` for the target (``target_spec`` or the preset's) under ``storage_uri``;
    return the features manifest (also written to ``<storage>/<target>/<dataset>/features/manifest.json``).

    Raises ``EagleError`` (nothing started) for a missing or mismatched data manifest, an unknown target or
    an unwritable storage; a failure inside the workers propagates as Ray Train's error.
    """
    from transformers import AutoConfig

    from eagle.target import adapter_for, resolve_target

    preset = get_preset(preset) if isinstance(preset, str) else preset
    cfg = preset.features
    cfg = dataclasses.replace(cfg, dtype=preferred_dtype(cfg.dtype, gpu=cfg.use_gpu))  # "auto": the dtype that runs enters the identity
    if cfg.dtype not in DTYPES:
        raise EagleError(f"unknown feature dtype {cfg.dtype!r}: expected one of {', '.join(DTYPES)}")
    if cfg.zero_stage not in (0, 3):
        raise EagleError(f"features need zero_stage 3 (partitioned target) or 0 (replicated), not {cfg.zero_stage}")
    if cfg.workers < 1 or cfg.batch_tokens < 1:
        raise EagleError("workers and batch_tokens must be positive")

    hf_dir, name, revision = resolve_target(target_spec or preset.target)
    model_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    adapter_for(model_config)
    fingerprint = _load_tokenizer_fingerprint(Path(hf_dir))
    dataset = Storage(storage_uri).child(name, preset.dataset)
    data_manifest, data_sha = _check_data_manifest(dataset, name, revision, fingerprint)
    dataset.check_writable()

    num_layers = int(model_config.num_hidden_layers)
    hidden_size = int(model_config.hidden_size)
    # EAGLE-3 heads read these layers: stored when asked, or when the preset trains an eagle3 head
    aux = list(default_aux_layers(num_layers)) if cfg.aux_layers or preset.train.head_kind == "eagle3" else None
    splits = [s for s in layout.SPLITS if (data_manifest.get("splits") or {}).get(s) is not None]
    job = FeatureJob(
        hf_dir=str(hf_dir), dataset_uri=dataset.url(), dtype=cfg.dtype, zero_stage=cfg.zero_stage, use_gpu=cfg.use_gpu,
        batch_tokens=cfg.batch_tokens, hidden_size=hidden_size, target_revision=revision, data_manifest_sha256=data_sha,
        aux_layers=aux, persistence_threshold=cfg.persistence_threshold, progress=progress, verbose=verbose, env=_forwarded_env(),
    )
    expected = _expected_meta(job)
    all_shards = [(split, shard) for split in splits for shard in layout.shard_names(data_manifest, split)]
    pending = [
        (split, shard) for split, shard in all_shards
        if not _shard_is_current(dataset, f"{layout.FEATURES}/{split}/{shard}", expected)
    ]
    logger.info(
        "features for %s/%s (%s, %s): %d shards, %d to compute, %d already done; storage %s",
        name, preset.dataset, revision, cfg.dtype, len(all_shards), len(pending), len(all_shards) - len(pending), dataset.url(),
    )

    previous = dataset.read_json(f"{layout.FEATURES}/{layout.MANIFEST}") if dataset.exists(f"{layout.FEATURES}/{layout.MANIFEST}") else {}
    run_stats = None
    if pending:
        run_stats = _run_workers(dataclasses.replace(job, tasks=tuple(pending)), cfg, name, preset.dataset)

    manifest = _build_manifest(
        dataset, splits, data_manifest, name=name, revision=revision, fingerprint=fingerprint, cfg=cfg,
        hidden_size=hidden_size, num_layers=num_layers, aux=aux, data_sha=data_sha, run_stats=run_stats,
        previous=previous,
    )
    dataset.write_json(f"{layout.FEATURES}/{layout.MANIFEST}", manifest)
    logger.info(
        "features done: %s records, %s tokens in %s; %s tok/s",
        sum(s["records"] for s in manifest["splits"].values()), sum(s["tokens"] for s in manifest["splits"].values()),
        dataset.url(layout.FEATURES), manifest["throughput"].get("tokens_per_s"),
    )
    return manifest


def _run_workers(job: FeatureJob, cfg, name: str, dataset_name: str) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    init_ray(num_cpus=max(os.cpu_count() or 1, cfg.workers))
    scaling: dict[str, Any] = {"num_workers": cfg.workers, "use_gpu": cfg.use_gpu}
    if not cfg.use_gpu:  # give each worker an equal share of the CPUs; it sets torch threads to that share
        cpus = int(ray.cluster_resources().get("CPU", cfg.workers))
        scaling["resources_per_worker"] = {"CPU": max(1, cpus // cfg.workers)}
    trainer = TorchTrainer(
        featurize_worker,
        train_loop_config={"job": job},
        scaling_config=ScalingConfig(**scaling),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        # Ray Train's bookkeeping beside train_head's, under the project cache (its default is ~/ray_results)
        run_config=RunConfig(name=f"featurize-{name}-{dataset_name}-{uuid.uuid4().hex[:8]}", storage_path=str(cache_root() / "ray_results")),
    )
    started = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - started
    if getattr(result, "error", None):
        raise result.error
    stats = result.return_value or {}
    stats["wall_seconds"] = wall
    return stats


def _build_manifest(dataset: Storage, splits, data_manifest, *, name, revision, fingerprint, cfg, hidden_size, num_layers, aux, data_sha, run_stats, previous) -> dict:
    split_entries: dict[str, Any] = {}
    for split in splits:
        shards = []
        for shard in layout.shard_names(data_manifest, split):
            rel = f"{layout.FEATURES}/{split}/{shard}"
            if not dataset.exists(rel):
                raise EagleError(f"{dataset.url(rel)} is missing after the run")
            meta = dataset.read_tensor_metadata(rel)
            shards.append({"name": shard, "records": int(meta["records"]), "tokens": int(meta["tokens"])})
        split_entries[split] = {
            "shards": shards, "records": sum(s["records"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
        }
    if run_stats:
        ranks = run_stats.get("ranks") or []
        tokens = sum(r["tokens"] for r in ranks)
        seconds = max((r["seconds"] for r in ranks), default=0.0)
        throughput = {
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None, "tokens": tokens,
            "seconds": round(seconds, 2), "wall_seconds": round(run_stats.get("wall_seconds", 0.0), 2),
            "shards": sum(len(r["written"]) for r in ranks),
        }
        partition = {
            "total_numel": ranks[0]["total_numel"] if ranks else None,
            "per_rank_numel": [r["local_numel"] for r in ranks],
            # held after the last forward (partitions + whatever stayed gathered: persistent small parameters)
            "per_rank_resident_numel": [r.get("resident_numel") for r in ranks],
            "forwards": [r["forwards"] for r in ranks], "dummy_forwards": [r["dummy_forwards"] for r in ranks],
        }
    else:  # nothing computed in this run: keep what the run that computed them measured
        throughput = previous.get("throughput") or {"tokens_per_s": None, "tokens": 0, "seconds": 0.0, "shards": 0}
        partition = previous.get("partition")
    return {
        "format": layout.FEATURES_FORMAT,
        "target": name,
        "target_revision": revision,
        "tokenizer": fingerprint,
        "dtype": cfg.dtype,
        "hidden_size": hidden_size,
        "layers": num_layers,
        "aux_layers": aux,
        "data_manifest_sha256": data_sha,
        "splits": split_entries,
        "throughput": throughput,
        "workers": cfg.workers,
        "zero_stage": cfg.zero_stage,
        "partition": partition,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ---------------------------------------------------------------------------------------------------------
# Reading features (the trainer's side)
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------


def build_parser():
    parser = job_parser("jobs.featurize", "Frozen target -> feature shards (Ray Train workers, DeepSpeed ZeRO-3).")
    parser.add_argument("--workers", type=int, default=None, help="Ray workers (default: the preset's)")
    parser.add_argument("--aux-layers", action="store_true", default=None, help="also store EAGLE-3 low/mid/high hidden states")
    parser.add_argument("--dtype", choices=sorted(DTYPES) + ["auto"], default=None, help="model and feature dtype (default: the preset's; auto: bf16 on GPUs and CPUs that compute it natively, else float32)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per forward (default: the preset's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _main(args) -> int:
    preset = get_preset(args.preset)
    overrides = {
        k: v for k, v in {
            "workers": args.workers, "aux_layers": args.aux_layers, "dtype": args.dtype, "batch_tokens": args.batch_tokens,
        }.items() if v is not None
    }
    preset = preset.with_overrides(features=overrides)
    if args.dataset:
        preset = dataclasses.replace(preset, dataset=args.dataset)
    manifest = featurize(preset, args.storage, target_spec=args.target, progress=not args.no_progress, verbose=args.verbose)
    print(json.dumps({k: manifest[k] for k in ("target", "target_revision", "dtype", "throughput")} | {
        "records": {s: v["records"] for s, v in manifest["splits"].items()},
        "tokens": {s: v["tokens"] for s, v in manifest["splits"].items()},
    }))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job("jobs.featurize", _main, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
