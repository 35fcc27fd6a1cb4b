"""The control-plane service: an HTTP API over the onboarding pipeline, and its reconcile loop.

    python -m eagle_platform.service [--port 8600] [--allowed-root DIR ...]     (also: eaglectl platform serve)

Binds to 127.0.0.1 by default. Every mutating endpoint needs ``Authorization: Bearer <token>``: the token is
``$EAGLE_PLATFORM_TOKEN``, or the file ``<state dir>/token`` (created with mode 0600 on the first start;
``eaglectl targets ...`` reads the same file). Endpoints (JSON in, JSON out; errors are
``{"error": {"message": ..., "field": ...}}`` with a 4xx status):

    GET  /health                          the loop's last pass and error
    GET  /v1/targets                      every target's status
    GET  /v1/targets/{name}               one target's status (eagle_platform.pipeline.Reconciler.status)
    POST /v1/targets                      {"name", "source", "preset"?, "tau_gate"?}: onboard (202)
    POST /v1/targets/{name}/retrain       the next attempt of the newest version
    POST /v1/targets/{name}/retire        stop its job, leave the loop, stop serving it
    POST /v1/targets/{name}/promote       {"version": head version}: production to that head
    POST /v1/targets/{name}/rollback      production back to the head promoted before
    POST /v1/webhooks/mlflow              MLflow's model_version.created webhook (HMAC-SHA256 verified)

The loop (``Reconciler.reconcile_once``) runs every ``--poll-s`` seconds and at once after an onboarding or
a webhook delivery. Nothing is kept only in this process: killed and restarted, the service carries on from
MLflow's tags and Ray's jobs.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from eagle_platform.pipeline import PipelineError, Reconciler, Settings
from eagle_platform.ray_token import ensure_secret_file
from eagle_platform.registry import Registry, RegistryError

logger = logging.getLogger("eagle_platform.service")

TOKEN_ENV = "EAGLE_PLATFORM_TOKEN"
WEBHOOK_SECRET_ENV = "EAGLE_PLATFORM_WEBHOOK_SECRET"
DEFAULT_PORT = 8600
WEBHOOK_MAX_AGE_S = 300  # a delivery older than this is refused (replay)


def default_state_dir() -> Path:
    """``$EAGLE_PLATFORM_DIR`` or ``<cache root>/platform`` (``~/.cache/eagle-platform/platform``)."""
    if os.environ.get("EAGLE_PLATFORM_DIR"):
        return Path(os.environ["EAGLE_PLATFORM_DIR"]).expanduser()
    root = os.environ.get("EAGLE_CACHE_DIR") or str(Path.home() / ".cache" / "eagle-platform")
    return Path(root).expanduser() / "platform"


def read_secret(state_dir: Path, filename: str, env: str, *, create: bool = False) -> str | None:
    """A secret from ``$<env>``, else the file ``<state_dir>/<filename>``, made (mode 0600,
    ``eagle_platform.ray_token.ensure_secret_file``) when missing and ``create``: the API token (``token``)
    and the webhook secret (``webhook_secret``)."""
    if os.environ.get(env):
        return os.environ[env]
    path = state_dir / filename
    if create:
        ensure_secret_file(path)
    elif not path.is_file():
        return None
    return path.read_text().strip()


def read_token(state_dir: Path, *, create: bool = False) -> str | None:
    """The API token: ``$EAGLE_PLATFORM_TOKEN``, else ``<state_dir>/token``."""
    return read_secret(state_dir, "token", TOKEN_ENV, create=create)


def webhook_signature(secret: str, delivery_id: str, timestamp: str, payload: bytes) -> str:
    """MLflow's webhook signature: ``v1,`` + base64 HMAC-SHA256 of ``<delivery id>.<timestamp>.<payload>``
    (mlflow/webhooks/delivery.py, ``_generate_hmac_signature``)."""
    signed = delivery_id.encode() + b"." + timestamp.encode() + b"." + payload
    return "v1," + base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()


class Periodic:
    """A daemon thread that calls ``tick()`` every ``every_s`` seconds, or at once after ``wake()``; a failed
    tick is logged and kept in ``last_error``, and the thread carries on."""

    name = "periodic"

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.last_error: str | None = None
        self.last_pass_ms: int | None = None
        self.passes = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.tick()
                self.last_error = None
            except Exception as err:  # noqa: BLE001 - the thread outlives a failed round (MLflow, Ray or Serve down)
                self.last_error = f"{type(err).__name__}: {err}"[:500]
                logger.warning("%s failed: %s", self.name, self.last_error)
            self.last_pass_ms = int(time.time() * 1000)
            self.passes += 1
            self._wake.wait(self.every_s)


class Loop(Periodic):
    """The reconcile thread: a pass every ``poll_s`` seconds, or sooner when ``wake()`` is called."""

    name = "reconcile"

    def __init__(self, reconciler: Reconciler, poll_s: float):
        super().__init__(poll_s)
        self.reconciler = reconciler
        self.webhooks = 0  # verified webhook deliveries

    def tick(self) -> None:
        self.reconciler.reconcile_once()


class Onboard(BaseModel):
    """``POST /v1/targets``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=63)
    source: str = Field(max_length=4096)
    preset: str | None = Field(None, max_length=64)
    tau_gate: float | None = None


class Promote(BaseModel):
    """``POST /v1/targets/{name}/promote``."""

    model_config = ConfigDict(extra="forbid")
    version: str = Field(pattern=r"^[0-9]{1,9}$")


class _Unauthorized(Exception):
    pass


def create_app(reconciler: Reconciler, loop: Loop, *, token: str, webhook_secret: str | None = None, sync: "ServeSync | None" = None):
    """The FastAPI app (see the module docstring)."""
    app = FastAPI(title="eagle-platform", version="1")

    def error(status: int, message: str, field: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "field": field}}, status_code=status,
                            headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    @app.exception_handler(PipelineError)
    async def _pipeline_error(request: Request, err: PipelineError):
        return error(err.status, str(err), err.field)

    @app.exception_handler(RegistryError)
    async def _registry_error(request: Request, err: RegistryError):
        return error(503 if "no MLflow" in str(err) or "reach" in str(err) else 404, str(err))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part not in ("body", "path", "query")]
        return error(422, f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}", ".".join(where) or None)

    def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(request: Request, err: _Unauthorized):
        return error(401, "missing or wrong bearer token", "authorization")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "passes": loop.passes, "last_pass_ms": loop.last_pass_ms, "last_error": loop.last_error, "webhooks": loop.webhooks,
                "serve_error": sync.last_error if sync is not None else None}

    @app.get("/v1/targets")
    def list_targets() -> dict[str, Any]:
        return {"targets": [reconciler.status(name) for name in reconciler.targets()]}

    @app.get("/v1/targets/{name}")
    def target_status(name: str) -> dict[str, Any]:
        return reconciler.status(name)

    @app.post("/v1/targets", status_code=202, dependencies=[Depends(authorized)])
    def onboard(body: Onboard) -> dict[str, Any]:
        status = reconciler.onboard(body.name, body.source, body.preset, body.tau_gate)
        loop.wake()
        return status

    @app.post("/v1/targets/{name}/retrain", status_code=202, dependencies=[Depends(authorized)])
    def retrain(name: str) -> dict[str, Any]:
        status = reconciler.retrain(name)
        loop.wake()
        return status

    @app.post("/v1/targets/{name}/retire", dependencies=[Depends(authorized)])
    def retire(name: str) -> dict[str, Any]:
        return reconciler.retire(name)

    @app.post("/v1/targets/{name}/promote", dependencies=[Depends(authorized)])
    def promote(name: str, body: Promote) -> dict[str, Any]:
        return reconciler.promote(name, body.version)

    @app.post("/v1/targets/{name}/rollback", dependencies=[Depends(authorized)])
    def rollback(name: str) -> dict[str, Any]:
        return reconciler.rollback(name)

    @app.post("/v1/webhooks/mlflow")
    async def mlflow_webhook(request: Request):
        if not webhook_secret:
            return error(404, "webhooks are not configured (--webhook-secret / $EAGLE_PLATFORM_WEBHOOK_SECRET)")
        payload = await request.body()
        delivery = request.headers.get("x-mlflow-delivery-id", "")
        stamp = request.headers.get("x-mlflow-timestamp", "")
        signature = request.headers.get("x-mlflow-signature", "")
        if not stamp.isdigit() or abs(time.time() - int(stamp)) > WEBHOOK_MAX_AGE_S:
            return error(401, "missing or stale X-MLflow-Timestamp", "x-mlflow-timestamp")
        if not hmac.compare_digest(signature.encode(), webhook_signature(webhook_secret, delivery, stamp, payload).encode()):
            return error(401, "bad X-MLflow-Signature", "x-mlflow-signature")
        loop.webhooks += 1
        loop.wake()  # the loop adopts the new version on its next pass (it reads MLflow, not the payload)
        return {"ok": True}

    return app


class ServeSync(Periodic):
    """Keeps Ray Serve serving exactly one pair per target with a production head (``eagle_platform.rollout``):
    the pair ``<name>-eagle`` of the target version that head was trained for and ``@production``, which the
    pair's replicas follow (hot swap) when production moves. A thread compares what Serve runs with what
    should run every ``every_s`` seconds, and at once after ``request()``, and rolls out the difference: a new
    pair is added without restarting the others, a retired one removed."""

    name = "serve-sync"

    def __init__(self, reconciler: Reconciler, dashboard_url: str, *, port: int, pair: dict[str, Any], every_s: float = 30.0):
        super().__init__(every_s)
        self.reconciler = reconciler
        self.dashboard_url = dashboard_url
        self.port = port
        self.pair_settings = pair

    def request(self, name: str | None = None) -> None:
        """The reconciler's ``on_ready``: roll out now rather than at the next round."""
        self.wake()

    def wanted(self) -> list[dict[str, Any]]:
        """One pair per target whose head ``@production`` exists and whose newest version is not retired, on
        the target version that head was trained for (a retrain in progress keeps the pair as it is)."""
        from eagle_platform.registry import PRODUCTION, head_model_name

        registry = self.reconciler.registry
        pairs = []
        for name in self.reconciler.targets():
            versions = self.reconciler.versions(name)
            if not versions or versions[-1]["pipeline"]["retired"]:  # retired: until it is onboarded again
                continue
            production = registry.alias_version(head_model_name(name), PRODUCTION)
            if production is None:
                continue
            trained_for = registry.head_version_info(head_model_name(name), None, version=production)["tags"].get("target_model_version")
            version = next((v for v in versions if v["version"] == trained_for and v["pipeline"]["source"]), None)
            if version is None:
                continue
            pairs.append({"model": head_model_name(name), "target": self.reconciler.target_spec(name, version),
                          "head": f"models:/{head_model_name(name)}@{PRODUCTION}", **self.pair_settings})
        return sorted(pairs, key=lambda pair: pair["model"])

    def sync_once(self) -> None:
        from eagle_platform.rollout import deployed_pairs, roll_out

        wanted = self.wanted()
        deployed = sorted(deployed_pairs(self.dashboard_url), key=lambda pair: pair["model"])
        if wanted == deployed:
            return
        logger.info("serve: rolling out %s (serving %s)", [p["model"] for p in wanted], [p["model"] for p in deployed])
        roll_out(wanted, self.dashboard_url, tracking_uri=self.reconciler.registry.uri, port=self.port)

    tick = sync_once


def register_webhook(registry: Registry, url: str, secret: str) -> bool:
    """Subscribe ``url`` to MLflow's ``model_version.created`` (once); False when the backend has no webhooks."""
    try:
        from mlflow.entities.webhook import WebhookEvent

        client = registry.client
        events = [WebhookEvent("model_version", "created")]
        for hook in client.list_webhooks():
            if hook.url == url:
                client.update_webhook(hook.webhook_id, events=events, secret=secret)
                return True
        client.create_webhook(name="eagle-platform", url=url, events=events, secret=secret)
        return True
    except Exception as err:  # noqa: BLE001 - a backend without webhooks: polling alone
        logger.warning("MLflow webhooks unavailable (%s): new versions are found by polling", err)
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle_platform.service", description="The eagle-platform control plane.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("EAGLE_PLATFORM_PORT", DEFAULT_PORT)))
    parser.add_argument("--state-dir", default=None, help="token, downloaded sources (default $EAGLE_PLATFORM_DIR or ~/.cache/eagle-platform/platform)")
    parser.add_argument("--allowed-root", action="append", default=[], help="a folder local sources may come from (repeatable)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow (default $MLFLOW_TRACKING_URI or http://127.0.0.1:5000)")
    parser.add_argument("--ray-address", default=os.environ.get("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265"), help="the Ray Jobs API")
    parser.add_argument("--poll-s", type=float, default=5.0)
    parser.add_argument("--max-concurrent", type=int, default=1, help="pipelines at once across targets")
    parser.add_argument("--default-preset", default="quick")
    parser.add_argument("--tau-gate", type=float, default=None, help="the gate of onboardings that name none (default: the preset's promote_tau, else 1.0)")
    parser.add_argument("--storage", default=None, help="--storage of every job")
    parser.add_argument("--eval-prompts", type=int, default=None)
    parser.add_argument("--eval-max-new-tokens", type=int, default=None)
    parser.add_argument("--eval-compile", choices=["on", "off"], default=None)
    parser.add_argument("--webhook-url", default=None, help="this service's webhook URL as MLflow reaches it (registers the webhook)")
    parser.add_argument("--serve", action="store_true", help="roll ready pairs out to Ray Serve (eagle_platform.rollout)")
    parser.add_argument("--serve-port", type=int, default=8000)
    parser.add_argument("--serve-compile", choices=["on", "off"], default="on")
    parser.add_argument("--serve-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="the pairs' dtype (auto: bf16 where the machine computes it natively, else float32; serve.pair.PairSpec)")
    parser.add_argument("--serve-watch-s", type=float, default=30.0, help="how often a pair polls its @production alias")
    parser.add_argument("--serve-threads", type=int, default=1)
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def build(args: argparse.Namespace) -> tuple[Any, Loop, ServeSync | None]:
    """The app, its loop and its Serve sync (neither started), from parsed flags."""
    from ray.job_submission import JobSubmissionClient

    from jobs.presets import PRESETS, get_preset

    state_dir = Path(args.state_dir).expanduser() if args.state_dir else default_state_dir()
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if args.max_concurrent < 1 or args.poll_s <= 0:
        raise PipelineError("--max-concurrent must be >= 1 and --poll-s > 0")
    if args.default_preset not in PRESETS:
        raise PipelineError(f"unknown --default-preset {args.default_preset!r}")
    gates = {name: get_preset(name).eval.promote_tau for name in PRESETS}
    gates = {name: gate for name, gate in gates.items() if gate is not None}
    if args.tau_gate is not None:  # one gate for every preset
        gates = {name: args.tau_gate for name in PRESETS}
    # RAY_ADDRESS (the GCS) into every process of a job: Ray Train's internal actors otherwise query whichever
    # cluster started last on this host (jobs.common.init_ray says what that broke)
    job_env = {key: os.environ[key] for key in ("EAGLE_CACHE_DIR", "EAGLE_STORAGE", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS",
                                                 "MLFLOW_TRACKING_USERNAME", "EAGLE_MLFLOW_PASSWORD_FILE")
               if os.environ.get(key)}
    settings = Settings(
        state_dir=state_dir, allowed_roots=tuple(Path(root).expanduser() for root in args.allowed_root),
        presets=tuple(PRESETS), preset_gates=gates, default_preset=args.default_preset, max_concurrent=args.max_concurrent,
        storage=args.storage, job_env=job_env, eval_prompts=args.eval_prompts, eval_max_new_tokens=args.eval_max_new_tokens,
        eval_compile=args.eval_compile,
    )
    registry = Registry(args.tracking_uri)
    registry.client  # noqa: B018 - fails in one line when MLflow is down
    jobs = JobSubmissionClient(args.ray_address)
    reconciler = Reconciler(registry, jobs, settings)
    sync = None
    if args.serve:
        # num_cpus 0: a served pair must not hold the CPUs a training job's workers wait for (2 on this host)
        pair = {"dtype": args.serve_dtype, "compile": args.serve_compile, "watch_s": args.serve_watch_s, "threads": args.serve_threads,
                "num_cpus": 0, "max_batch_size": 8, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
        sync = ServeSync(reconciler, args.ray_address, port=args.serve_port, pair=pair)
        reconciler.on_ready = sync.request
    loop = Loop(reconciler, args.poll_s)
    token = read_token(state_dir, create=True)
    secret = read_secret(state_dir, "webhook_secret", WEBHOOK_SECRET_ENV, create=bool(args.webhook_url))
    if args.webhook_url:
        register_webhook(registry, args.webhook_url, secret)
    return create_app(reconciler, loop, token=token, webhook_secret=secret, sync=sync), loop, sync


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        app, loop, sync = build(args)
    except (PipelineError, RegistryError) as err:
        sys.stderr.write(f"eagle_platform.service: error: {err}\n")
        return 2
    import uvicorn

    loop.start()
    if sync is not None:
        sync.start()
    logger.info("eagle-platform service on http://%s:%d", args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        loop.stop()
        if sync is not None:
            sync.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
