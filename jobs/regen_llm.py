"""Regeneration on vLLM through Ray Data LLM (``ray.data.llm``): ``regen_engine: vllm`` of ``jobs.prepare_data``.

On GPUs, HF ``generate`` in one actor per GPU wastes the cluster (a batch runs until its longest answer
ends), and a 33B or 70B target fits no single GPU. With ``regen_engine: vllm`` the answers come from vLLM,
driven by one of Ray Data's LLM processors:

- by default ``vLLMEngineProcessorConfig``: ``regen_workers`` vLLM engine replicas, each tensor parallel
  over ``regen_tensor_parallel`` GPUs (or, with ``regen_vllm_cpus``, on that many CPU cores with vLLM's
  CPU build), fed ``regen_batch_size`` prompts per batch (vLLM schedules them continuously). vLLM pins an
  older transformers than this project's, so it cannot share the job's environment (the same reason
  ``infra/bench/peers.sh`` keeps it in a venv of its own): the replicas either install vLLM
  (``VLLM_REQUIREMENT``) into their own Ray runtime environment (``pip``) when they start, or run the
  Python named by ``regen_vllm_python`` (``py_executable``: a venv with vLLM and this project's Ray).
- with ``regen_endpoint``: ``HttpRequestProcessorConfig`` against an OpenAI-compatible vLLM server that
  already serves the target (``/v1/completions`` with token-id prompts and ``return_token_ids``), from
  ``regen_workers`` Ray Data actors; each sends its batch's requests one after another, so ``regen_workers``
  requests are in flight. The manifest records the job's regeneration dtype (bf16 by default) as the
  answers' dtype: the server must run the target in it, which nothing here can check.

tests/test_regen_llm.py runs both for real on CPU with SmolLM2: the engine processor with one replica on
every CPU of the Ray instance in ``infra/bench/peers.sh``'s vLLM venv, the HTTP processor against that venv's server
(``peers.sh vllm-serve``). GPU replicas (``regen_vllm_cpus: 0``, the A100 presets) have not run.

Both send the prompts the driver renders (``prepare_data.chat_prompt``, the target's chat template) as token
ids, sample from the target's own distribution (temperature ``regen_temperature``, no top-k / top-p / min-p,
no repetition penalty: a server's generation-config defaults are overridden), stop at the target's stop ids
and cap each answer at what still fits under ``max_length``. Turns are answered by the same loop as the
other engines (``prepare_data.answer_turns``), and the shards are written in the same layout.

Shards go through in groups of ``regen_group_shards`` shards (0: all pending shards in one group): one Ray
Data pass per group and turn. Each pass starts the processor's actors afresh, which for the engine processor
is a model load per replica (minutes at 70B), so fewer, larger groups waste less; a group's shards are
written as soon as its last turn is answered, so a killed job loses at most the group in flight (a rerun
skips written shards, as with the other engines). The A100 presets take 24 shards (24k conversations) per
group.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

from tqdm import tqdm

from eagle.errors import EagleError
from jobs.common import init_ray
from jobs.presets import DataConfig

logger = logging.getLogger("jobs.regen_llm")

HTTP_CLIENT_CPUS = 0.25  # a Ray Data HTTP actor waits on the server; it needs no whole core
# The pre/postprocess maps build one small dict per row and reserve no CPU: CPU replicas may hold every CPU of
# the cluster (one 2-CPU replica on a 2-CPU Ray instance), and a map task that waits for a free CPU then never
# runs (seen with Ray Data's default of 1 and with 0.25: Ray could place neither beside the replica).
MAP_CPUS = 0
VLLM_REQUIREMENT = "vllm==0.32.0"  # the version infra/bench/peers.sh benchmarks (its CPU build); tests check both agree


def sampling(config: DataConfig, budget: int, seed: int, stop_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM sampling parameters for one prompt: the target's own distribution, its stop ids, the budget."""
    return {
        "temperature": float(config.regen_temperature),
        "top_p": 1.0,
        "top_k": 0,  # vLLM: 0 = off
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": budget,
        "seed": seed,
        "stop_token_ids": list(stop_ids),
    }


def normalize_answer(tokens: Sequence[int], budget: int, stop_ids: Sequence[int]) -> list[int]:
    """Answer ids ending with a stop id exactly when the target stopped (``prepare_data.Answerer``'s contract).

    vLLM keeps the stop token among the generated ids, for the model's EOS and for ``stop_token_ids`` alike
    (vLLM 0.32, ``vllm/v1/core/sched/utils.py: check_stop`` tests the id already appended); should a build
    leave it out, an answer shorter than its budget still ended by itself, and gets ``stop_ids[0]``
    appended. An answer of ``budget`` ids without a stop id was cut.
    """
    tokens = [int(t) for t in tokens]
    if tokens and tokens[-1] in stop_ids:
        return tokens
    if len(tokens) < budget:
        return tokens + [int(stop_ids[0])]
    return tokens


# --------------------------------------------------------------------------------------------------
# The processor (Ray Data LLM): rows {key, prompt_ids, budget, seed} -> rows {key, tokens}
# --------------------------------------------------------------------------------------------------


def build_processor_config(config: DataConfig, model_dir: str, dtype: str):
    """The Ray Data LLM processor config for ``config``: HTTP against ``regen_endpoint``, else vLLM engines."""
    from ray.data.llm import HttpRequestProcessorConfig, vLLMEngineProcessorConfig

    if config.regen_endpoint is not None:
        return HttpRequestProcessorConfig(
            url=config.regen_endpoint.rstrip("/") + "/v1/completions",
            batch_size=config.regen_batch_size,
            concurrency=config.regen_workers,
            max_retries=3,
            http_request_stage={"num_cpus": HTTP_CLIENT_CPUS},
        )
    if config.regen_vllm_python:
        runtime_env: dict[str, Any] = {"py_executable": config.regen_vllm_python}
    else:
        runtime_env = {"pip": [VLLM_REQUIREMENT]}
    placement = None
    if config.regen_vllm_cpus:  # vLLM's CPU build: one bundle of cores per replica, its VLLM_CPU_* settings
        placement = {"bundles": [{"CPU": config.regen_vllm_cpus}]}
        runtime_env["env_vars"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}
    return vLLMEngineProcessorConfig(
        model_source=model_dir,
        engine_kwargs={
            "tensor_parallel_size": config.regen_tensor_parallel,
            "max_model_len": config.max_length,
            "dtype": dtype,
            "enable_prefix_caching": True,  # turn k's prompt starts with turn k-1's
        },
        concurrency=config.regen_workers,
        batch_size=config.regen_batch_size,
        runtime_env=runtime_env,
        placement_group_config=placement,
        # the driver sends token ids and decodes the answers itself: no chat template, tokenizer or
        # detokenizer stages in the pipeline
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
    )


def _http_request(row: dict[str, Any], config: DataConfig, stop_ids: Sequence[int]) -> dict[str, Any]:
    return {
        "key": row["key"],
        "budget": row["budget"],
        "payload": {
            "prompt": list(row["prompt_ids"]),
            "return_token_ids": True,
            "skip_special_tokens": False,
            **sampling(config, int(row["budget"]), int(row["seed"]), stop_ids),
        },
    }


def _engine_request(row: dict[str, Any], config: DataConfig, stop_ids: Sequence[int]) -> dict[str, Any]:
    return {
        "key": row["key"],
        "budget": row["budget"],
        "tokenized_prompt": list(row["prompt_ids"]),
        "sampling_params": {**sampling(config, int(row["budget"]), int(row["seed"]), stop_ids), "detokenize": False},
    }


def _http_answer(row: dict[str, Any], stop_ids: Sequence[int]) -> dict[str, Any]:
    choice = row["http_response"]["choices"][0]
    if choice.get("token_ids") is None:
        raise EagleError(f"the server at regen_endpoint returned no token_ids: it must be vLLM (return_token_ids): {choice}")
    return {"key": row["key"], "tokens": normalize_answer(choice["token_ids"], int(row["budget"]), stop_ids)}


def _engine_answer(row: dict[str, Any], stop_ids: Sequence[int]) -> dict[str, Any]:
    return {"key": row["key"], "tokens": normalize_answer(row["generated_tokens"], int(row["budget"]), stop_ids)}


def build_answer_processor(config: DataConfig, model_dir: str, dtype: str, stop_ids: Sequence[int]):
    """The Ray Data LLM processor: a function from a dataset of rows ``{key, prompt_ids, budget, seed}`` to a
    dataset of rows ``{key, tokens}`` (``normalize_answer``)."""
    from ray.data.llm import build_processor

    stop_ids = list(stop_ids)
    processor_config = build_processor_config(config, model_dir, dtype)
    http = config.regen_endpoint is not None
    request, answer = (_http_request, _http_answer) if http else (_engine_request, _engine_answer)
    return build_processor(
        processor_config,
        preprocess=lambda row: request(row, config, stop_ids),
        postprocess=lambda row: answer(row, stop_ids),
        preprocess_map_kwargs={"num_cpus": MAP_CPUS},
        postprocess_map_kwargs={"num_cpus": MAP_CPUS},
    )


# --------------------------------------------------------------------------------------------------
# Driving the shards
# --------------------------------------------------------------------------------------------------


def regenerate_shards_on_vllm(todo, on_done, *, target, dtype: str, config: DataConfig, progress: bool) -> None:
    """Regenerate ``todo`` (``prepare_data.ShardWork``) on vLLM through Ray Data, ``regen_group_shards`` shards
    per group; each finished shard goes to ``on_done`` with its ``RegenStats`` (the group's seconds split by
    answer tokens). ``target`` is ``prepare_data.TargetInfo``: no weights load on the driver."""
    import ray

    from jobs.prepare_data import RegenStats, answer_budget, answer_turns

    init_ray()
    processor = build_answer_processor(config, str(target.directory), dtype, target.eos_token_ids)
    group_size = config.regen_group_shards or len(todo)
    groups = [todo[i : i + group_size] for i in range(0, len(todo), group_size)]
    with tqdm(total=len(todo), desc="regenerate (vllm)", unit="shard", disable=not progress) as bar:
        for group in groups:
            conversations = [conv for shard in group for conv in shard.conversations]
            passes = 0

            def answer(prompts: list[list[int]], seed: int) -> list[list[int]]:
                nonlocal passes
                passes += 1
                rows = [
                    {"key": key, "prompt_ids": prompt, "budget": answer_budget(len(prompt), config.regen_max_new_tokens, config.max_length),
                     "seed": (seed * 1_000_003 + key) % (1 << 31)}
                    for key, prompt in enumerate(prompts)
                ]
                started = time.perf_counter()
                out = processor(ray.data.from_items(rows)).take_all()
                by_key = {int(r["key"]): list(r["tokens"]) for r in out}
                if len(by_key) != len(rows):
                    raise EagleError(f"Ray Data LLM returned {len(by_key)} answers for {len(rows)} prompts")
                logger.info("pass %d: %d prompts answered in %.1f s", passes, len(rows), time.perf_counter() - started)
                return [by_key[key] for key in range(len(rows))]

            started = time.perf_counter()
            done, costs = answer_turns(conversations, target.tokenizer, target.eos_token_ids, answer, config,
                                       seed=group[0].seed)
            seconds = time.perf_counter() - started
            total_tokens = max(1, sum(cost.answer_tokens for cost in costs))
            start = 0
            for shard in group:  # each shard gets its own conversations, answers and tokens back
                end = start + len(shard.conversations)
                shard_costs = costs[start:end]
                stats = RegenStats.total(shard_costs, 0.0)
                # the group's passes were shared: a shard's seconds are its share of the answer tokens
                stats = RegenStats(stats.answers, stats.answer_tokens, seconds * stats.answer_tokens / total_tokens)
                on_done(shard, [conv for conv in done[start:end] if conv is not None], stats)
                start = end
            bar.update(len(group))
