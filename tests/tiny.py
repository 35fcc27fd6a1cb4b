"""Tiny random-weight targets for fast tests (several architectures), built from configs, no downloads."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eagle.target import Target

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_target(
    model_type: str = "llama",
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    layers: int = 2,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    logit_scale: float = 1.0,
) -> Target:
    """A random ``model_type`` target; ``logit_scale`` > 1 sharpens its next-token distributions."""
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        # random init is tiny (std 0.02): widen it so distributions are neither flat nor one-hot
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                torch.nn.init.normal_(parameter, std=0.5 / parameter.shape[1] ** 0.5)
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    # EAGLE_TEST_DEVICE=cuda runs the tests that use tiny targets on a GPU (infra/gpu/check.sh)
    model = model.to(dtype).to(os.environ.get("EAGLE_TEST_DEVICE", "cpu"))
    return Target(model, None, name=f"tiny-{model_type}", revision=f"seed-{seed}")
