"""Pairs for the serving tests: tiny random-weight chat targets saved as Hugging Face folders (the SmolLM2
tokenizer and chat template on a 2-layer, 32-wide model: real text in, real text out, milliseconds per
token), heads for them, and a way to register a head in MLflow as training would."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eagle.head import EagleHead
from eagle.target import Target, load_target, materialize_builtin


def tiny_chat_target_dir(directory: Path, *, seed: int = 0, layers: int = 2, hidden: int = 32) -> Path:
    """A random LLaMA with SmolLM2's tokenizer (49,152 tokens), safetensors + tokenizer files; sharpened
    logits so greedy text is not uniform noise. Reuses the folder when it exists."""
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    smollm2_dir, _ = materialize_builtin("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        for parameter in model.parameters():
            if parameter.dim() == 2:
                torch.nn.init.normal_(parameter, std=1.5 / parameter.shape[1] ** 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_head_dir(target_dir: Path, directory: Path, *, seed: int = 0) -> Path:
    """A random-weight head for the target in ``target_dir`` (correctness does not depend on its quality)."""
    target = load_target(str(target_dir), dtype="float32")
    EagleHead.for_target(target, seed=seed).save_pretrained(directory)
    return Path(directory)


def memorised_head_dir(target: Target, directory: Path, prompts: list[str], max_new_tokens: int, *, steps: int = 80) -> Path:
    """A head trained on the greedy continuations of ``prompts`` only, so on them its drafts are mostly right
    and decode steps accept several tokens (random heads accept ~none): what resuming inside a step needs."""
    from eagle.generate import Decoder, GenerationConfig
    from eagle.loss import LossConfig, eagle_loss

    rows = []
    for prompt in prompts:
        ids = target.tokenizer.encode(prompt)
        rows.append(ids + Decoder(target, None).generate(ids, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids)
    length = min(len(row) for row in rows)
    tokens = torch.tensor([row[:length] for row in rows], device=target.device)  # [B, n]
    with torch.no_grad():
        features = target.backbone(input_ids=tokens).last_hidden_state  # [B, n, hidden]
    head = EagleHead.for_target(target, seed=0)
    head.train()
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(steps):
            loss, _ = eagle_loss(head, features, tokens, torch.ones_like(tokens), LossConfig(noise=0.0))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    head.eval()
    head.save_pretrained(directory)
    return Path(directory)


def plain_text(target: Target, prompt_ids: list[int], max_new_tokens: int) -> str:
    """Greedy plain decoding (no head) of ``prompt_ids``, decoded: what the API must return at T=0."""
    from eagle.generate import Decoder, GenerationConfig

    return Decoder(target, None).generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens)).text


def register_head(head_dir: Path, target: Target, *, alias: str = "production") -> str:
    """Log ``head_dir`` to a finished run and register it as ``<target>-eagle``; point ``alias`` at it."""
    from eagle_platform.registry import Registry

    registry = Registry()
    registry.register_target(target.name, target.revision, {"test": True})
    run_id = registry.runs.start_run("eagle-test-serving", f"head-{Path(head_dir).name}")
    registry.runs.log_artifact(run_id, head_dir, "head")
    registry.runs.finish_run(run_id)
    return registry.register_head(run_id, "head", target.name, target.revision, alias=alias)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
