"""Presets: typed configs for the data, feature, training and evaluation jobs, one function per preset.

``quick`` is the local SmolLM2 run on this 2-core CPU (what ``make quickstart`` uses); ``a100-7b`` ..
``a100-70b`` size the same jobs for LLaMA-class targets on 8 x A100-80GB nodes. Each A100 preset's
docstring carries its memory arithmetic. Conventions used there (bytes per parameter):

- frozen target in bf16: 2 B/param, partitioned by ZeRO-3 across the ``workers`` ranks of the feature job
  (stage-3 keeps 1/N of the weights per rank and all-gathers one layer at a time: the working set is the
  shard plus the largest layer, plus activations);
- the head (fc + one decoder layer, ~h*(2h) + 12h^2 params, ~0.2-0.9 B params for 4k-8k hidden) trains with
  AdamW in mixed precision: 2 (bf16 weights) + 2 (grads) + 12 (fp32 master, m, v) = 16 B/param, ZeRO-2
  shards the 14 B of grads+optimizer state across ranks;
- the LM-head logits dominate activation memory: tokens x draft_vocab x 4 B (fp32 loss), so the micro batch
  is set in tokens and the draft vocabulary is reduced to 32k (EAGLE-3, arXiv 2503.01840).

Feature dumps cost tokens x hidden x 2 B (bf16): 68k ShareGPT conversations ~ 60M tokens -> 0.5 TB at
h=4096, 1 TB at h=8192; the 33B/70B presets therefore train ``online`` (features computed in the loop
from the ZeRO-3-sharded frozen target) instead of writing them out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from eagle.errors import EagleError


@dataclass(frozen=True)
class DataConfig:
    """ShareGPT conversations -> tokenised records (``jobs.prepare_data``)."""

    conversations: int = 2000  # how many ShareGPT conversations to take (in file order), before the split
    eval_fraction: float = 0.02  # held out by a hash of the id, never trained on
    max_length: int = 1024  # tokens per rendered conversation (truncated)
    regenerate: bool = False  # replace assistant turns with the target's own answers
    regen_temperature: float = 0.0  # 0 = greedy regeneration
    regen_max_new_tokens: int = 512
    regen_batch_size: int = 32  # prompts per batched generate call (eagle: answers decoding at once)
    # hf: HF generate in length-sorted batches; eagle: this engine's continuous batching (both on Ray actors);
    # vllm: vLLM through Ray Data LLM (jobs/regen_llm.py): GPU engine replicas, or the server at regen_endpoint
    regen_engine: str = "hf"
    regen_workers: int = 1  # Ray workers generating in parallel (vllm: engine replicas, or HTTP clients of regen_endpoint)
    regen_turns: int = 1  # user turns kept (and answered) per conversation when regenerating
    regen_gpus: float = 0  # hf / eagle: GPUs per regeneration worker; > 0: each worker's target runs on its GPU
    regen_tensor_parallel: int = 1  # vllm: GPUs per engine replica (tensor parallel)
    regen_endpoint: str | None = None  # vllm: base URL of an OpenAI-compatible vLLM server already serving the target
    regen_vllm_cpus: int = 0  # vllm: 0 = replicas on GPUs; N > 0 = replicas on N CPU cores each (vLLM's CPU build)
    regen_vllm_python: str | None = None  # vllm: the replicas' Python (a venv with vLLM and this Ray) instead of pip
    # vllm: shards per Ray Data pass (0 = all pending shards in one pass per turn). Each pass starts the replicas
    # anew (a model load); a group's shards are written when it ends, so a smaller group loses less to a kill
    regen_group_shards: int = 0
    shard_records: int = 256  # conversations per shard
    seed: int = 0


@dataclass(frozen=True)
class FeatureConfig:
    """Frozen target -> feature shards (``jobs.featurize``)."""

    workers: int = 2  # Ray workers; the target is partitioned across them with ZeRO-3
    zero_stage: int = 3
    use_gpu: bool = False
    batch_tokens: int = 4096  # padded tokens per forward pass
    dtype: str = "bfloat16"  # model and stored-feature dtype; "auto": eagle.runtime.preferred_dtype on the driver
    aux_layers: bool = False  # also store EAGLE-3 low/mid/high hidden states
    # ZeRO-3 keeps parameters of fewer elements than this whole on every rank after their first fetch
    # (DeepSpeed's stage3_param_persistence_threshold; None = DeepSpeed's default, 1e5)
    persistence_threshold: int | None = None


@dataclass(frozen=True)
class TrainConfig:
    """Head training with Ray Train + DeepSpeed (``jobs.train_head``); EAGLE's loss (arXiv 2401.15077 s4)."""

    workers: int = 2
    use_gpu: bool = False
    zero_stage: int = 2
    online: bool = False  # compute features in the loop (the frozen target ZeRO-3-partitioned across the workers)
    target_persistence_threshold: int | None = None  # online: DeepSpeed's stage3_param_persistence_threshold for the target
    batch_tokens: int = 4096  # padded tokens per micro batch per worker
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int = 50
    epochs: float = 2.0
    max_steps: int | None = None  # stop earlier than the epochs (None = no cap)
    max_minutes: float | None = None  # wall-clock cap on the training loop
    clip: float = 0.5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    # the head kind (eagle.head.HeadConfig.kind): eagle1, or eagle3 (fused low/mid/high target layers; offline
    # training needs features made with aux_layers)
    head_kind: str = "eagle1"
    # the loss (eagle.loss.LossConfig); None: the head kind's default (LossConfig.for_kind)
    noise: float | None = None  # U(-noise, noise) on input features (eagle1 0.1, eagle3 0)
    w_feature: float | None = None  # eagle1 1.0, eagle3 0 (no feature regression)
    w_token: float | None = None  # eagle1 0.1, eagle3 1.0
    ce_fraction: float | None = None  # <1: the cross-entropy on that random share of positions (default 1: all)
    draft_vocab_size: int | None = 16384  # None = the full target vocabulary
    # the head's layout (eagle.head.HeadConfig); both False is what vLLM's and SGLang's EAGLE-1 loaders build,
    # so the head can be exported to them (``eaglectl head export``)
    fc_bias: bool = False
    input_norm: bool = False
    # bf16 compute, fp32 master weights; None: on GPUs and on CPUs with native bf16 (eagle.runtime.native_bf16),
    # fp32 compute elsewhere (emulated bf16 matmuls ran ~6x slower than fp32 on an AVX2-only CPU); resolved on the driver
    autocast_bf16: bool | None = None
    rollout_depth: int | None = None  # >1: also train on the head's own predictions (training-time test); eagle1 1, eagle3 7
    metrics_depth: int = 5  # per-depth top-1 accuracy and simulated acceptance on held-out records
    checkpoint_every: int = 100  # optimizer steps
    log_every: int = 10
    seed: int = 0


@dataclass(frozen=True)
class EvalConfig:
    """Held-out bench (``jobs.evaluate``)."""

    prompts: int = 10  # MT-bench questions (first turn), spread evenly over its 8 categories
    max_new_tokens: int = 128
    dtype: str = "bfloat16"
    temperature: float = 0.0
    promote_tau: float | None = None  # promote the alias to production when tau >= this
    compile: str = "on"  # eagle.compile mode of the benched decoders (the fast path); --compile overrides
    use_gpu: bool = False  # bench on one GPU (as jobs.evaluate --gpu)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: str
    dataset: str
    data: DataConfig = field(default_factory=DataConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **sections: dict[str, Any]) -> "Preset":
        """A copy with fields replaced per section, e.g. ``with_overrides(train={"lr": 2e-3})``."""
        updated = {}
        for section, values in sections.items():
            if not values:
                continue
            current = getattr(self, section)
            unknown = set(values) - set(asdict(current))
            if unknown:
                raise EagleError(f"unknown {section} setting(s): {', '.join(sorted(unknown))}")
            updated[section] = replace(current, **values)
        return replace(self, **updated)


def smoke() -> Preset:
    """SmolLM2-135M through every stage in a few minutes: the fresh-machine test's preset
    (tests/test_fresh_machine.py runs ``make quickstart PRESET=smoke``). 64 conversations, 8 training steps,
    2 MT-bench prompts x 16 tokens, evaluated eagerly; the head it trains is not meant to be good, and
    nothing is promoted."""
    return Preset(
        name="smoke",
        description="SmolLM2-135M, every stage at toy size (fresh-machine test), ~5 minutes on 2 CPU cores",
        target="smollm2-135m",
        dataset="sharegpt-smoke",
        data=DataConfig(conversations=64, max_length=192, shard_records=32),
        features=FeatureConfig(workers=2, zero_stage=0, batch_tokens=2048, dtype="auto"),
        train=TrainConfig(
            workers=2, zero_stage=2, batch_tokens=2048, lr=2e-3, warmup_steps=2, epochs=1.0, max_steps=8,
            checkpoint_every=4, log_every=2, metrics_depth=2,
        ),
        # eager: compiling SmolLM2 (minutes on 2 cores) would dwarf 2 x 16 tokens of a head not meant to be good
        eval=EvalConfig(prompts=2, max_new_tokens=16, dtype="bfloat16", promote_tau=None, compile="off"),
    )


def gpu_smoke() -> Preset:
    """``smoke`` on one GPU (infra/gpu/check.sh): answers regenerated by the target on the GPU (this engine's
    continuous batching), features and training by one Ray Train worker each on that GPU (NCCL), the bench on
    it. Not run on a GPU in this repository yet."""
    base = smoke()
    return replace(
        base,
        name="gpu-smoke",
        description="SmolLM2-135M, every stage at toy size on one GPU (infra/gpu/check.sh)",
        dataset="sharegpt-gpu-smoke",
        data=replace(base.data, regenerate=True, regen_engine="eagle", regen_gpus=1, regen_max_new_tokens=64),
        features=replace(base.features, workers=1, use_gpu=True),
        train=replace(base.train, workers=1, use_gpu=True),
        eval=replace(base.eval, use_gpu=True),
    )


def quick() -> Preset:
    """SmolLM2-135M on this 2-core CPU in about 15 minutes end to end.

    400 ShareGPT conversations cut to 512 tokens (334 train records, 156k tokens, 114k of them assistant
    tokens), features by 2 replicated workers in bf16 where the CPU computes it natively, else fp32 (ZeRO
    stage 0: a 0.27 GB target fits every worker, and ZeRO-3's per-layer all-gathers only cost time here; the
    a100 presets partition), then 2 gloo workers
    train a 16k-draft-vocabulary head for 6.5 minutes at lr 2e-3 (STACK.md: lr 1e-3..2e-3 beats 3e-5 in
    short runs). Memory: the head is 4.3M params (~70 MB with AdamW state); nothing here is tight.
    """
    return Preset(
        name="quick",
        description="SmolLM2-135M, 400 ShareGPT conversations, ~15 minutes on 2 CPU cores",
        target="smollm2-135m",
        dataset="sharegpt-quick",
        data=DataConfig(conversations=400, max_length=512, shard_records=100),
        features=FeatureConfig(workers=2, zero_stage=0, batch_tokens=4096, dtype="auto"),
        train=TrainConfig(
            workers=2, zero_stage=2, batch_tokens=4096, lr=2e-3, warmup_steps=20, epochs=20.0,
            max_minutes=6.5, checkpoint_every=20, log_every=5,
        ),
        eval=EvalConfig(prompts=10, max_new_tokens=96, dtype="bfloat16", promote_tau=1.4),
    )


def quick_eagle3() -> Preset:
    """``quick`` with an EAGLE-3 head (arXiv 2503.01840): features also store the low / middle / high layers,
    the head fuses them and trains with the 7-step training-time test on the same data and the same 6.5
    training minutes (the side-by-side of docs/benchmarks.md)."""
    base = quick()
    return replace(
        base,
        name="quick-eagle3",
        description="quick, with an EAGLE-3 head (fused target layers, 7-step training-time test)",
        features=replace(base.features, aux_layers=True),
        train=replace(base.train, head_kind="eagle3"),
    )


def cpu_long() -> Preset:
    """SmolLM2-135M, the longer CPU run (<= 90 minutes on this 2-core machine).

    Where the time goes (docs/benchmarks.md section 4; a 2-core AMX Xeon, 2026-12-06). The 3,072-conversation
    run left the head fitting its data (training top-1 0.72-0.79 against 0.55 held out) while regeneration had
    become the cheap stage, so this preset buys twice the answers with fewer training minutes. Regeneration by
    this engine's continuous batching (~500 answer tok/s over the stage for bf16 greedy decoding of 64 answers
    at once on 2 cores): 6,144 first-turn answers capped at 192 new tokens (MT-bench benches the first 128
    generated tokens, so the head sees the part of an answer it is scored on) ~ 29 minutes. Features (1.4M
    tokens, replicated bf16 workers: a 135M target fits every worker, ZeRO-3 is for the A100 presets) ~ 8
    minutes. Training gets 34 minutes with a depth-2 training-time test (EAGLE-3): each step also trains on
    the head's own predicted features. It runs as one Ray Train rank on both cores (DeepSpeed ZeRO-2 at a
    world of one partitions nothing): the same 8,192-token step as two ranks of 4,096 made 1.17x the steps a
    minute (1,516 steps, 5.9 epochs, against 1,235 with two ranks; MT-bench tau 2.39 against 2.36). Steps of
    4,096 tokens for 40 minutes (2,921 steps, ~7 more minutes of wall) trained a head level with this one
    (tau 2.44 against 2.39 in bf16, 2.43 against 2.45 in fp32, 1.70 against 1.71 at T=1 over two seeds), and
    so did the cross-entropy on a quarter of the positions (``ce_fraction=0.25``) for 40 minutes, 1.8x the
    steps of 8,192 tokens (2.46 bf16, 2.46 fp32, 1.68 at T=1 over two seeds), so the preset keeps the cheaper run.
    Evaluation: 40 MT-bench prompts (5 per category) x 128 tokens, default tree, bf16 T=0, promotes at
    tau >= 2.0 (~4 minutes).
    """
    return Preset(
        name="cpu-long",
        description="SmolLM2-135M, 6,144 regenerated ShareGPT conversations, <= 90 minutes on 2 CPU cores",
        target="smollm2-135m",
        dataset="sharegpt-regen-6144",
        data=DataConfig(
            conversations=6144, max_length=640, regenerate=True, regen_max_new_tokens=192, regen_batch_size=64,
            regen_workers=1, shard_records=256,
            regen_engine="eagle",  # continuous batching: 1.77x HF generate's answer tok/s here (docs/benchmarks.md s10)
        ),
        features=FeatureConfig(workers=2, zero_stage=0, batch_tokens=8192, dtype="auto"),
        train=TrainConfig(
            # one rank on both cores: the same 8,192-token optimizer step as two ranks of 4,096 tokens each,
            # 1.17x the steps per minute (1.30 against 1.53 s a step in 2-minute runs, docs/bench/recipes/ranks.json)
            workers=1, zero_stage=2, batch_tokens=8192, lr=2e-3, warmup_steps=30, epochs=40.0,
            max_minutes=34.0, checkpoint_every=50, rollout_depth=2,
        ),
        eval=EvalConfig(prompts=40, max_new_tokens=128, dtype="bfloat16", promote_tau=2.0),
    )


def a100_7b() -> Preset:
    """A 7B LLaMA-class target (h=4096, 32 layers, vocab 32k-128k) on one 8 x A100-80GB node.

    Regeneration: 8 vLLM replicas of one GPU each through Ray Data LLM (14 GB of weights per GPU).

    Features: 8 ranks x ZeRO-3 -> 14 GB / 8 = 1.75 GB of weights per GPU + one gathered layer (0.4 GB);
    32k-token forward batches need ~10 GB of activations: fits with room. Offline features: 68k
    conversations ~ 60M tokens x 4096 x 2 B = 0.5 TB (S3).
    Head: ~0.24B params (fc 33.6M + layer 202M) x 16 B = 3.9 GB, ZeRO-2 over 8 ranks -> ~1 GB per GPU
    of optimizer state; logits 16k tokens x 32k x 4 B = 2 GB per micro batch. lr 3e-5 x 8 ranks x 2
    accumulation (the paper's lr at its 16-sequence batch, scaled linearly would overshoot; keep 3e-5
    warm-started over 2k steps and 20 epochs as in EAGLE).
    """
    return Preset(
        name="a100-7b",
        description="7B target, 1 node x 8 A100-80GB",
        target="<hf-dir-of-a-7b-model>",
        dataset="sharegpt-68k",
        data=DataConfig(conversations=68000, max_length=2048, regenerate=True, regen_batch_size=64, regen_workers=8, shard_records=1000,
                        regen_engine="vllm", regen_tensor_parallel=1, regen_group_shards=24),
        features=FeatureConfig(workers=8, zero_stage=3, use_gpu=True, batch_tokens=32768),
        train=TrainConfig(
            workers=8, use_gpu=True, zero_stage=2, batch_tokens=16384, grad_accum=2, lr=3e-5, warmup_steps=2000,
            epochs=20.0, draft_vocab_size=32000, checkpoint_every=1000, log_every=50,
        ),
        eval=EvalConfig(prompts=80, max_new_tokens=512, promote_tau=3.0),
    )


def a100_13b() -> Preset:
    """A 13B target (h=5120, 40 layers) on one 8 x A100-80GB node.

    Regeneration: 8 vLLM replicas of one GPU each through Ray Data LLM (26 GB of weights per GPU).

    Features: 26 GB of bf16 weights / 8 = 3.3 GB per GPU + a gathered layer (0.6 GB). Offline features:
    60M tokens x 5120 x 2 B = 0.6 TB. Head ~0.37B params x 16 B = 5.9 GB, ZeRO-2 over 8 -> ~1.4 GB
    per GPU; 16k-token micro batches with a 32k draft vocabulary: 2 GB of fp32 logits.
    """
    return Preset(
        name="a100-13b",
        description="13B target, 1 node x 8 A100-80GB",
        target="<hf-dir-of-a-13b-model>",
        dataset="sharegpt-68k",
        data=DataConfig(conversations=68000, max_length=2048, regenerate=True, regen_batch_size=48, regen_workers=8, shard_records=1000,
                        regen_engine="vllm", regen_tensor_parallel=1, regen_group_shards=24),
        features=FeatureConfig(workers=8, zero_stage=3, use_gpu=True, batch_tokens=24576),
        train=TrainConfig(
            workers=8, use_gpu=True, zero_stage=2, batch_tokens=16384, grad_accum=2, lr=3e-5, warmup_steps=2000,
            epochs=20.0, draft_vocab_size=32000, checkpoint_every=1000, log_every=50,
        ),
        eval=EvalConfig(prompts=80, max_new_tokens=512, promote_tau=3.0),
    )


def a100_33b() -> Preset:
    """A 33B target (h=6656, 60 layers) on two 8 x A100-80GB nodes, online features.

    Regeneration: 8 vLLM replicas, each tensor parallel over 2 GPUs, through Ray Data LLM (33 GB per GPU).

    Frozen target: 66 GB bf16 / 16 ranks = 4.1 GB per GPU + a gathered layer (1 GB). A feature dump would
    be 60M x 6656 x 2 B = 0.8 TB, so the trainer computes features in the loop (``online``) from the
    ZeRO-3-sharded target: each step = one frozen forward (~2 x 33B x tokens FLOPs) + the head's.
    Head ~0.62B params x 16 B = 10 GB, ZeRO-2 over 16 -> 0.6 GB per GPU; 8k-token micro batches keep
    logits (8k x 32k x 4 B = 1 GB) and the target's activations (~8 GB) well inside 80 GB.
    """
    return Preset(
        name="a100-33b",
        description="33B target, 2 nodes x 8 A100-80GB, online features",
        target="<hf-dir-of-a-33b-model>",
        dataset="sharegpt-68k",
        data=DataConfig(conversations=68000, max_length=2048, regenerate=True, regen_batch_size=64, regen_workers=8, shard_records=1000,
                        regen_engine="vllm", regen_tensor_parallel=2, regen_group_shards=24),
        features=FeatureConfig(workers=16, zero_stage=3, use_gpu=True, batch_tokens=16384),
        train=TrainConfig(
            workers=16, use_gpu=True, zero_stage=2, online=True, batch_tokens=8192, grad_accum=4, lr=3e-5,
            warmup_steps=2000, epochs=10.0, draft_vocab_size=32000, checkpoint_every=500, log_every=50,
        ),
        eval=EvalConfig(prompts=80, max_new_tokens=512, promote_tau=3.0),
    )


def a100_70b() -> Preset:
    """A 70B target (h=8192, 80 layers, GQA) on four 8 x A100-80GB nodes, online features.

    Regeneration: 8 vLLM replicas, each tensor parallel over 4 GPUs, through Ray Data LLM (35 GB per GPU).

    Frozen target: 140 GB bf16 / 32 ranks = 4.4 GB per GPU + a gathered layer (1.7 GB) + the embedding and
    LM head kept whole for the head (2 x 32k x 8192 x 2 B = 1 GB); ZeRO-3 prefetch bucket ~2 layers. Head ~0.9B params (fc 134M + layer ~0.8B) x 16 B = 14 GB, ZeRO-2 over 32 ranks ->
    0.45 GB per GPU of gradients/optimizer state + 1.8 GB of bf16 weights. 8k-token micro batches: logits
    8k x 32k x 4 B = 1 GB; the target's activations (no grad, one layer live) ~6 GB. Feature dumps would be
    1 TB, hence online. Inter-node all-gathers of the frozen weights dominate: 140 GB per step per node
    over 200 Gb/s InfiniBand ~ 6 s, amortised over 4 accumulation micro batches.
    """
    return Preset(
        name="a100-70b",
        description="70B target, 4 nodes x 8 A100-80GB, online features",
        target="<hf-dir-of-a-70b-model>",
        dataset="sharegpt-68k",
        data=DataConfig(conversations=68000, max_length=2048, regenerate=True, regen_batch_size=64, regen_workers=8, shard_records=1000,
                        regen_engine="vllm", regen_tensor_parallel=4, regen_group_shards=24),
        features=FeatureConfig(workers=32, zero_stage=3, use_gpu=True, batch_tokens=8192),
        train=TrainConfig(
            workers=32, use_gpu=True, zero_stage=2, online=True, batch_tokens=8192, grad_accum=4, lr=3e-5,
            warmup_steps=2000, epochs=10.0, draft_vocab_size=32000, checkpoint_every=500, log_every=50,
        ),
        eval=EvalConfig(prompts=80, max_new_tokens=512, promote_tau=3.0),
    )


PRESETS: dict[str, Callable[[], Preset]] = {
    "smoke": smoke,
    "gpu-smoke": gpu_smoke,
    "quick": quick,
    "quick-eagle3": quick_eagle3,
    "cpu-long": cpu_long,
    "a100-7b": a100_7b,
    "a100-13b": a100_13b,
    "a100-33b": a100_33b,
    "a100-70b": a100_70b,
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]()
    except KeyError:
        raise EagleError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
