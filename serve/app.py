"""The Serve application: ``build_app(args)`` turns a list of pairs into deployments behind one ingress.

Referenced from ``serve/config.yaml`` (``import_path: serve.app:build_app``) for ``serve run`` /
``serve deploy``, and callable from Python (``serve.run(build_app({...}))``).

Several pairs, one deployment per pair (not model multiplexing). Each pair is its own deployment with its
own ``autoscaling_config``, ``max_ongoing_requests`` and ``max_queued_requests``: a pair's replicas hold
exactly one target + head in memory, scale on that pair's own load and shed that pair's overload, which
multiplexing (replicas loading models on demand, one shared autoscaling policy) would not give. The
ingress (FastAPI, the OpenAI API) routes on the request's ``model`` through each pair's
``DeploymentHandle``. When a pair's callers already queue ``max_queued_requests``, the handle raises
``BackPressureError`` and the client gets 503 (or 429) with ``Retry-After``, never an unbounded queue.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve.openai_api import OpenAIIngress
from serve.pair import PairServer, PairSpec


class AutoscalingArgs(BaseModel):
    """Ray Serve ``autoscaling_config`` for one pair (see Serve's AutoscalingConfig for the semantics)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    metrics_interval_s: float = Field(2.0, gt=0)
    look_back_period_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class PairArgs(PairSpec):
    """One pair: what it serves (``serve.pair.PairSpec``, the one schema of a pair and its defaults) and how
    it is deployed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    autoscaling: AutoscalingArgs = Field(default_factory=AutoscalingArgs)
    max_ongoing_requests: int = Field(8, ge=1)
    max_queued_requests: int = Field(16, ge=-1)
    num_cpus: float = Field(1.0, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0)

    def spec(self) -> dict[str, Any]:
        """The ``PairSpec`` fields as a plain dict (what the replica constructor receives and validates)."""
        return self.model_dump(include=set(PairSpec.model_fields))


class AppArgs(BaseModel):
    """``build_app``'s arguments (the ``args:`` of an application in serve/config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    pairs: list[PairArgs] = Field(min_length=1)
    tracking_uri: str | None = None  # MLflow for models:/ heads; default: $MLFLOW_TRACKING_URI of the builder
    retry_after_s: float = Field(1.0, gt=0)
    backpressure_status: Literal[503, 429] = 503
    request_timeout_s: float = Field(600.0, gt=0)
    ingress_max_ongoing_requests: int = Field(256, ge=1)
    # failover (serve.openai_api.FailoverPolicy): a request whose replica dies resumes on another one
    failover_attempts: int = Field(3, ge=0)  # resumes per request (0: no failover)
    failover_deadline_s: float = Field(120.0, gt=0)  # from the first death, for a resumed attempt to start

    @model_validator(mode="after")
    def _unique(self) -> "AppArgs":
        names = [pair.model for pair in self.pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"model ids must be unique, got {names}")
        return self


def deployment_name(model: str) -> str:
    """The Serve deployment of a pair: ``pair-<model>`` with anything outside [A-Za-z0-9_.-] replaced."""
    return "pair-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model)


def build_app(args: dict[str, Any] | AppArgs):
    """The Serve ``Application``: one deployment per pair + the OpenAI ingress."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, BackpressureConfig

    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    tracking = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if tracking:
        env["MLFLOW_TRACKING_URI"] = tracking
    for key in ("EAGLE_CACHE_DIR",):
        if os.environ.get(key):
            env[key] = os.environ[key]
    pairs = {}
    for pair in args.pairs:
        scaling = pair.autoscaling.model_dump(exclude_none=True)
        deployment = serve.deployment(
            PairServer,
            name=deployment_name(pair.model),
            autoscaling_config=AutoscalingConfig(**scaling),
            max_ongoing_requests=pair.max_ongoing_requests,
            max_queued_requests=pair.max_queued_requests,
            backpressure_config=BackpressureConfig(status_code=args.backpressure_status, retry_after_s=args.retry_after_s),
            ray_actor_options={"num_cpus": pair.num_cpus, "runtime_env": {"env_vars": env}},
            user_config={"head": pair.head, "watch_s": pair.watch_s},
            health_check_period_s=pair.health_check_period_s,
            graceful_shutdown_timeout_s=pair.graceful_shutdown_timeout_s,
        )
        pairs[pair.model] = deployment.bind(pair.spec())
    ingress = serve.deployment(
        serve.ingress()(OpenAIIngress),
        name="openai",
        num_replicas=1,
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    failover = {"attempts": args.failover_attempts, "deadline_s": args.failover_deadline_s}
    return ingress.bind(pairs, retry_after_s=args.retry_after_s, request_timeout_s=args.request_timeout_s, failover=failover)
