"""Train an EAGLE head as a Ray job: Ray Train ``TorchTrainer`` workers, DeepSpeed, MLflow.

    ray job submit --working-dir . -- python -m jobs.train_head --target smollm2-135m --preset quick

What one run does:
1. The driver validates everything cheap first (target, feature manifest of the same target revision,
   tracking server) so bad input fails in one line before any worker starts; then it opens (or, for a
   rerun of the same ``--run-name``, reopens) one MLflow run and logs the preset, the DeepSpeed config and
   the data/feature manifests to it.
2. ``TorchTrainer`` starts ``workers`` ranks (gloo on CPU, nccl on GPU). Each rank wraps the head in a
   DeepSpeed engine (ZeRO stage from the preset; torch AdamW(0.9, 0.95) as the client optimizer, the
   warmup schedule of ``eagle.train``, gradient clipping 0.5) and trains on its share of the feature
   shards (offline) or on features computed in the loop by the frozen target (``online``: the target is
   ZeRO-3-partitioned across the ranks, ``jobs.frozen_target.ShardedTarget``, every rank runs its forward in
   lockstep, and rank 0 tags the run with what each rank holds of it after the first step). The loss is
   EAGLE's: SmoothL1 on features + 0.1 x CE on tokens with U(-0.1, 0.1) input noise (``eagle.loss``).
3. Every ``checkpoint_every`` steps all ranks write a DeepSpeed checkpoint and rank 0 the head directory,
   and report them with ``ray.train.report``: Ray merges the ranks' files into one checkpoint. A worker
   that dies is restarted by ``FailureConfig`` and resumes from the last checkpoint; rerunning with the
   same run name resumes too (Ray Train restores its checkpoint list from the run's storage folder).
4. Rank 0 tags the run with the ZeRO stage DeepSpeed's engine reports it runs and the class of the
   optimizer it built (``deepspeed.zero_stage``, ``deepspeed.optimizer``; the param ``train.zero_stage`` is
   what was asked for), and logs loss parts, per-depth top-1 accuracy and a simulated acceptance length on
   held-out records to MLflow as it goes. When the run succeeds, the driver logs the head (safetensors +
   config.json) to the run and registers it as a version of ``<target>-eagle`` with alias ``candidate``,
   linked to the target's own registered version. A failed run is marked FAILED and registers nothing.

DeepSpeed checkpoints are DeepSpeed's own files, read back only from this run's storage folder; the head a
user receives is ``model.safetensors`` + ``config.json`` (never a pickle).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from eagle.errors import EagleError
from eagle.target import cache_root
from jobs import layout
from jobs.common import init_ray, job_parser, run_job
from jobs.presets import Preset, TrainConfig, get_preset

logger = logging.getLogger("jobs.train_head")

HEAD_DIR = "head"
STATE_FILE = "train_state.json"
DS_TAG = "deepspeed"
EXPERIMENT = "eagle-heads"
RETRY_S = 120.0  # how long an MLflow call waits out a tracking server that is down before the job fails


def default_results_dir() -> str:
    return str(cache_root() / "ray_results")


def deepspeed_config(train: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed config of the head's engine (logged to MLflow as ``deepspeed_config.json``).

    The micro batch is a token budget, not a sequence count, so the nominal ``train_micro_batch_size`` is 1;
    precision is torch autocast over fp32 master weights (DeepSpeed's bf16 optimizer path needs CUDA)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.clip,
        "zero_optimization": {"stage": train.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if train.use_gpu and train.autocast_bf16:
        config["bf16"] = {"enabled": True}
    return config


# ---- the worker loop --------------------------------------------------------------------------------------


def _draft_vocab(storage, target, size: int | None):
    import torch

    from eagle.head import draft_vocab_from_counts

    if size is None or size >= target.vocab_size:
        return None
    counts_path = f"{layout.DATA}/{layout.TOKEN_COUNTS}"
    if not storage.exists(counts_path):
        raise EagleError(f"{storage.url(counts_path)} is missing: rerun jobs.prepare_data (needed for the draft vocabulary)")
    counts = storage.read_tensors(counts_path)["counts"].to(torch.float64)
    return draft_vocab_from_counts(counts, size, always=target.eos_token_ids)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What every Ray Train worker receives (Ray pickles it to the workers as it is)."""

    train: TrainConfig
    target_spec: str
    dataset_uri: str
    deepspeed: dict[str, Any]
    aux_layers: list[int] | None = None  # the target layers an EAGLE-3 head reads
    run_id: str | None = None  # MLflow run rank 0 logs to (None: no tracking)
    tracking_uri: str | None = None
    threads_per_worker: int | None = None
    eval_records: int = 16  # held-out records rank 0 evaluates on at each checkpoint


@dataclasses.dataclass
class Progress:
    """Where a run stands: optimizer steps taken and their own time (start-up, checkpoints and evals
    excluded). Saved beside each DeepSpeed checkpoint as ``train_state.json``; a resumed run starts here."""

    step: int = 0
    elapsed_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "elapsed_s": self.elapsed_s})

    @classmethod
    def from_json(cls, text: str) -> "Progress":
        state = json.loads(text)
        return cls(step=int(state["step"]), elapsed_s=float(state["elapsed_s"]))


def learning_rate(train: TrainConfig, progress: Progress, total_steps: int) -> float:
    """Warmup, then linear decay over the run's progress, the larger of steps/total and elapsed/deadline
    (``max_minutes``), so a run cut by its deadline still ends at the low rate. A function of the progress
    alone: a resumed run recomputes it from the checkpoint's step and elapsed time."""
    from eagle.train import lr_factor

    done = (progress.step - train.warmup_steps) / max(total_steps - train.warmup_steps, 1)
    if train.max_minutes:
        done = max(done, progress.elapsed_s / (train.max_minutes * 60.0))
    return train.lr * lr_factor(progress.step, warmup=train.warmup_steps, progress=done)


def _train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker (runs on every rank): ``config["worker"]`` is its :class:`WorkerConfig`."""
    _Worker(config["worker"]).run()


class _Worker:
    """One rank's training: the frozen target, the head in its DeepSpeed engine, this rank's records, and
    the loop. Every rank takes the same optimizer steps; rank 0 also evaluates, logs and saves the head."""

    def __init__(self, worker: WorkerConfig) -> None:
        import deepspeed
        import ray.train
        import torch
        import torch.distributed as dist

        from eagle.head import EagleHead
        from eagle.loss import LossConfig
        from eagle.runtime import use_threads
        from eagle.target import load_target
        from eagle.train import build_optimizer, token_budget_batches
        from jobs.common import setup_logging, worker_env
        from jobs.storage import Storage

        worker_env()
        setup_logging()
        self.config, self.train = worker, worker.train
        train = self.train
        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        if worker.threads_per_worker:
            use_threads(worker.threads_per_worker)
        self.device = torch.device("cuda", context.get_local_rank()) if train.use_gpu else torch.device("cpu")
        storage = Storage(worker.dataset_uri)

        target_dtype = "bfloat16" if train.autocast_bf16 else "float32"
        if train.online:  # the frozen target partitioned across the ranks (ZeRO-3); only its embedding and LM head whole
            from jobs.frozen_target import load_sharded_target

            self.target = load_sharded_target(
                worker.target_spec, target_dtype, device=self.device, persistence_threshold=train.target_persistence_threshold,
                aux_layers=worker.aux_layers,
            )
        else:  # offline: features come from the shards; the head borrows the target's embedding and LM head
            self.target = load_target(worker.target_spec, dtype=target_dtype, device=str(self.device))
        self.target.model.requires_grad_(False)
        head = EagleHead.for_target(
            self.target, seed=train.seed, draft_token_ids=_draft_vocab(storage, self.target, train.draft_vocab_size),
            fc_bias=train.fc_bias, input_norm=train.input_norm, kind=train.head_kind, aux_layers=worker.aux_layers,
        ).to(torch.float32)

        stage = layout.DATA if train.online else layout.FEATURES
        self.records = layout.load_records(storage, stage, "train", rank=self.rank, world=self.world)
        self.lengths = [int(r["input_ids"].shape[0]) for r in self.records]
        # every rank must take the same number of optimizer steps: plan with the smallest per-rank epoch
        per_epoch = torch.tensor([len(token_budget_batches(self.lengths, train.batch_tokens, seed=train.seed + self.rank, epoch=0))])
        dist.all_reduce(per_epoch, op=dist.ReduceOp.MIN)
        self.steps_per_epoch = max(1, int(per_epoch) // train.grad_accum)
        self.total_steps = max(1, math.ceil(train.epochs * self.steps_per_epoch))
        if train.max_steps is not None:
            self.total_steps = min(self.total_steps, train.max_steps)

        optimizer = build_optimizer(head, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=head, optimizer=optimizer, config=worker.deepspeed, dist_init_required=False)
        self.loss_config = LossConfig.for_kind(train.head_kind, w_feature=train.w_feature, w_token=train.w_token, noise=train.noise, depth=train.rollout_depth,
                                              ce_fraction=train.ce_fraction)
        self.progress = self._resume()
        self.tracker = _Tracker(worker) if self.rank == 0 else None
        # online: every rank runs the eval forward (ZeRO-3's gathers are collectives), rank 0 keeps the result
        self.eval_batch = None
        if self.rank == 0 or train.online:
            eval_records = layout.load_records(storage, stage, "eval")[: worker.eval_records]
            if eval_records:  # fixed records: their features once, up front
                from eagle.train import collate

                batch = self._batch(collate(eval_records))
                self.eval_batch = batch if self.rank == 0 else None

    def _resume(self) -> Progress:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return Progress()
        from jobs.checkpoints import install

        install(self.engine)  # resume never unpickles code from the results folder (jobs/checkpoints.py)
        with checkpoint.as_directory() as directory:
            self.engine.load_checkpoint(directory, tag=DS_TAG)
            progress = Progress.from_json((Path(directory) / STATE_FILE).read_text())
        logger.info("rank %d resumed from the checkpoint at step %d", self.rank, progress.step)
        return progress

    def _batch(self, batch):
        """A collated batch, ready for the head on this worker's device: its features computed by the target
        here when the preset is online; under autocast in the dtype they were stored (or computed) in, since
        autocast casts where it computes; without it in fp32 (bf16-stored features feed an fp32 head as fp32 on
        CPUs without native bf16). The training and the evaluation batches both come through here."""
        import torch

        if self.train.online:
            batch.features, batch.aux_features = self.target.hidden(batch.input_ids.to(self.device))
        return batch.to(self.device, None if self.train.autocast_bf16 else torch.float32)

    def evaluate(self) -> dict[str, float]:
        """Held-out per-depth acceptance against the target's own greedy choices (rank 0; ``{}`` elsewhere)."""
        import torch

        from eagle.loss import rollout_metrics, target_greedy

        batch, module = self.eval_batch, self.engine.module
        if batch is None:
            return {}
        module.eval()
        greedy = target_greedy(self.target, batch.features)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.train.autocast_bf16):
            metrics = rollout_metrics(
                module, batch.features, batch.input_ids, batch.loss_mask, self.train.metrics_depth, greedy=greedy, inputs=batch.aux_features,
            )
        module.train()
        return {f"eval_{k}": v for k, v in metrics.items() if k != "positions"}

    def save(self, final: bool) -> None:
        """All ranks write the DeepSpeed checkpoint; rank 0 adds the head, the progress and an evaluation."""
        import ray.train

        with tempfile.TemporaryDirectory() as directory:
            self.engine.save_checkpoint(directory, tag=DS_TAG)
            metrics = {"step": self.progress.step, "final": final, "train_minutes": self.progress.elapsed_s / 60.0}
            if self.rank == 0:
                self.engine.module.save_pretrained(Path(directory) / HEAD_DIR)
                (Path(directory) / STATE_FILE).write_text(self.progress.to_json())
                metrics.update(self.evaluate())
                self.tracker.log({k: v for k, v in metrics.items() if isinstance(v, float)}, self.progress.step)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))

    def _micro_batches(self):
        """This rank's micro batches from the progress on, epoch after epoch: (index in its epoch, record ids)."""
        from eagle.train import token_budget_batches

        train = self.train
        epoch = self.progress.step // self.steps_per_epoch
        skip = (self.progress.step - epoch * self.steps_per_epoch) * train.grad_accum  # resumed mid-epoch
        while True:
            plan = token_budget_batches(self.lengths, train.batch_tokens, seed=train.seed + self.rank, epoch=epoch)
            yield from enumerate(plan[: self.steps_per_epoch * train.grad_accum][skip:], start=skip)
            epoch, skip = epoch + 1, 0

    def _tag_resident_target(self) -> None:
        """Online: what each rank holds of the target after real forwards (the ZeRO-3 partition)."""
        import torch.distributed as dist

        held: list[Any] = [None] * self.world
        dist.all_gather_object(held, self.target.resident_numel())
        if self.tracker:
            self.tracker.tag({
                "target.resident_numel_per_rank": json.dumps(held), "target.numel": self.target.numel(),
                "target.borrowed_numel": self.target.borrowed_numel(),
            })

    def _deadline_reached(self) -> bool:
        """True on every rank once any rank's elapsed time passes ``max_minutes`` (all stop at the same step)."""
        import torch
        import torch.distributed as dist

        limit = self.train.max_minutes
        stop = torch.tensor([1 if limit is not None and self.progress.elapsed_s >= limit * 60.0 else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        return bool(int(stop))

    def run(self) -> None:
        import torch

        from eagle.train import collate, compute_loss

        train, engine, progress = self.train, self.engine, self.progress
        if self.tracker:  # what DeepSpeed runs, read from the engine (tags: a resumed run sets them again)
            self.tracker.tag({"deepspeed.zero_stage": engine.zero_optimization_stage(), "deepspeed.optimizer": type(engine.optimizer).__name__})
            if progress.step:
                self.tracker.log({"resumed_from_step": progress.step}, progress.step)
        if self.rank == 0:
            logger.info(
                "training %d steps (%d per epoch) on %d workers, %d records on rank 0",
                self.total_steps, self.steps_per_epoch, self.world, len(self.records),
            )
        engine.module.train()
        window_tokens, window_start = 0, time.perf_counter()
        micro_batches = self._micro_batches() if progress.step < self.total_steps else iter(())
        for index, batch_ids in micro_batches:
            if index % train.grad_accum == 0:
                started = time.perf_counter()  # the optimizer step's first micro batch
            batch = self._batch(collate([self.records[i] for i in batch_ids]))
            lr = learning_rate(train, progress, self.total_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # the loss's random draws (input noise, the cross-entropy's share) depend on the step alone, so a run
            # resumed from a checkpoint repeats the steps after it exactly (DeepSpeed's checkpoint holds no RNG state)
            torch.manual_seed(micro_batch_seed(train.seed, progress.step, self.rank, index % train.grad_accum))
            loss, metrics = compute_loss(engine.module, batch, self.loss_config, autocast_bf16=train.autocast_bf16)
            engine.backward(loss)
            engine.step()
            window_tokens += int(batch.loss_mask.sum())
            if (index + 1) % train.grad_accum:
                continue
            progress.step += 1
            progress.elapsed_s += time.perf_counter() - started
            if progress.step == 1 and train.online:
                self._tag_resident_target()
            last = self._deadline_reached() or progress.step >= self.total_steps
            if self.tracker and (progress.step % train.log_every == 0 or progress.step == 1 or last):
                now = time.perf_counter()
                metrics.update(
                    lr=lr, epoch=progress.step / self.steps_per_epoch, train_tokens_per_s=window_tokens * self.world / (now - window_start),
                    train_minutes=progress.elapsed_s / 60.0,  # the optimizer steps' own time (start-up, checkpoints and evals excluded)
                )
                window_tokens, window_start = 0, now
                self.tracker.log(metrics, progress.step)
                logger.info("step %d/%d loss %.4f acc_1 %.3f lr %.2e", progress.step, self.total_steps, metrics["loss"], metrics["acc_1"], lr)
            if last:
                break
            if progress.step % train.checkpoint_every == 0:
                self.save(final=False)
        self.save(final=True)


class _Tracker:
    """Rank 0's MLflow logging (explicit run id; never the fluent API's global state)."""

    def __init__(self, worker: WorkerConfig) -> None:
        self.run_id = worker.run_id
        self.runs = None
        if self.run_id:
            from eagle_platform.registry import Runs

            self.runs = Runs(worker.tracking_uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.runs is None:
            return
        from eagle_platform.registry import with_retries

        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        # an MLflow restart while training is waited out (bounded) instead of failing the worker
        with_retries(lambda: self.runs.log_metrics(self.run_id, clean, step=step), within_s=RETRY_S, what="logging metrics")

    def tag(self, tags: dict[str, Any]) -> None:
        if self.runs is None:
            return
        from eagle_platform.registry import with_retries

        with_retries(lambda: self.runs.set_tags(self.run_id, tags), within_s=RETRY_S, what="tagging the run")


# ---- the driver -------------------------------------------------------------------------------------------


def _validate(preset: Preset, storage_uri: str, target_spec: str) -> tuple[Any, str, str, dict, list[int] | None]:
    """Cheap checks before any worker starts; returns (dataset storage, target name, revision, manifests, the
    target layers an EAGLE-3 head reads or None)."""
    from eagle.head import HEAD_KINDS, default_aux_layers
    from eagle.target import resolve_target

    directory, name, revision = resolve_target(target_spec)
    kind = preset.train.head_kind
    if kind not in HEAD_KINDS:
        raise EagleError(f"head_kind must be one of {', '.join(HEAD_KINDS)}, got {kind!r}")
    aux = None
    if kind == "eagle3":
        aux = list(default_aux_layers(int(json.loads((Path(directory) / "config.json").read_text())["num_hidden_layers"])))
    storage = layout.dataset_storage(storage_uri, name, preset.dataset)
    stage = layout.DATA if preset.train.online else layout.FEATURES
    manifest_path = f"{stage}/{layout.MANIFEST}"
    if not storage.exists(manifest_path):
        job = "jobs.prepare_data" if preset.train.online else "jobs.featurize"
        raise EagleError(f"no {stage} for {name} at {storage.url(stage)}: run {job} --preset {preset.name} first")
    manifest = storage.read_json(manifest_path)
    if manifest.get("target_revision") != revision:
        raise EagleError(
            f"{storage.url(manifest_path)} was made from {name} revision {manifest.get('target_revision')}, "
            f"but the target is now {revision}: regenerate the {stage}"
        )
    if aux is not None and stage == layout.FEATURES and manifest.get("aux_layers") != aux:
        raise EagleError(
            f"{storage.url(manifest_path)} holds the layers {manifest.get('aux_layers')}, but an eagle3 head reads {aux}: "
            f"rerun jobs.featurize --preset {preset.name} --aux-layers"
        )
    manifests = {stage: manifest}
    if stage == layout.FEATURES and storage.exists(f"{layout.DATA}/{layout.MANIFEST}"):
        manifests[layout.DATA] = storage.read_json(f"{layout.DATA}/{layout.MANIFEST}")
    return storage, name, revision, manifests, aux


def train(
    preset: Preset,
    *,
    storage_uri: str,
    target_spec: str | None = None,
    run_name: str | None = None,
    results_dir: str | None = None,
    register: bool = True,
    alias: str = "candidate",
    max_failures: int = 3,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Run one training job; returns ``{"run_id", "head_dir", "version", "metrics"}``."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from eagle_platform.registry import Registry, with_retries

    target_spec = target_spec or preset.target
    if preset.train.autocast_bf16 is None:  # resolved here, so the run's params record the precision that ran
        from eagle.runtime import native_bf16

        preset = preset.with_overrides(train={"autocast_bf16": preset.train.use_gpu or native_bf16()})
    storage, name, revision, manifests, aux_layers = _validate(preset, storage_uri, target_spec)
    run_name, lease = lease_run_name(run_name or f"{name}-{preset.dataset}-{preset.name}", explicit=run_name is not None)
    reg = Registry(tracking_uri)  # default: $MLFLOW_TRACKING_URI or the local stack
    runs = reg.runs
    runs.check_server()  # fails in one line when no server answers
    ds_config = deepspeed_config(preset.train)
    tags = {"target": name, "target_revision": revision, "preset": preset.name, "job": "train_head"}
    statuses = ("RUNNING", "FAILED", "KILLED", "FINISHED")  # the same run name continues the same MLflow run, finished or not
    params = _flatten({"preset": preset.name, "target": target_spec, "dataset": preset.dataset, "train": asdict(preset.train)})
    previous = runs.find_run(EXPERIMENT, run_name, tags=tags, statuses=statuses)
    previous_params = runs.run_info(previous)["params"] if previous is not None else {}
    try:  # refused before the run is reopened, so its status and registered head stay as they were
        check_resumable(previous_params, params, run_name)
    except EagleError:
        lease.close()
        raise
    run_id = runs.reopen_run(previous, run_name) if previous is not None else runs.start_run(EXPERIMENT, run_name, tags=tags)
    try:
        if previous_params:  # a resumed run keeps its first params
            runs.set_tags(run_id, {"resumed_with": json.dumps(params, sort_keys=True)[:5000]})
        else:
            runs.log_params(run_id, params)
        runs.log_dict(run_id, ds_config, "deepspeed_config.json")
        for stage, manifest in manifests.items():
            runs.log_dict(run_id, manifest, f"manifests/{stage}.json")

        init_ray()
        cpus = int(ray.available_resources().get("CPU", 1)) if not preset.train.use_gpu else None
        workers = preset.train.workers
        worker = WorkerConfig(
            train=preset.train, target_spec=target_spec, dataset_uri=storage.url(), deepspeed=ds_config, aux_layers=aux_layers,
            run_id=run_id, tracking_uri=runs.uri, threads_per_worker=max(1, cpus // workers) if cpus else None,
        )
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"worker": worker},
            scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=preset.train.use_gpu),
            torch_config=TorchConfig(backend="nccl" if preset.train.use_gpu else "gloo"),
            run_config=ray.train.RunConfig(
                name=run_name,
                storage_path=results_dir or default_results_dir(),
                failure_config=ray.train.FailureConfig(max_failures=max_failures),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            ),
        )
        result = trainer.fit()
        if result.error is not None:
            raise result.error
        with result.checkpoint.as_directory() as directory:
            head_dir = Path(directory) / HEAD_DIR
            if not (head_dir / "model.safetensors").is_file():
                raise RuntimeError("the final checkpoint holds no head directory")
            local_head = Path(tempfile.mkdtemp(prefix="eagle-head-")) / HEAD_DIR
            local_head.parent.mkdir(parents=True, exist_ok=True)
            import shutil

            shutil.copytree(head_dir, local_head)
        runs.log_artifact(run_id, str(local_head), HEAD_DIR)
        version = None
        if register:
            target_version = reg.register_target(name, revision, {"name": name, "spec": target_spec, "revision": revision}, run_id)
            version = reg.register_head(run_id, HEAD_DIR, name, revision, alias=alias, target_model_version=target_version)
        with_retries(lambda: runs.finish_run(run_id, "FINISHED"), within_s=RETRY_S, what="finishing the run")
    except BaseException as err:
        raised = failed_run(runs, run_id, err)
        if raised is err:
            raise
        raise raised from err
    finally:
        lease.close()  # the run name is free for the next job (a resume)
    logger.info("run %s finished: head %s registered as %s-eagle version %s", run_name, local_head, name, version)
    return {"run_id": run_id, "run_name": run_name, "head_dir": str(local_head), "version": version, "metrics": dict(result.metrics or {})}


# What a checkpoint's shape depends on: the DeepSpeed data-parallel world and ZeRO partitioning of the optimizer
# state, the device, and the head's own layout. The rest (lr, epochs, minutes, ...) may change on a resume.
RESUME_KEYS = tuple(f"train.{key}" for key in (
    "workers", "zero_stage", "use_gpu", "online", "head_kind", "draft_vocab_size", "fc_bias", "input_norm",
))


def check_resumable(previous: dict[str, str], params: dict[str, str], run_name: str) -> None:
    """Raise one line when the run ``run_name`` (its logged ``previous`` params) cannot resume with ``params``:
    its checkpoints were made with another :data:`RESUME_KEYS` value (DeepSpeed refuses another world size
    deep in every worker, and each retry of Ray Train would fail the same way)."""
    changed = [f"{key} {previous[key]} -> {params.get(key)}" for key in RESUME_KEYS if key in previous and previous[key] != params.get(key)]
    if changed:
        raise EagleError(
            f"run {run_name!r} exists and its checkpoints cannot resume with this preset ({'; '.join(changed)}): "
            f"pass --run-name with a new name to train a new head"
        )


def lease_run_name(base: str, *, explicit: bool, folder: Path | None = None) -> tuple[str, Any]:
    """A run name no other live job on this machine holds, and the lease on it (an open file the caller keeps
    until the job ends; the OS drops its lock when the process dies, however it dies).

    The run name is the MLflow run (the same name resumes it) and the Ray Train results folder, so two
    concurrent ``ray job submit`` of one preset must not share it: a default name held by a live job moves
    on to ``<name>-2``, ``<name>-3``...; an explicit ``--run-name`` that is held is refused in one line. The
    locks live in ``<cache root>/locks`` on the machine that runs the job drivers (a cluster's head node)."""
    import fcntl

    from eagle_platform.registry import check_name

    check_name(base, "run name")  # a folder of the results
    folder = folder or cache_root() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        name = base if n == 1 else f"{base}-{n}"
        handle = open(folder / f"train-{name}.lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            if explicit:
                raise EagleError(f"run name {name!r} is held by another running training job; wait for it or pick another --run-name") from None
            continue
        if n > 1:
            logger.info("run name %s is held by another running job: this one is %s", base, name)
        return name, handle
    raise EagleError(f"every run name {base}-2 ... {base}-999 is held by a running job")


def micro_batch_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """The seed of the random draws of one micro batch: a function of the run's seed and the batch's place in
    the run only, so a resumed run draws for a step what the uninterrupted run drew."""
    return ((seed * 1_000_003 + step) * 65_537 + rank * 257 + micro) % (1 << 63)  # torch.manual_seed's range


class RunFailedError(RuntimeError):
    """The job failed after it started (exit code 1 with a traceback, never the bad-input exit code 2)."""


def failed_run(runs, run_id: str, err: BaseException, *, retry_s: float = RETRY_S) -> BaseException:
    """Mark the run FAILED (retried through an MLflow restart, bounded) and return the error to raise: ``err``
    itself, or, for a registry error raised mid-run (the server went away), a ``RunFailedError`` saying so,
    so the job does not exit 2 as if its input were bad. A failure to mark the run is logged, never raised
    over ``err``."""
    from eagle_platform.registry import RegistryError, with_retries

    try:
        with_retries(lambda: runs.finish_run(run_id, "FAILED"), within_s=retry_s, what="marking the run FAILED")
    except RegistryError as mark_err:
        logger.error("run %s failed (%s: %s) and could not be marked FAILED: %s", run_id, type(err).__name__, err, mark_err)
    if isinstance(err, RegistryError):
        return RunFailedError(f"the registry failed during run {run_id}: {err}")
    return err


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def build_parser() -> argparse.ArgumentParser:
    parser = job_parser("jobs.train_head", "Train an EAGLE head with Ray Train + DeepSpeed and register it in MLflow.")
    parser.add_argument("--run-name", default=None, help="the same name resumes the run from its last checkpoint")
    parser.add_argument("--results-dir", default=None, help=f"Ray Train storage path (default {default_results_dir()})")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--epochs", type=float, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--rollout-depth", type=int, default=None, help="training-time test depth (default: the head kind's, eagle1 1, eagle3 7)")
    parser.add_argument("--head-kind", choices=("eagle1", "eagle3"), default=None, help="the head kind (default: the preset's)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="0 = the full target vocabulary")
    parser.add_argument("--ce-fraction", type=float, default=None, help="the soft cross-entropy on this random share of positions, in (0, 1]")
    parser.add_argument("--online", action="store_true", default=None, help="compute features in the loop")
    parser.add_argument(
        "--target-persistence-threshold", type=int, default=None,
        help="online: ZeRO-3 keeps target parameters smaller than this whole on every rank (default DeepSpeed's, 1e5)",
    )
    parser.add_argument("--max-failures", type=int, default=3)
    parser.add_argument("--alias", default="candidate")
    parser.add_argument("--no-register", action="store_true")
    return parser


def _main(args: argparse.Namespace) -> int:
    overrides = {
        key: getattr(args, key)
        for key in (
            "workers", "lr", "epochs", "max_steps", "max_minutes", "batch_tokens", "checkpoint_every", "rollout_depth", "online",
            "target_persistence_threshold", "head_kind", "ce_fraction",
        )
        if getattr(args, key) is not None
    }
    if args.draft_vocab_size is not None:
        overrides["draft_vocab_size"] = args.draft_vocab_size or None
    for key in ("workers", "batch_tokens", "checkpoint_every", "rollout_depth", "max_steps"):
        if key in overrides and overrides[key] <= 0:
            raise EagleError(f"--{key.replace('_', '-')} must be > 0")
    from eagle.loss import LossConfig

    try:  # the loss's own rule, checked before any work
        LossConfig(ce_fraction=overrides.get("ce_fraction", 1.0))
    except ValueError as err:
        raise EagleError(f"--ce-fraction: {err}") from None
    if overrides.get("target_persistence_threshold", 0) < 0:
        raise EagleError("--target-persistence-threshold must be >= 0")
    preset = get_preset(args.preset)
    if args.dataset:
        preset = dataclasses.replace(preset, dataset=args.dataset)
    preset = preset.with_overrides(train=overrides)
    result = train(
        preset, storage_uri=args.storage, target_spec=args.target, run_name=args.run_name, results_dir=args.results_dir,
        register=not args.no_register, alias=args.alias, max_failures=args.max_failures,
    )
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "metrics"}) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job("jobs.train_head", _main, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
