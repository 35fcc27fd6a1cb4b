"""Shared fixtures: the real SmolLM2 target (loaded once per session) and offline settings."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32 (exact-equality tests belong in fp32, see ../shared/STACK.md)."""
    from eagle import load_target

    return load_target("smollm2-135m", dtype="float32")
