"""Resuming training without unpickling code: DeepSpeed checkpoints loaded with ``torch.load(weights_only=True)``.

DeepSpeed's ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)``: a full unpickle, which
runs whatever a file in the results folder tells it to, so anyone who can write that folder could run code
in the training workers. ``SafeCheckpointEngine`` loads the same files with PyTorch's restricted unpickler
(tensors, containers and primitives only) plus the three plain-data classes DeepSpeed 0.19 writes into its
ZeRO optimizer states (found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on stage 0, 2
and 3 checkpoints): an ``IntEnum``, a dataclass and the loss-scaler's attribute bag, which the restricted
unpickler builds without calling any of their code. Anything else in a checkpoint fails the load with a
one-line ``UntrustedCheckpointError`` instead of running.
"""

from __future__ import annotations

import pickle

import torch

from eagle.errors import EagleError


class UntrustedCheckpointError(EagleError):
    """A checkpoint file holds something other than tensors and DeepSpeed's known plain-data classes."""


def _deepspeed_safe_globals() -> list[type]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def safe_load(path: str, map_location=None):
    """``torch.load(path, weights_only=True)`` allowing DeepSpeed's plain-data classes; refuses anything else."""
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "Unsupported global" in line), "not tensors only")
        raise UntrustedCheckpointError(f"refusing to load the checkpoint {path}: {detail}") from None


def install(engine) -> None:
    """Make ``engine`` (a DeepSpeed engine) load its checkpoints with ``safe_load``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return safe_load(path, map_location=map_location)

    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise EagleError(f"unexpected DeepSpeed checkpoint engine {type(current).__name__}: only the torch engine is made safe")
    safe = SafeCheckpointEngine.__new__(SafeCheckpointEngine)
    safe.__dict__.update(vars(current))  # the same engine (its serialization settings), with a safe load
    engine.checkpoint_engine = safe
