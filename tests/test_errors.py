"""Bad input gets one clear error: unknown target, mismatched head, empty prompt, bad sampling settings."""

import json

import pytest
import torch

from eagle import Decoder, EagleError, EagleHead, GenerationConfig, HeadMismatchError, SamplingConfig, UnknownTargetError, load_target
from eagle.cli import main
from eagle.target import adapter_for
from tiny import tiny_target


def test_unknown_target_names_the_choices(tmp_path):
    with pytest.raises(UnknownTargetError, match="unknown target 'gpt-9'.*smollm2-135m"):
        load_target("gpt-9")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UnknownTargetError, match="no \\*.safetensors"):
        load_target(str(tmp_path))


def test_unknown_architecture_is_refused():
    class Config:
        model_type = "gpt2"

    with pytest.raises(EagleError, match="unsupported target architecture 'gpt2'.*llama"):
        adapter_for(Config())


def test_head_for_another_target_is_refused(tmp_path):
    small = tiny_target("llama", vocab_size=64)
    other_vocab = tiny_target("llama", vocab_size=80)
    other_arch = tiny_target("qwen2", vocab_size=64)
    EagleHead.for_target(small).save_pretrained(tmp_path / "head")
    with pytest.raises(HeadMismatchError, match="vocabulary 64 != target's 80"):
        EagleHead.from_pretrained(tmp_path / "head", other_vocab)
    with pytest.raises(HeadMismatchError, match="architecture 'llama' != target's 'qwen2'"):
        EagleHead.from_pretrained(tmp_path / "head", other_arch)
    with pytest.raises(EagleError, match="not a head directory"):
        EagleHead.from_pretrained(tmp_path, small)


@pytest.mark.parametrize("edit,message", [
    ({"layer_config": {"intermediate_size": 10**9}}, "intermediate_size = 1000000000 is over"),
    ({"layer_config": {"num_attention_heads": 0}}, "num_attention_heads must be a positive integer"),
    ({"layer_config": {"num_hidden_layers": 64}}, "num_hidden_layers must be 1"),
    ({"draft_vocab_size": 10**9}, "draft_vocab_size must be in"),
])
def test_a_head_config_out_of_bounds_is_refused_before_anything_is_allocated(tmp_path, edit, message):
    """A hot swap reads a registry head's config.json: sizes past the bounds fail in check_compatible, before
    ``EagleHead(config)`` would allocate them (a 10^9-wide MLP would be ~256 GB here)."""
    import json
    import resource

    target = tiny_target("llama", vocab_size=64)
    EagleHead.for_target(target).save_pretrained(tmp_path / "head")
    path = tmp_path / "head" / "config.json"
    config = json.loads(path.read_text())
    for key, value in edit.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(config))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(HeadMismatchError, match=message):
        EagleHead.from_pretrained(tmp_path / "head", target)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing large was allocated


def test_head_round_trips_through_safetensors(tmp_path):
    target = tiny_target("qwen2")
    head = EagleHead.for_target(target, seed=4, draft_token_ids=torch.arange(10, 50))
    head.save_pretrained(tmp_path / "head")
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["model_type"] == "qwen2"
    loaded = EagleHead.from_pretrained(tmp_path / "head", target)
    assert loaded.draft_to_target(torch.tensor([0, 39])).tolist() == [10, 49]
    for key, value in head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    prompt = list(range(1, 12))
    config = GenerationConfig(max_new_tokens=20, stop_token_ids=[])
    assert Decoder(target, head).generate(prompt, config).token_ids == Decoder(target, loaded).generate(prompt, config).token_ids


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: GenerationConfig(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (lambda: GenerationConfig(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
        (lambda: SamplingConfig(temperature=-0.1), "temperature must be 0 \\(greedy\\) or in"),
        (lambda: SamplingConfig(temperature=1e-300), "temperature must be 0 \\(greedy\\) or in"),
        (lambda: GenerationConfig(seed=2**64), "seed must be an integer in"),
        (lambda: SamplingConfig(temperature=1.0, top_p=0.0), "top_p must be in \\(0, 1\\]"),
        (lambda: SamplingConfig(temperature=1.0, top_p=1.5), "top_p must be in \\(0, 1\\]"),
        (lambda: SamplingConfig(top_k=-1), "top_k must be >= 0"),
    ],
)
def test_bad_settings_raise_clear_errors(make, message):
    with pytest.raises(EagleError, match=message):
        make()


def test_bad_requests_raise_clear_errors():
    target = tiny_target("llama")
    decoder = Decoder(target, EagleHead.for_target(target))
    with pytest.raises(EagleError, match="the prompt is empty"):
        decoder.generate([])
    with pytest.raises(EagleError, match="token ids must lie in"):
        decoder.generate([1, 2, 999])
    with pytest.raises(EagleError, match="context window of 1024 tokens"):
        decoder.generate([1] * 1000, GenerationConfig(max_new_tokens=100))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--target", "gpt-9", "--prompt", "hi"], "unknown target 'gpt-9'"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature must be 0 (greedy)"),
        (["generate", "--prompt", "hi", "--dtype", "int8"], "invalid choice"),
        (["generate"], "one of the arguments --prompt --chat is required"),
        (["bench", "--out", "x.json", "--baselines", "vllm"], "unknown baseline"),
        (["bench", "--out", "x.json", "--prompts", "/nonexistent.jsonl"], "nonexistent.jsonl"),
        (["generate", "--prompt", "hi", "--device", "gpu"], "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        (["profile", "--device", "cuda:63"], "device 'cuda:63': this process sees"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert message in err[0]


def test_devices_are_checked_for_spelling_and_presence():
    from eagle.target import check_device

    assert check_device("cpu") == "cpu"
    for spelled in ("cuda", "cuda:0", "cuda:12"):
        assert check_device(spelled, present=False) == spelled
    for bad in ("gpu", "CUDA", "cuda:", "cuda:-1", "cuda:0 ", "", None):
        with pytest.raises(EagleError, match="device must be"):
            check_device(bad, present=False)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(EagleError, match=f"sees {visible} CUDA GPU"):
        check_device(f"cuda:{visible}")
    with pytest.raises(EagleError, match="sees"):  # before any weight is read
        load_target("smollm2-135m", device=f"cuda:{visible}")


def test_local_hf_directory_loads_as_a_target(tmp_path):
    tiny = tiny_target("qwen2", dtype=torch.float32)
    tiny.model.save_pretrained(tmp_path / "model", safe_serialization=True)
    target = load_target(str(tmp_path / "model"), dtype="float32")
    assert target.name == "model" and target.revision.startswith("dir-sha256:")
    assert target.config.model_type == "qwen2" and target.tokenizer is None
    prompt = [4, 8, 15, 16, 23, 42]
    config = GenerationConfig(max_new_tokens=12, stop_token_ids=[])
    assert Decoder(target).generate(prompt, config).token_ids == Decoder(tiny).generate(prompt, config).token_ids
    with pytest.raises(EagleError, match="has no tokenizer"):
        target.encode("hello")
