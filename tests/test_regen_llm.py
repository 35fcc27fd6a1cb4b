"""jobs.regen_llm: regeneration on vLLM through Ray Data LLM (``regen_engine: vllm``).

The HTTP processor runs for real: vLLM's CPU build (``infra/bench/peers.sh vllm-serve``, in its own venv of
pinned packages outside the checkout, built on first use: ~10 minutes) serves SmolLM2, and
``jobs.prepare_data`` regenerates through Ray Data's ``HttpRequestProcessorConfig`` on a local Ray cluster. The
engine processor (``vLLMEngineProcessorConfig``) places its replicas on GPU bundles, so here it is built and its
settings checked, not run.
"""

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import ray

from eagle.data import Conversation, load_sharegpt, tokenize
from eagle.errors import EagleError
from eagle.target import materialize_builtin
from jobs import layout
from jobs.prepare_data import answer_budget, chat_prompt, content_settings, describe_target, main, prepare, validate
from jobs.presets import DataConfig, get_preset
from jobs.regen_llm import VLLM_REQUIREMENT, build_answer_processor, build_processor_config, normalize_answer, sampling
from jobs.storage import Storage, unpack_records

REPO = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m"
VLLM = dict(regenerate=True, regen_engine="vllm")


# ---- the rules, without a server ---------------------------------------------------------------------


def test_an_answer_ends_with_a_stop_id_exactly_when_the_target_stopped():
    stop = [2, 0]
    assert normalize_answer([5, 6, 2], budget=8, stop_ids=stop) == [5, 6, 2]  # stopped, id returned
    assert normalize_answer([5, 6], budget=8, stop_ids=stop) == [5, 6, 2]  # stopped, id left out by the engine
    assert normalize_answer([5, 6, 7], budget=3, stop_ids=stop) == [5, 6, 7]  # cut at the budget
    assert normalize_answer([5, 6, 0], budget=3, stop_ids=stop) == [5, 6, 0]  # stopped on its last allowed id
    assert normalize_answer([], budget=4, stop_ids=stop) == [2]  # stopped at once


def test_budget_and_sampling_follow_the_data_settings():
    config = DataConfig(max_length=100, regen_max_new_tokens=30, regen_temperature=0.7, **VLLM)
    budget = lambda prompt: answer_budget(prompt, config.regen_max_new_tokens, config.max_length)  # noqa: E731
    assert budget(10) == 30 and budget(80) == 20 and budget(99) == 1
    assert answer_budget(99, 30, None) == 30  # no max_length: the cap alone
    params = sampling(config, 20, seed=5, stop_ids=[2])
    # the target's own distribution: nothing a server's generation-config defaults could add stays on
    assert params == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                      "max_tokens": 20, "seed": 5, "stop_token_ids": [2]}


def test_engine_processor_runs_tensor_parallel_replicas_on_token_ids(tmp_path):
    config = DataConfig(max_length=2048, regen_batch_size=32, regen_workers=8, regen_tensor_parallel=4, **VLLM)
    engine = build_processor_config(config, "/models/70b", "bfloat16")
    assert type(engine).__name__ == "vLLMEngineProcessorConfig"
    assert engine.model_source == "/models/70b" and engine.concurrency == 8 and engine.batch_size == 32
    assert engine.engine_kwargs["tensor_parallel_size"] == 4 and engine.engine_kwargs["max_model_len"] == 2048
    assert engine.engine_kwargs["dtype"] == "bfloat16"
    # vLLM goes into the replicas' own runtime env, at the version the bench's CPU build runs
    assert engine.runtime_env == {"pip": [VLLM_REQUIREMENT]}
    assert f'VLLM_VERSION={VLLM_REQUIREMENT.split("==")[1]}' in (REPO / "infra/bench/peers.sh").read_text()
    # the driver sends token ids and decodes itself: no template, tokenizer or detokenizer stage
    assert (engine.chat_template_stage, engine.tokenize_stage, engine.detokenize_stage) == (False, False, False)
    cpu = build_processor_config(replace(config, regen_tensor_parallel=1, regen_vllm_cpus=2, regen_vllm_python="/v/bin/python"),
                                 "/models/7b", "float32")
    assert [dict(b) for b in cpu.placement_group_config["bundles"]] == [{"CPU": 2, "GPU": 0}]  # one bundle, no GPU
    assert cpu.runtime_env["py_executable"] == "/v/bin/python"
    http = build_processor_config(replace(config, regen_endpoint="http://127.0.0.1:9/"), "/models/70b", "bfloat16")
    assert type(http).__name__ == "HttpRequestProcessorConfig"
    assert http.url == "http://127.0.0.1:9/v1/completions" and http.concurrency == 8


def test_a100_presets_regenerate_on_vllm_replicas_that_fit_their_gpus():
    """80 GB A100s, bf16 weights: the weights of one replica take at most half of its GPUs' memory."""
    billions = {"a100-7b": 7, "a100-13b": 13, "a100-33b": 33, "a100-70b": 70}
    for name, params in billions.items():
        data = get_preset(name).data
        validate(data)
        assert data.regen_engine == "vllm" and data.regen_endpoint is None and data.regen_gpus == 0
        assert params * 2 / data.regen_tensor_parallel <= 40, name
        workers = get_preset(name).features.workers  # the GPUs the preset's cluster has
        assert data.regen_workers * data.regen_tensor_parallel <= workers, name


def test_vllm_settings_are_checked_and_the_endpoint_is_execution_only(capsys, tmp_path):
    base = DataConfig(**VLLM)
    with pytest.raises(EagleError, match="regen_gpus is for the hf and eagle engines"):
        validate(replace(base, regen_gpus=1))
    with pytest.raises(EagleError, match="must be an http"):
        validate(replace(base, regen_endpoint="127.0.0.1:8000"))
    with pytest.raises(EagleError, match="are for regen_engine vllm"):
        validate(DataConfig(regenerate=True, regen_endpoint="http://127.0.0.1:8000"))
    with pytest.raises(EagleError, match="regen_tensor_parallel must be >= 1"):
        validate(replace(base, regen_tensor_parallel=0))
    with pytest.raises(EagleError, match="must be 1 for CPU replicas"):
        validate(replace(base, regen_vllm_cpus=2, regen_tensor_parallel=2))
    with pytest.raises(EagleError, match="are for regen_engine vllm"):
        validate(DataConfig(regenerate=True, regen_engine="eagle", regen_vllm_cpus=1))
    # where vLLM runs does not change the answers; the replicas' tensor parallelism rounds differently
    elsewhere = replace(base, regen_endpoint="http://h:1", regen_vllm_python="/opt/vllm/bin/python")
    elsewhere = replace(elsewhere, regen_group_shards=3)
    assert content_settings(base, "bfloat16") == content_settings(elsewhere, "bfloat16")
    assert content_settings(replace(base, regen_tensor_parallel=2), "bfloat16") != content_settings(base, "bfloat16")
    assert content_settings(replace(base, regen_vllm_cpus=4), "bfloat16") != content_settings(base, "bfloat16")  # CPU kernels
    # datasets made by the other engines keep the identity they had before these settings existed
    new = {"regen_tensor_parallel", "regen_endpoint", "regen_vllm_cpus", "regen_vllm_python", "regen_group_shards"}
    assert not new & set(content_settings(DataConfig(regenerate=True), "bfloat16"))
    assert main(["--storage", str(tmp_path / "s"), "--regen-engine", "vllm", "--regen-gpus", "1"]) == 2
    assert "regen_gpus is for the hf and eagle engines" in capsys.readouterr().err


# ---- for real: Ray Data LLM's HTTP processor against vLLM's CPU build ------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """vLLM's OpenAI server (CPU build) serving SmolLM2 on a free loopback port, in float32 and without prefix
    caching: the test asks each prompt again and compares greedy answers token for token, which in bf16 can
    differ between a prompt decoded beside another and alone, or prefilled from the cache."""
    model_dir = materialize_builtin(TARGET)[0]
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "serve.log"
    with open(log_path, "w") as log:
        env = dict(os.environ, VLLM_DTYPE="float32", VLLM_SERVE_ARGS="--no-enable-prefix-caching")
        process = subprocess.Popen([str(REPO / "infra/bench/peers.sh"), "vllm-serve", str(model_dir), str(port), "8"],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1500  # a first use builds vLLM's venv (~10 min), then ~1.5 min to serve
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up in 25 minutes:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield base
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)


@pytest.fixture
def ray_cluster():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def _records(data: Storage, split: str) -> dict[str, dict]:
    """conversation id -> record, over every shard of ``split``."""
    out = {}
    for name in data.list(split):
        ids = json.loads(data.read_tensor_metadata(f"{split}/{name}")["ids"])
        out.update(zip(ids, unpack_records(data.read_tensors(f"{split}/{name}")), strict=True))
    return out


def _check_against_the_server(root, preset, manifest, server: str) -> None:
    """Every record is the conversation made of the server's own answers to its turns (asked again here,
    one request at a time, greedy), and an answer cut at its budget is rendered without <|im_end|>."""
    config = preset.data
    target = describe_target(TARGET)
    tokenizer = target.tokenizer
    data = layout.dataset_storage(str(root), TARGET, preset.dataset).child(layout.DATA)
    records = {**_records(data, "train"), **_records(data, "eval")}
    assert sum(entry["records"] for entry in manifest["splits"].values()) == len(records) > 0
    source = {conv.id: conv for conv in load_sharegpt(limit=config.conversations)}
    cut = 0
    for conv_id, record in records.items():
        questions = [text for role, text in source[conv_id].turns if role == "user"][: config.regen_turns]
        history: list[dict[str, str]] = []
        unfinished = False
        for question in questions:
            messages = history + [{"role": "user", "content": question}]
            prompt = chat_prompt(tokenizer, messages)
            if len(prompt) >= config.max_length:
                break
            budget = answer_budget(len(prompt), config.regen_max_new_tokens, config.max_length)
            reply = httpx.post(server + "/v1/completions", timeout=120, json={
                "prompt": prompt, "return_token_ids": True, "skip_special_tokens": False,
                **sampling(config, budget, 0, target.eos_token_ids)}).json()["choices"][0]
            tokens = normalize_answer(reply["token_ids"], budget, target.eos_token_ids)
            history = messages + [{"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}]
            if tokens[-1] not in target.eos_token_ids:
                unfinished = True
                break
        cut += unfinished
        expected = tokenize(tokenizer, Conversation(conv_id, tuple((m["role"], m["content"]) for m in history),
                                                    unfinished=unfinished), config.max_length)
        assert record["input_ids"].tolist() == expected.input_ids, conv_id
        assert record["loss_mask"].tolist() == expected.loss_mask, conv_id
    assert cut > 0  # 24 answer tokens: most answers are cut, and those have no <|im_end|> after them


def _preset(**data):
    settings = dict(VLLM, max_length=192, shard_records=3, eval_fraction=0.2, regen_max_new_tokens=24, **data)
    return replace(get_preset("quick").with_overrides(data=settings), dataset="test")


@pytest.mark.e2e
@pytest.mark.nightly  # vLLM interop in `make test`: tests/test_formats.py loads exported heads in vLLM
def test_prepare_data_regenerates_through_ray_data_llm_on_vllm(tmp_path, vllm_server, ray_cluster):
    """Two turns through Ray Data's HTTP processor against vLLM's server, two requests in flight: the records
    are the server's answers, turn 2 asked after the server's own answer to turn 1."""
    preset = _preset(conversations=10, regen_turns=2, regen_batch_size=2, regen_workers=2, regen_endpoint=vllm_server,
                     regen_group_shards=2)  # 4 shards: 2 groups x 2 turns = 4 passes
    manifest = prepare(preset, str(tmp_path), regen_dtype="float32", progress=False)  # the server's dtype
    assert manifest["config"]["regen_engine"] == "vllm"
    assert manifest["regeneration"]["answer_tokens"] > 0 and manifest["regeneration"]["dtype"] == "float32"
    _check_against_the_server(tmp_path, preset, manifest, vllm_server)


@pytest.mark.e2e
@pytest.mark.nightly  # vLLM interop in `make test`: tests/test_formats.py loads exported heads in vLLM
def test_prepare_data_regenerates_on_a_vllm_engine_replica_in_ray_data(tmp_path, vllm_server, ray_cluster, monkeypatch):
    """Ray Data's vLLM engine processor with one replica on both CPUs of the 2-CPU Ray instance (vLLM's CPU
    build, the Python of peers.sh's venv), decoding four prompts at a time, all shards in one pass (one
    engine start, ~100 s): the pre/postprocess maps still schedule beside a replica that holds every whole
    CPU (with Ray Data's 1-CPU default they never did), and its records are what the same vLLM serves."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; passed on to the replica (VLLM_CPU_*)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    python = subprocess.run([str(REPO / "infra/bench/peers.sh"), "vllm-python"], capture_output=True, text=True,
                            check=True).stdout.strip()
    preset = _preset(conversations=6, regen_batch_size=4, regen_workers=1, regen_vllm_cpus=2, regen_vllm_python=python)
    manifest = prepare(preset, str(tmp_path), regen_dtype="float32", progress=False)
    assert manifest["config"]["regen_vllm_cpus"] == 2 and manifest["regeneration"]["answer_tokens"] > 0
    _check_against_the_server(tmp_path, preset, manifest, vllm_server)
