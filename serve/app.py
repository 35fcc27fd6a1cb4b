"""The Serve application: ``build_app(args)`` turns a list of pairs into deployments behind one ingress.

Referenced from ``serve/config.yaml`` (``import_path: serve.app:build_app``) for ``serve run`` /
``serve deploy``, and callable from Python (``serve.run(build_app({...}))``).

The same pieces also build one application per pair, for a cluster whose pairs change while it serves
(``eagle_platform.rollout``): ``build_pair_app`` (one pair, no HTTP route) and ``build_ingress_app`` (the
OpenAI ingress alone, ``RoutedIngress``), which learns which pair applications to route to from its
``user_config`` (``{"pairs": {model: application}}``). Ray rebuilds an application, and restarts all its
replicas, when its ``args`` change; a changed ``user_config`` only calls ``reconfigure`` on the live
replicas: so adding a pair adds an application and reconfigures the ingress, and nothing that already
serves restarts (eagle_platform/rollout.py cites the Ray source).

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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve.names import deployment_name
from serve.openai_api import HandlePairClient, Limits, OpenAIIngress
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
    num_gpus: float | None = Field(None, ge=0)  # None: 1 for a CUDA pair (its ``device``), 0 on CPU
    health_check_period_s: float = Field(10.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _gpus_for_device(self) -> "PairArgs":
        if self.device != "cpu" and self.num_gpus == 0:
            raise ValueError(f"device {self.device!r} needs num_gpus > 0: a Ray actor sees only the GPUs it reserves")
        return self

    def actor_gpus(self) -> float:
        """GPUs each replica reserves."""
        if self.num_gpus is not None:
            return self.num_gpus
        return 0.0 if self.device == "cpu" else 1.0

    def spec(self) -> dict[str, Any]:
        """The ``PairSpec`` fields as a plain dict (what the replica constructor receives and validates)."""
        return self.model_dump(include=set(PairSpec.model_fields))


class IngressArgs(BaseModel):
    """The ingress's settings (``build_ingress_app``'s ``args``; ``AppArgs`` has them too)."""

    model_config = ConfigDict(extra="forbid")

    retry_after_s: float = Field(1.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    ingress_max_ongoing_requests: int = Field(256, ge=1)
    # failover (serve.openai_api.FailoverPolicy): a request whose replica dies resumes on another one
    failover_attempts: int = Field(3, ge=0)  # resumes per request (0: no failover)
    failover_deadline_s: float = Field(120.0, gt=0)  # from the first death, for a resumed attempt to start
    # limits (serve.openai_api.Limits)
    max_body_bytes: int = Field(Limits.max_body_bytes, ge=1024)
    stream_idle_s: float = Field(Limits.stream_idle_s, gt=0)

    def ingress_kwargs(self) -> dict[str, Any]:
        """``OpenAIIngress``'s keyword arguments."""
        failover = {"attempts": self.failover_attempts, "deadline_s": self.failover_deadline_s}
        limits = {"max_body_bytes": self.max_body_bytes, "stream_idle_s": self.stream_idle_s}
        return {"retry_after_s": self.retry_after_s, "request_timeout_s": self.request_timeout_s, "failover": failover, "limits": limits}


class AppArgs(IngressArgs):
    """``build_app``'s arguments (the ``args:`` of an application in serve/config.yaml)."""

    pairs: list[PairArgs] = Field(min_length=1)
    tracking_uri: str | None = None  # MLflow for models:/ heads; default: $MLFLOW_TRACKING_URI of the builder
    backpressure_status: Literal[503, 429] = 503

    @model_validator(mode="after")
    def _unique(self) -> "AppArgs":
        names = [pair.model for pair in self.pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"model ids must be unique, got {names}")
        return self


class PairAppArgs(BaseModel):
    """``build_pair_app``'s arguments: one pair as its own application."""

    model_config = ConfigDict(extra="forbid")

    pair: PairArgs
    tracking_uri: str | None = None  # as AppArgs.tracking_uri
    retry_after_s: float = Field(1.0, gt=0)  # the Retry-After of a back-pressured request
    backpressure_status: Literal[503, 429] = 503


class Routes(BaseModel):
    """``RoutedIngress``'s ``user_config``: model id -> the Serve application serving that pair."""

    model_config = ConfigDict(extra="forbid")

    pairs: dict[str, str] = Field(default_factory=dict)


def build_app(args: dict[str, Any] | AppArgs):
    """The Serve ``Application``: one deployment per pair + the OpenAI ingress."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    pairs = {
        pair.model: _pair_deployment(pair, args.tracking_uri, args.retry_after_s, args.backpressure_status).bind(pair.spec())
        for pair in args.pairs
    }
    return _ingress_deployment(OpenAIIngress, args).bind(pairs, **args.ingress_kwargs())


def build_pair_app(args: dict[str, Any] | PairAppArgs):
    """One pair as an application of its own (its deployment ``deployment_name(model)`` is its ingress; the
    application gets no HTTP route): what ``RoutedIngress`` routes to."""
    args = args if isinstance(args, PairAppArgs) else PairAppArgs.model_validate(args)
    pair = args.pair
    return _pair_deployment(pair, args.tracking_uri, args.retry_after_s, args.backpressure_status).bind(pair.spec())


def build_ingress_app(args: dict[str, Any] | IngressArgs | None = None):
    """The OpenAI ingress as an application of its own (``RoutedIngress``): it serves the pair applications
    its ``user_config`` names (none until a config sets one)."""
    args = args if isinstance(args, IngressArgs) else IngressArgs.model_validate(args or {})
    return _ingress_deployment(RoutedIngress, args, user_config=Routes().model_dump()).bind({}, **args.ingress_kwargs())


class RoutedIngress(OpenAIIngress):
    """The ingress of the one-application-per-pair layout: ``reconfigure`` (Serve's ``user_config``, a
    ``Routes``) sets which pair applications it routes to. A model whose application is unchanged keeps its
    client (and the requests running through it); a model that is gone is no longer routed."""

    def reconfigure(self, config: dict[str, Any]) -> None:
        from ray import serve

        routes = Routes.model_validate(config or {}).pairs
        clients = {}
        for model, app in routes.items():
            client = self.clients.get(model)
            if not (isinstance(client, HandlePairClient) and client.handle.app_name == app):
                # not checked for existence: the pair's application may still be building; a request waits for
                # its replicas as for any deployment that has none running
                handle = serve.get_deployment_handle(deployment_name(model), app_name=app, _check_exists=False)
                client = HandlePairClient(handle, self.failover)
            clients[model] = client
        self.clients = clients


def _pair_deployment(pair: PairArgs, tracking_uri: str | None, retry_after_s: float, backpressure_status: int):
    """The Serve deployment of one pair (not yet bound to its spec)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, BackpressureConfig

    return serve.deployment(
        PairServer,
        name=deployment_name(pair.model),
        autoscaling_config=AutoscalingConfig(**pair.autoscaling.model_dump(exclude_none=True)),
        max_ongoing_requests=pair.max_ongoing_requests,
        max_queued_requests=pair.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=backpressure_status, retry_after_s=retry_after_s),
        ray_actor_options={"num_cpus": pair.num_cpus, "num_gpus": pair.actor_gpus(), "runtime_env": {"env_vars": _replica_env(tracking_uri)}},
        user_config={"head": pair.head, "watch_s": pair.watch_s},
        health_check_period_s=pair.health_check_period_s,
        graceful_shutdown_timeout_s=pair.graceful_shutdown_timeout_s,
    )


def _replica_env(tracking_uri: str | None) -> dict[str, str]:
    """A pair replica's environment: offline Hugging Face, the registry, the builder's cache folder."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    tracking = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if tracking:
        env["MLFLOW_TRACKING_URI"] = tracking
    for key in ("EAGLE_CACHE_DIR", "MLFLOW_TRACKING_USERNAME", "EAGLE_MLFLOW_PASSWORD_FILE"):  # the registry's credentials
        if os.environ.get(key):
            env[key] = os.environ[key]
    return env


def _ingress_deployment(cls: type[OpenAIIngress], args: IngressArgs, **options: Any):
    """The ingress deployment ``openai`` (FastAPI, one replica, no CPU reserved)."""
    from ray import serve

    return serve.deployment(
        serve.ingress()(cls),
        name="openai",
        num_replicas=1,
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
        **options,
    )
