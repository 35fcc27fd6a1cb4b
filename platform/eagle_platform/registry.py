"""The registry adapter: the single place that knows how targets, heads and their link live in MLflow.

Two objects, each bound to one tracking URI (default ``tracking_uri()``: ``$MLFLOW_TRACKING_URI`` or the local
stack's ``http://127.0.0.1:5000``) and one ``MlflowClient``:

- ``Runs``: run tracking (experiments, runs, params, metrics, tags, artifacts) with explicit run ids, never
  MLflow's global active run. It knows nothing about targets or heads.
- ``Registry``: the naming of targets and heads in the model registry (registered models, versions, tags,
  aliases) and the download of a head into the local cache. ``Registry.runs`` is its ``Runs`` (same URI,
  same client): a target's card and a head's files are artifacts of runs.

Naming (one registered model per target, one per target's heads):

- a **target** is registered as model ``<target_name>`` (e.g. ``smollm2-135m``); each version holds a small
  card artifact ``target/target.json`` (name, revision, spec, architecture, ...) and the tag
  ``target_revision``. One version per revision: registering the same revision again returns it.
- a **head** for that target is registered as model ``<target_name>-eagle`` (e.g. ``smollm2-135m-eagle``);
  each version's source is a head directory (``config.json`` + ``model.safetensors``) logged as an artifact
  of the training run, and its tags link it to the target: ``target_name``, ``target_revision``,
  ``target_model_version``.
- aliases, never stages: ``candidate`` (a freshly trained head) and ``production`` (promoted after its
  evaluation gate). ``models:/smollm2-135m-eagle@production`` names the head to serve.

The naming helpers (``target_model_name``, ``head_model_name``, ``head_uri``, ``parse_models_uri``,
``cache_dir``) are module functions that need no server, and so is ``resolve_head(uri)``: the ``models``
resolver of the ``eagle.head_resolvers`` entry-point group. Before talking to MLflow each object checks that
an HTTP server answers at its URI (at most every 30 s), so a missing server fails in one line instead of
MLflow's retry loop. Every failure the user can act on (no server, unknown model / alias / version, missing
artifacts) is a ``RegistryError`` with a one-line message. No torch here: the control plane is torch-free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "http://127.0.0.1:5000"
HEAD_MODEL_SUFFIX = "-eagle"
CANDIDATE = "candidate"
PRODUCTION = "production"
TARGET_CARD_PATH = "target/target.json"
TARGETS_EXPERIMENT = "eagle-targets"
HEAD_FILES = ("config.json", "model.safetensors")
_CACHE_MARKER = ".eagle-registry.json"
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[^/@]+))/?$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RegistryError(ValueError):
    """The registry cannot do what was asked; the message is one line meant for the user.

    A ``ValueError`` (like ``eagle.errors.EagleError``) rather than an ``EagleError``: importing ``eagle``
    imports torch, and the control plane stays torch-free. Callers turn it into one line and exit code 2.
    """


# ---------------------------------------------------------------------------------------------- naming


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else the local stack's server (``make stack-up``)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def target_model_name(target_name: str) -> str:
    """Registered model that holds a target's versions: the target's own name."""
    check_name(target_name, "target name")
    return target_name


def head_model_name(target_name: str) -> str:
    """Registered model that holds the heads of a target: ``<target_name>-eagle``."""
    check_name(target_name, "target name")
    return f"{target_name}{HEAD_MODEL_SUFFIX}"


def head_uri(target_name: str, alias: str = PRODUCTION) -> str:
    """``models:/<target_name>-eagle@<alias>``: what ``eaglectl --head`` and the server take."""
    return f"models:/{head_model_name(target_name)}@{alias}"


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/<name>@<alias>`` or ``models:/<name>/<version>`` -> (name, alias, version)."""
    match = _MODELS_URI.match(uri.strip())
    if not match:
        raise RegistryError(f"bad model URI {uri!r}: expected models:/<name>@<alias> or models:/<name>/<version>")
    return match["name"], match["alias"], match["version"]


def cache_dir() -> Path:
    """``$EAGLE_CACHE_DIR/heads`` or ``~/.cache/eagle-platform/heads`` (the rule of ``eagle.target.cache_root``,
    restated here because platform/ imports no torch)."""
    root = os.environ.get("EAGLE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "eagle-platform")
    return Path(root) / "heads"


def check_name(name: str, what: str) -> str:
    """``name`` if it is safe as a registered model name and as one path component (targets, datasets, run
    names reach storage paths): letters, digits, '.', '_' and '-', starting with a letter or digit, at most
    128 characters; else a one-line ``RegistryError``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegistryError(f"bad {what} {name!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit "
                            f"(no '/', '@' or spaces; at most 128)")
    return name


# ------------------------------------------------------------------------------------------ connection


T = TypeVar("T")
REGISTRATION_TAG, PENDING, COMPLETE = "registration", "pending", "complete"  # ``_register_version``'s two phases


class RegistryUnavailableError(RegistryError):
    """No tracking server answers at the URI (down, restarting, or answering 5xx): maybe transient."""


def with_retries(call: Callable[[], T], *, within_s: float = 120.0, what: str = "an MLflow call",
                 on_retry: Callable[[RegistryUnavailableError, float], None] | None = None) -> T:
    """``call()``, retried while it raises ``RegistryUnavailableError`` (a server restart), with backoff from 1 s
    doubling to 15 s, for at most ``within_s`` seconds; then the last error propagates. Any other error
    propagates at once. ``on_retry(error, delay_s)`` is told before each wait."""
    deadline = time.monotonic() + within_s
    delay = 1.0
    while True:
        try:
            return call()
        except RegistryUnavailableError as err:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            wait = min(delay, left)
            logger.warning("%s failed (%s); retrying in %.0f s (%.0f s left)", what, err, wait, left)
            if on_retry is not None:
                on_retry(err, wait)
            time.sleep(wait)
            delay = min(delay * 2, 15.0)


def _no_server(uri: str) -> RegistryError:
    return RegistryUnavailableError(
        f"no MLflow tracking server at {uri}: start the local stack with `make stack-up` or set MLFLOW_TRACKING_URI"
    )


_REACHABLE: dict[str, float] = {}  # uri -> when /health last answered (monotonic)
_REACHABLE_TTL_S = 30.0


def _check_reachable(uri: str) -> None:
    if not uri.startswith(("http://", "https://")):
        return  # sqlite:, file:, databricks ...: nothing to probe
    if time.monotonic() - _REACHABLE.get(uri, -1e9) < _REACHABLE_TTL_S:
        return  # checked moments ago; a server lost since then still fails in one line (_mlflow_errors)
    timeout = float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") or 5)
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=min(timeout, 10.0)):
            pass
    except urllib.error.HTTPError:
        pass  # something answers HTTP (an auth proxy, a path prefix): let MLflow's own calls decide
    except (urllib.error.URLError, OSError, ValueError):
        _REACHABLE.pop(uri, None)
        raise _no_server(uri) from None
    _REACHABLE[uri] = time.monotonic()


@contextlib.contextmanager
def _mlflow_errors(uri: str, context: str) -> Iterator[None]:
    """Turn MLflow's exceptions into one-line ``RegistryError``s."""
    try:
        yield
    except RegistryError:
        raise
    except MlflowException as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "Max retries exceeded" in message or "Failed to establish a new connection" in message:
            raise _no_server(uri) from None
        status = getattr(err, "get_http_status_code", lambda: None)()
        if "error code 401" in message or "error code 403" in message or status in (401, 403):
            who = os.environ.get("MLFLOW_TRACKING_USERNAME")
            raise RegistryError(f"{context}: the MLflow server at {uri} refused " + (f"user {who!r}" if who else "a request without credentials")
                                + f" (set MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD, or {PASSWORD_FILE_ENV})") from None
        if isinstance(status, int) and status >= 500:
            raise RegistryUnavailableError(f"{context}: {message}") from None
        raise RegistryError(f"{context}: {message}") from None
    except OSError as err:  # requests' ConnectionError is an OSError: the server went away mid-call
        raise RegistryUnavailableError(f"{context}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None


def _error_code(err: MlflowException) -> str:
    return getattr(err, "error_code", "") or ""


STACK_USER = "eagle-admin"  # the MLflow user infra/local/stack.sh creates
PASSWORD_FILE_ENV = "EAGLE_MLFLOW_PASSWORD_FILE"


def load_credentials(uri: str) -> None:
    """Give this process the local stack's MLflow credentials, unless it has some already.

    The stack's server runs MLflow's basic-auth app (infra/local/stack.sh): every call needs a user and a
    password, which MLflow's client reads from ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``.
    When the password is not set, it is read from ``$EAGLE_MLFLOW_PASSWORD_FILE`` (the stack exports it,
    and its Ray head passes it to every job and Serve replica), or, for the default tracking URI, from the
    default stack's ``<repo>/.mlflow/auth/mlflow-password`` (mode 0600: only its owner can read it)."""
    if os.environ.get("MLFLOW_TRACKING_PASSWORD"):
        return
    path = os.environ.get(PASSWORD_FILE_ENV)
    if not path and uri.rstrip("/") == DEFAULT_TRACKING_URI:
        path = str(Path(__file__).resolve().parents[2] / ".mlflow" / "auth" / "mlflow-password")
    if not path or not os.path.isfile(path):
        return
    try:
        password = Path(path).read_text().strip()
    except OSError as err:
        raise RegistryError(f"cannot read the MLflow password file {path}: {err.strerror or err}") from None
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", STACK_USER)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = password


class _Connection:
    """A tracking URI and its ``MlflowClient`` (tracking and registry at the same URI)."""

    def __init__(self, uri: str | None = None, *, client: MlflowClient | None = None) -> None:
        self.uri = uri or tracking_uri()
        load_credentials(self.uri)
        self._client = client or MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    @property
    def client(self) -> MlflowClient:
        """The ``MlflowClient``, after checking that a server answers at ``uri`` (see ``check_server``)."""
        self.check_server()
        return self._client

    def check_server(self) -> None:
        """Raise a one-line ``RegistryError`` now when no HTTP server answers at ``uri`` (a success is
        remembered for 30 s per URI; non-HTTP URIs such as ``sqlite:`` are not probed)."""
        _check_reachable(self.uri)

    def _errors(self, context: str) -> contextlib.AbstractContextManager[None]:
        return _mlflow_errors(self.uri, context)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


# ------------------------------------------------------------------------------------------------ runs


class Runs(_Connection):
    """MLflow run tracking (experiments, runs, params, metrics, tags, artifacts) at one tracking URI.

    ``uri`` defaults to ``tracking_uri()``; ``client`` lets a ``Registry`` share its ``MlflowClient``.
    """

    def get_or_create_experiment(self, name: str) -> str:
        """The id of experiment ``name``, created if missing (a deleted one is restored)."""
        mlflow_client = self.client
        with self._errors(f"experiment {name!r}"):
            experiment = mlflow_client.get_experiment_by_name(name)
            if experiment is None:
                try:
                    return mlflow_client.create_experiment(name)
                except MlflowException as err:  # created meanwhile by another process
                    if _error_code(err) != "RESOURCE_ALREADY_EXISTS":
                        raise
                    experiment = mlflow_client.get_experiment_by_name(name)
            if experiment.lifecycle_stage == "deleted":
                mlflow_client.restore_experiment(experiment.experiment_id)
            return experiment.experiment_id

    def find_run(
        self,
        experiment: str,
        run_name: str,
        *,
        tags: Mapping[str, str] | None = None,
        statuses: tuple[str, ...] | None = None,
    ) -> str | None:
        """The newest run named ``run_name`` in ``experiment`` (matching every tag in ``tags`` and one of
        ``statuses``, e.g. ``("RUNNING", "FAILED")`` when resuming), or None."""
        mlflow_client = self.client
        with self._errors(f"searching runs of {experiment!r}"):
            found = mlflow_client.get_experiment_by_name(experiment)
            if found is None:
                return None
            clauses = [f"attributes.run_name = {_quote(run_name)}"]
            clauses += [f"tags.{_tag_key(key)} = {_quote(str(value))}" for key, value in (tags or {}).items()]
            runs = mlflow_client.search_runs(
                [found.experiment_id], filter_string=" and ".join(clauses), order_by=["attributes.start_time DESC"], max_results=100
            )
        for run in runs:
            if statuses is None or run.info.status in statuses:
                return run.info.run_id
        return None

    def start_run(
        self,
        experiment: str,
        run_name: str,
        tags: Mapping[str, str] | None = None,
        *,
        resume: bool = False,
        resume_statuses: tuple[str, ...] = ("RUNNING", "FAILED", "KILLED"),
    ) -> str:
        """A new run in ``experiment`` (created if missing); with ``resume``, the newest run with the same
        name and tags whose status is one of ``resume_statuses`` (by default the unfinished ones) is reopened
        instead. Returns the run id."""
        if resume:
            run_id = self.find_run(experiment, run_name, tags=tags, statuses=resume_statuses)
            if run_id is not None:
                return self.reopen_run(run_id, run_name)
        experiment_id = self.get_or_create_experiment(experiment)
        with self._errors(f"starting run {run_name!r}"):
            run = self.client.create_run(experiment_id, run_name=run_name, tags={k: str(v) for k, v in (tags or {}).items()})
        return run.info.run_id

    def reopen_run(self, run_id: str, run_name: str) -> str:
        """Mark ``run_id`` (found by :meth:`find_run`) RUNNING again, to continue it. Returns the run id."""
        with self._errors(f"reopening run {run_id}"):
            self.client.update_run(run_id, status="RUNNING")
        logger.info("resuming MLflow run %s (%s)", run_id, run_name)
        return run_id

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log params (values as strings; MLflow keeps a param's first value: log each key once per run)."""
        if not params:
            return
        with self._errors(f"logging params to run {run_id}"):
            self.client.log_batch(run_id, params=[Param(str(k), _param_value(v)) for k, v in params.items()])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log numeric metrics at ``step`` (one batch request)."""
        if not metrics:
            return
        now = int(time.time() * 1000)
        batch = [Metric(str(k), float(v), now, int(step or 0)) for k, v in metrics.items()]
        with self._errors(f"logging metrics to run {run_id}"):
            self.client.log_batch(run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Set run tags (values as strings)."""
        with self._errors(f"tagging run {run_id}"):
            mlflow_client = self.client
            for key, value in tags.items():
                mlflow_client.set_tag(run_id, str(key), str(value))

    def log_dict(self, run_id: str, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        """Log ``dictionary`` as a JSON (or YAML, by extension) artifact at ``artifact_file``."""
        with self._errors(f"logging {artifact_file} to run {run_id}"):
            self.client.log_dict(run_id, dict(dictionary), artifact_file)

    def log_artifact(self, run_id: str, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, under ``artifact_path`` of the run."""
        path = Path(local_path)
        if not path.exists():
            raise RegistryError(f"cannot log {path}: no such file or directory")
        with self._errors(f"logging {path} to run {run_id}"):
            if path.is_dir():
                self.client.log_artifacts(run_id, str(path), artifact_path)
            else:
                self.client.log_artifact(run_id, str(path), artifact_path)

    def finish_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Mark the run FINISHED, FAILED or KILLED."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise RegistryError(f"bad run status {status!r}: expected FINISHED, FAILED or KILLED")
        with self._errors(f"finishing run {run_id}"), contextlib.redirect_stdout(sys.stderr):
            # MLflow prints "View run ... at ..." links on stdout; stdout belongs to the CLIs' output
            self.client.set_terminated(run_id, status=status)

    def run_info(self, run_id: str) -> dict[str, Any]:
        """Status, name, artifact URI, params, metrics (latest) and tags of a run."""
        with self._errors(f"run {run_id}"):
            run = self.client.get_run(run_id)
        return {
            "run_id": run.info.run_id,
            "run_name": run.info.run_name,
            "experiment_id": run.info.experiment_id,
            "status": run.info.status,
            "artifact_uri": run.info.artifact_uri,
            "params": dict(run.data.params),
            "metrics": dict(run.data.metrics),
            "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
        }


# ------------------------------------------------------------------------------------------- registry


class Registry(_Connection):
    """The naming of targets and heads in the MLflow model registry (registered models, versions, tags,
    aliases), at one tracking URI (default ``tracking_uri()``).

    ``runs`` is the ``Runs`` at the same URI with the same client: registering a target logs its card to a
    run, and a head version's source is an artifact folder of its training run.
    """

    def __init__(self, uri: str | None = None) -> None:
        super().__init__(uri)
        self.runs = Runs(self.uri, client=self._client)

    # ---- targets -------------------------------------------------------------------------------------

    def register_target(
        self, target_name: str, revision: str, card: Mapping[str, Any] | None = None, run_id: str | None = None
    ) -> str:
        """Register ``target_name`` at ``revision`` as a version of model ``target_name``; returns the version.

        Idempotent: a version tagged with the same ``target_revision`` is returned as is. Otherwise the card
        (name, revision and whatever ``card`` holds: spec, architecture, ...) is logged as
        ``target/target.json`` to ``run_id`` (or to a new, finished run in experiment ``eagle-targets``) and
        that folder is registered.
        """
        name = target_model_name(target_name)
        revision = str(revision)
        existing = self.target_version(target_name, revision)
        if existing is not None:
            return existing
        own_run = run_id is None
        if own_run:
            run_id = self.runs.start_run(
                TARGETS_EXPERIMENT, f"{target_name}@{revision}", {"target_name": target_name, "target_revision": revision}
            )
        full_card = {**dict(card or {}), "name": target_name, "revision": revision}
        try:
            self.runs.log_dict(run_id, full_card, TARGET_CARD_PATH)
            version = self._register_version(
                name, run_id, TARGET_CARD_PATH.rsplit("/", 1)[0],
                {"kind": "target", "target_name": target_name, "target_revision": revision},
            )
        except Exception:
            if own_run:
                with contextlib.suppress(Exception):
                    self.runs.finish_run(run_id, "FAILED")
            raise
        if own_run:
            self.runs.finish_run(run_id)
        logger.info("registered target %s revision %s as version %s", target_name, revision, version)
        return version

    def onboard_target(self, target_name: str, card: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """A new version of model ``target_name`` for an onboarding, whose revision is not known yet: ``card``
        is logged to a new, finished run in ``eagle-targets`` and registered with ``tags`` (the pipeline's
        state, set in the same call) and ``kind=target``; ``claim_target_version`` adds the revision."""
        name = target_model_name(target_name)
        run_id = self.runs.start_run(TARGETS_EXPERIMENT, f"{target_name}@onboarding", {"target_name": target_name})
        try:
            self.runs.log_dict(run_id, {**dict(card), "name": target_name}, TARGET_CARD_PATH)
            version = self._register_version(
                name, run_id, TARGET_CARD_PATH.rsplit("/", 1)[0], {**dict(tags), "kind": "target", "target_name": target_name}
            )
        except Exception:
            with contextlib.suppress(Exception):
                self.runs.finish_run(run_id, "FAILED")
            raise
        self.runs.finish_run(run_id)
        return version

    def claim_target_version(self, target_name: str, version: str, revision: str) -> None:
        """Tag ``version`` of model ``target_name`` with ``revision``, so that ``register_target`` (the training
        job) finds it; refuses when another version already holds that revision."""
        name = target_model_name(target_name)
        holder = self.target_version(target_name, revision)
        if holder is not None and holder != str(version):
            raise RegistryError(f"{name} revision {revision} is registered already as version {holder}")
        self.set_version_tags(name, str(version), {"kind": "target", "target_name": target_name, "target_revision": str(revision)})

    def target_version(self, target_name: str, revision: str) -> str | None:
        """The version of model ``target_name`` registered for ``revision``, or None."""
        name = target_model_name(target_name)
        with self._errors(f"searching versions of {name!r}"):
            versions = self.client.search_model_versions(
                f"name = {_quote(name)} and tags.target_revision = {_quote(str(revision))}"
            )
        ready = sorted((v for v in versions if v.status == "READY"), key=lambda v: int(v.version))
        return ready[0].version if ready else None

    def target_card(self, target_name: str, version: str | None = None) -> dict[str, Any]:
        """The card (``target/target.json``) of a target version (default: the newest)."""
        name = target_model_name(target_name)
        with self._errors(f"target {name!r}"):
            if version is None:
                versions = self.client.search_model_versions(f"name = {_quote(name)}")
                if not versions:
                    raise RegistryError(f"target {target_name!r} is not registered at {self.uri}")
                version = max(versions, key=lambda v: int(v.version)).version
            model_version = self._get_version(name, version=str(version))
        with tempfile.TemporaryDirectory() as tmp, self._errors(f"downloading the card of {name} version {version}"):
            import mlflow.artifacts

            local = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{model_version.source.rstrip('/')}/target.json", dst_path=tmp, tracking_uri=self.uri
            )
            return json.loads(Path(local).read_text())

    # ---- heads ---------------------------------------------------------------------------------------

    def register_head(
        self,
        run_id: str,
        head_artifact_path: str,
        target_name: str,
        target_revision: str,
        alias: str | None = CANDIDATE,
        tags: Mapping[str, Any] | None = None,
        *,
        target_model_version: str | None = None,
    ) -> str:
        """Register the head directory logged at ``head_artifact_path`` of run ``run_id`` as a new version of
        ``<target_name>-eagle``, tagged with its target, and point ``alias`` at it. Returns the version.

        The head's files must already be logged (``config.json`` and ``model.safetensors`` under that path),
        and the target must be registered at ``target_revision`` (``register_target``; its version is the
        ``target_model_version`` tag). All or nothing: when a step fails, a registered model created by this
        call is deleted again, and so is a version it created.
        """
        name = head_model_name(target_name)
        target_revision = str(target_revision)
        artifact_path = head_artifact_path.strip("/")
        with self._errors(f"listing artifacts of run {run_id}"):
            present = {Path(f.path).name for f in self.client.list_artifacts(run_id, artifact_path) if not f.is_dir}
        missing = [f for f in HEAD_FILES if f not in present]
        if missing:
            raise RegistryError(f"run {run_id} has no head at {artifact_path!r}: missing {', '.join(missing)} (log the head before registering it)")
        if target_model_version is None:
            target_model_version = self.target_version(target_name, target_revision)
            if target_model_version is None:
                raise RegistryError(
                    f"target {target_name!r} revision {target_revision!r} is not registered: register the target before its heads"
                )
        all_tags = {
            **{str(k): str(v) for k, v in (tags or {}).items()},
            "kind": "eagle-head",
            "target_name": target_name,
            "target_revision": target_revision,
            "target_model_version": str(target_model_version),
        }
        version = self._register_version(name, run_id, artifact_path, all_tags, alias=alias)
        logger.info("registered head %s version %s (run %s)%s", name, version, run_id, f" as @{alias}" if alias else "")
        return version

    def promote(self, target_name: str, version: str | int, alias: str = PRODUCTION) -> None:
        """Point ``alias`` (default ``production``) of ``<target_name>-eagle`` at ``version``."""
        name = head_model_name(target_name)
        self._get_version(name, version=str(version))  # one clear line for an unknown version
        with self._errors(f"setting alias {alias!r} of {name!r}"):
            self.client.set_registered_model_alias(name, alias, str(version))
        logger.info("%s@%s -> version %s", name, alias, version)

    def head_version_info(self, name: str, alias: str | None = PRODUCTION, *, version: str | None = None) -> dict[str, Any]:
        """What ``models:/<name>@<alias>`` (or ``/<version>``) points at: version, run_id, source, tags,
        aliases. ``name`` is the registered model name (``head_model_name(target)``)."""
        model_version = self._get_version(name, alias=None if version is not None else alias, version=version)
        with self._errors(f"registered model {name!r}"):
            model = self.client.get_registered_model(name)
        return {
            "name": name,
            "version": model_version.version,
            "run_id": model_version.run_id,
            "source": model_version.source,
            "tags": dict(model_version.tags),
            "aliases": sorted(a for a, v in model.aliases.items() if v == model_version.version),
        }

    def resolve_head(self, models_uri: str) -> str:
        """A local directory holding the head named by ``models:/<name>@<alias>`` or ``models:/<name>/<version>``.

        Downloads into ``cache_dir()/<name>/<version>`` (atomically: a temporary folder renamed into place)
        and reuses that folder while it holds the same run's files.
        """
        name, alias, version = parse_models_uri(models_uri)
        model_version = self._get_version(name, alias=alias, version=version)
        marker = {"name": name, "version": model_version.version, "run_id": model_version.run_id, "source": model_version.source}
        dest = cache_dir() / name / str(model_version.version)
        if _cached(dest, marker):
            logger.debug("%s: cached at %s", models_uri, dest)
            return str(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model_version.version}-", dir=dest.parent))
        try:
            import mlflow.artifacts

            with self._errors(f"downloading {name} version {model_version.version}"):
                local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_version.source, dst_path=str(tmp / "dl"), tracking_uri=self.uri))
            missing = [f for f in HEAD_FILES if not (local / f).is_file()]
            if missing:
                raise RegistryError(f"{name} version {model_version.version} is not a head directory: missing {', '.join(missing)}")
            (local / _CACHE_MARKER).write_text(json.dumps(marker))
            if dest.exists() and not _cached(dest, marker):
                shutil.rmtree(dest, ignore_errors=True)  # a stale copy (another server's version with this number)
            try:
                os.replace(local, dest)
            except OSError:
                if not _cached(dest, marker):  # else another process put the same files in place meanwhile
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("%s -> version %s, downloaded to %s", models_uri, model_version.version, dest)
        return str(dest)

    def resolve_head_version(self, models_uri: str) -> tuple[str, str]:
        """``(local directory, version)`` of the head ``models:/<name>@<alias>`` (or ``/<version>``) names.

        Each success records, beside the head cache, which version the URI resolved to. When no tracking
        server answers (``RegistryUnavailableError``: down or restarting), the version recorded last is used
        if its cached copy is complete, so a replacement replica starts while MLflow is briefly down; the
        caller's alias watch picks up a move once the server is back."""
        name, alias, version = parse_models_uri(models_uri)
        record = cache_dir() / name / ".resolved.json"
        try:
            number = str(version) if version is not None else str(self.head_version_info(name, alias)["version"])
            directory = self.resolve_head(f"models:/{name}/{number}")
        except RegistryUnavailableError as err:
            try:
                number = json.loads(record.read_text())[models_uri]
            except (OSError, ValueError, KeyError):
                raise err from None
            directory = cache_dir() / name / number
            try:
                marker = json.loads((directory / _CACHE_MARKER).read_text())
            except (OSError, ValueError):
                raise err from None
            if not _cached(directory, marker):
                raise err from None
            logger.warning("%s: %s; serving version %s from the local cache %s", models_uri, err, number, directory)
            return str(directory), number
        try:  # best effort: the record only helps a later start during an outage
            known = json.loads(record.read_text()) if record.is_file() else {}
            tmp = record.with_name(f".resolved-{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**known, models_uri: number}))
            os.replace(tmp, record)
        except (OSError, ValueError):
            logger.debug("could not record %s -> %s", models_uri, number, exc_info=True)
        return directory, number

    # ---- versions, tags and aliases of any registered model -------------------------------------------

    def versions(self, name: str) -> list[dict[str, Any]]:
        """Every version of registered model ``name``, oldest first, as ``{"version", "tags", "aliases",
        "run_id", "source", "created_ms"}`` (``aliases``: the sorted aliases naming that version); ``[]`` when
        the model does not exist."""
        model = self._registered_model(name)
        if model is None:
            return []
        with self._errors(f"listing versions of {name!r}"):
            found = _all_pages(lambda token: self.client.search_model_versions(f"name = {_quote(name)}", page_token=token))
        return [
            {
                "version": v.version,
                "tags": dict(v.tags),
                "aliases": sorted(a for a, target in model.aliases.items() if target == v.version),
                "run_id": v.run_id,
                "source": v.source,
                "created_ms": v.creation_timestamp,
            }
            for v in sorted(found, key=lambda v: int(v.version))
        ]

    def set_version_tags(self, name: str, version: str, tags: Mapping[str, Any]) -> None:
        """Set tags (values as strings) on ``version`` of registered model ``name`` (pending ones too)."""
        self._find_version(name, version=str(version))  # one clear line for an unknown model or version
        with self._errors(f"tagging {name!r} version {version}"):
            for key, value in tags.items():
                self.client.set_model_version_tag(name, str(version), str(key), str(value))

    def delete_version_tag(self, name: str, version: str, key: str) -> None:
        """Remove tag ``key`` from ``version`` of registered model ``name`` (no error when it is not set)."""
        self._find_version(name, version=str(version))
        with self._errors(f"untagging {name!r} version {version}"):
            self.client.delete_model_version_tag(name, str(version), str(key))

    def alias_version(self, name: str, alias: str) -> str | None:
        """The version ``alias`` of registered model ``name`` points at; None when the alias is unset or the
        model does not exist."""
        model = self._registered_model(name)
        return None if model is None else model.aliases.get(alias)

    def delete_alias(self, name: str, alias: str) -> None:
        """Remove ``alias`` from registered model ``name``; no error when the alias (or the model) is absent."""
        if self._registered_model(name) is None:
            return
        with self._errors(f"deleting alias {alias!r} of {name!r}"):
            self.client.delete_registered_model_alias(name, alias)

    def models(self) -> list[dict[str, Any]]:
        """Every registered model, by name: ``{"name", "tags", "aliases"}`` (``aliases``: alias -> version)."""
        with self._errors("listing registered models"):
            found = _all_pages(lambda token: self.client.search_registered_models(page_token=token))
        return [
            {"name": m.name, "tags": dict(m.tags), "aliases": dict(m.aliases)}
            for m in sorted(found, key=lambda m: m.name)
        ]

    # ---- internals -----------------------------------------------------------------------------------

    def _registered_model(self, name: str):
        """The registered model ``name``, or None when there is none."""
        with self._errors(f"registered model {name!r}"):
            try:
                return self.client.get_registered_model(name)
            except MlflowException as err:
                if _error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                    return None
                raise

    def _register_version(
        self, name: str, run_id: str, artifact_path: str, tags: Mapping[str, str], *, alias: str | None = None
    ) -> str:
        """Create ``name`` if missing, a version whose source is the run's ``artifact_path``, and the alias.

        Two-phase: the version is created tagged ``registration=pending`` and marked ``complete`` once it is
        READY, before the alias moves; readers refuse a pending version (``_get_version``) and pipelines skip
        it (``is_complete``), so a registration killed half-way (SIGKILL: no cleanup runs) leaves a version
        nobody mistakes for a good head. When a step fails in this process, the version it created is
        deleted again; the registered model never is (another job may have added versions meanwhile)."""
        mlflow_client = self.client
        version = None
        try:
            with self._errors(f"registering {name!r}"):
                run = mlflow_client.get_run(run_id)
                try:
                    mlflow_client.get_registered_model(name)
                except MlflowException as err:
                    if _error_code(err) != "RESOURCE_DOES_NOT_EXIST":
                        raise
                    try:
                        mlflow_client.create_registered_model(name)
                    except MlflowException as exists:  # created meanwhile by another process
                        if _error_code(exists) != "RESOURCE_ALREADY_EXISTS":
                            raise
                source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
                with contextlib.redirect_stdout(sys.stderr):
                    model_version = mlflow_client.create_model_version(
                        name, source=source, run_id=run_id, tags={**tags, REGISTRATION_TAG: PENDING}
                    )
                version = model_version.version
                if model_version.status != "READY":
                    raise RegistryError(f"{name} version {version} is {model_version.status}: {model_version.status_message}")
                mlflow_client.set_model_version_tag(name, version, REGISTRATION_TAG, COMPLETE)
                if alias:
                    mlflow_client.set_registered_model_alias(name, alias, version)
            return version
        except BaseException:
            if version is not None:
                with contextlib.suppress(Exception):
                    mlflow_client.delete_model_version(name, version)
            raise

    def _get_version(self, name: str, *, alias: str | None = None, version: str | None = None):
        """The MLflow model version an alias or number names; a version whose registration never finished
        (``registration=pending``: its job was killed half-way) is refused in one line."""
        model_version = self._find_version(name, alias=alias, version=version)
        if (model_version.tags or {}).get(REGISTRATION_TAG) == PENDING:
            raise RegistryError(f"{name} version {model_version.version}: its registration did not finish (the job that "
                                f"created it died); it is not a usable version")
        return model_version

    def _find_version(self, name: str, *, alias: str | None = None, version: str | None = None):
        model = self._registered_model(name)
        if model is None:
            raise RegistryError(f"no registered model {name!r} at {self.uri}")
        mlflow_client = self.client
        with self._errors(f"registered model {name!r}"):
            if alias is not None:
                if alias not in model.aliases:
                    known = ", ".join(sorted(model.aliases)) or "none"
                    raise RegistryError(f"registered model {name!r} has no alias {alias!r} (aliases: {known})")
                return mlflow_client.get_model_version(name, model.aliases[alias])
            if version is None:
                raise RegistryError(f"model {name!r}: give an alias or a version")
            if not str(version).isdigit():
                raise RegistryError(f"model {name!r}: version must be a number, got {version!r}")
            try:
                return mlflow_client.get_model_version(name, str(version))
            except MlflowException as err:
                if _error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                    raise RegistryError(f"registered model {name!r} has no version {version}") from None
                raise


def is_complete(version: Mapping[str, Any]) -> bool:
    """Whether a version (a ``Registry.versions`` entry) finished its registration: only versions created by
    ``_register_version`` and killed before they were marked complete are not (older ones have no tag)."""
    return (version.get("tags") or {}).get(REGISTRATION_TAG) != PENDING


def resolve_head(uri: str, *, tracking: str | None = None) -> str:
    """``Registry(tracking).resolve_head(uri)``: a local directory holding the head ``models:/<name>@<alias>``
    or ``models:/<name>/<version>`` names. This is the ``models`` resolver of the ``eagle.head_resolvers``
    entry-point group (pyproject.toml), so ``eaglectl --head models:/...`` works."""
    return Registry(tracking).resolve_head(uri)


# ------------------------------------------------------------------------------------------- internals


def _all_pages(search: Callable[[str | None], Any]) -> list:
    """Every item of a paged MLflow search: ``search(page_token)`` returns a ``PagedList``."""
    items: list = []
    token = None
    while True:
        page = search(token)
        items.extend(page)
        token = page.token
        if not token:
            return items


def _cached(dest: Path, marker: Mapping[str, Any]) -> bool:
    try:
        return json.loads((dest / _CACHE_MARKER).read_text()) == dict(marker) and all((dest / f).is_file() for f in HEAD_FILES)
    except (OSError, ValueError):
        return False


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _tag_key(key: str) -> str:
    return key if re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key) else f"`{key}`"


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:6000]


__all__ = [
    "CANDIDATE",
    "DEFAULT_TRACKING_URI",
    "PRODUCTION",
    "Registry",
    "RegistryError",
    "Runs",
    "cache_dir",
    "head_model_name",
    "head_uri",
    "parse_models_uri",
    "resolve_head",
    "target_model_name",
    "tracking_uri",
]
