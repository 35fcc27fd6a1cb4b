"""EAGLE speculative decoding: the algorithm (PyTorch + transformers only; no Ray, MLflow or HTTP).

Public front: ``load_target``, ``EagleHead``, ``Decoder``, ``GenerationConfig``, ``SamplingConfig``,
``StaticTree`` / ``DynamicTree``. See eagle/README.md for the module map and how to add an architecture.
"""

from eagle.errors import EagleError, HeadMismatchError, UnknownTargetError
from eagle.generate import Decoder, GenerationConfig, GenerationResult, StepOutput, StepStats
from eagle.head import EagleHead, HeadConfig
from eagle.target import DEFAULT_TARGET, Target, load_target, supported_architectures
from eagle.tree import DynamicTree, StaticTree
from eagle.verify import SamplingConfig

__all__ = [
    "DEFAULT_TARGET",
    "Decoder",
    "DynamicTree",
    "EagleError",
    "EagleHead",
    "GenerationConfig",
    "GenerationResult",
    "HeadConfig",
    "HeadMismatchError",
    "SamplingConfig",
    "StaticTree",
    "StepOutput",
    "StepStats",
    "Target",
    "UnknownTargetError",
    "load_target",
    "supported_architectures",
]
