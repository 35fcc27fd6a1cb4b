"""Rolling a new pair out to a running Serve cluster without restarting the pairs it already serves.

The control plane calls this when a target's head passes its gate. It owns the cluster's Serve config
(Serve's REST API on the Ray dashboard, ``PUT /api/serve/applications/``, which replaces every application
deployed that way) and lays it out as **one Serve application per pair** plus one ingress application:

* ``pair-<model>`` (``serve.app:build_pair_app``, no HTTP route): the pair's deployment of the same name;
* ``<app_name>`` (``serve.app:build_ingress_app``, route ``/``): the OpenAI ingress, whose ``user_config``
  (``{"pairs": {model: application}}``) says which pair applications it routes to.

Why not the single application of serve/config.yaml (``serve.app:build_app``, the pairs in its ``args``)?
What Ray 2.60's source says happens on re-applying a config:

* ``ApplicationState.apply_app_config`` (ray/serve/_private/application_state.py) compares the config's code
  version, ``get_app_code_version`` (ray/serve/_private/deploy_utils.py: a hash of ``import_path``,
  ``runtime_env`` and **``args``**, plus autoscaling policies, request routers and deployment actors), with
  the running one. Equal: it only re-applies the config's per-deployment overrides
  (``override_deployment_info``) to the application's last build. Different: it rebuilds the application
  (``build_serve_application``), which stamps *every* deployment of it with the new code version
  (``get_deploy_args(version=code_version)``).
* ``DeploymentVersion.requires_actor_restart`` (ray/serve/_private/version.py) is true when the code version
  differs, so ``DeploymentState._stop_or_update_outdated_version_replicas``
  (ray/serve/_private/deployment_state.py) stops every replica of every deployment of a rebuilt application
  and starts new ones: adding a pair to ``build_app``'s ``args.pairs`` restarts all pairs and the ingress.
  A change confined to ``user_config`` (part of the deployment config, not of the code version) only makes
  ``requires_actor_reconfigure`` true: the live replicas get ``reconfigure(user_config)`` and keep running.
* ``ApplicationStateManager.apply_app_configs`` applies each application of a multi-application config on
  its own and deletes the applications that the config no longer lists; an application whose config is
  unchanged takes the "equal" path above, and ``DeploymentState.deploy`` finds its deployment info
  unchanged and does nothing.

Seen here (Ray 2.60, a scratch experiment through the REST API): re-applying a single application with one
more entry in ``args`` gave every deployment new replica actors; adding an application to a
multi-application config left the other applications' replica actors as they were, and a changed
``user_config`` reached the running ingress replica. tests/test_rollout.py checks it with real pairs.

So adding a pair adds an application and changes only the ingress's ``user_config``. ``roll_out`` does it
in two steps so the ingress never routes to a pair that is not up (its ``/health`` and ``/v1/models`` would
report the starting pair): first the new pair applications with the ingress's routes unchanged, wait until
they run, then the routes. An unchanged pair must be given as the same dict as before (``deployed_pairs``
returns them as deployed); a pair whose dict changes restarts that pair only.

This module is torch-free: it builds config dicts and speaks HTTP (httpx); the pairs' schema is checked
where the applications are built (``serve.app.PairAppArgs``: a bad pair fails its application, which
``wait_running`` reports). With token authentication (``RAY_AUTH_MODE=token``) every request sends the token
of ``eagle_platform.ray_token.read_token``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from eagle_platform.ray_token import read_token
from serve.names import deployment_name

logger = logging.getLogger(__name__)

PAIR_IMPORT = "serve.app:build_pair_app"
INGRESS_IMPORT = "serve.app:build_ingress_app"
SINGLE_APP_IMPORT = "serve.app:build_app"  # serve/config.yaml's layout, read by served_models too
INGRESS_DEPLOYMENT = "openai"
# serve_config's settings (serve.app.AppArgs' fields besides pairs and tracking_uri): those the pair
# applications take (serve.app.PairAppArgs) and those the ingress does not (serve.app.IngressArgs);
# retry_after_s goes to both
PAIR_SETTINGS = ("retry_after_s", "backpressure_status")
INGRESS_EXCLUDED = ("backpressure_status",)
APPLICATIONS_PATH = "/api/serve/applications/"


class RolloutError(RuntimeError):
    """The dashboard refused or could not be reached, or an application failed or did not start in time."""


def serve_config(pairs: list[dict[str, Any]], *, tracking_uri: str | None, host: str = "127.0.0.1", port: int = 8000,
                 app_name: str = "eagle", settings: Mapping[str, Any] | None = None,
                 routed: Iterable[str] | None = None) -> dict[str, Any]:
    """A Serve deploy config (``ray.serve.schema.ServeDeploySchema``'s shape) serving ``pairs``.

    Args:
        pairs: ``serve.app.PairArgs``-shaped dicts; each becomes the application ``pair-<model>``.
        tracking_uri: MLflow, for ``models:/`` heads (None: the cluster's ``$MLFLOW_TRACKING_URI``).
        host, port: Serve's HTTP proxy (fixed when Serve starts; later values are ignored by Ray).
        app_name: the ingress application (route ``/``).
        settings: ``serve.app.AppArgs``' other fields (``retry_after_s``, ``request_timeout_s``, ...).
        routed: the models the ingress routes to (default: all of ``pairs``).
    """
    models = [pair.get("model") for pair in pairs]
    if not all(isinstance(model, str) and model for model in models):
        raise ValueError(f"every pair needs a model id, got {models}")
    apps = [deployment_name(model) for model in models]
    if len(set(apps)) != len(apps):
        raise ValueError(f"two pairs would share an application name: models {models} -> {apps}")
    routed = list(models if routed is None else routed)
    if unknown := sorted(set(routed) - set(models)):
        raise ValueError(f"routed models without a pair: {unknown}")
    settings = dict(settings or {})
    pair_settings = {key: settings[key] for key in PAIR_SETTINGS if key in settings}
    ingress_settings = {key: value for key, value in settings.items() if key not in INGRESS_EXCLUDED}
    ingress = {
        "name": app_name,
        "route_prefix": "/",
        "import_path": INGRESS_IMPORT,
        "args": ingress_settings,
        "deployments": [{"name": INGRESS_DEPLOYMENT, "user_config": {"pairs": {m: deployment_name(m) for m in sorted(routed)}}}],
    }
    pair_apps = [
        {
            "name": app,
            "route_prefix": None,
            "import_path": PAIR_IMPORT,
            "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}},
            "args": {"pair": dict(pair), "tracking_uri": tracking_uri, **pair_settings},
        }
        for app, pair in sorted(zip(apps, pairs), key=lambda item: item[0])
    ]
    return {"proxy_location": "HeadOnly", "http_options": {"host": host, "port": port}, "applications": [ingress, *pair_apps]}


def apply(config: dict[str, Any], dashboard_url: str, timeout_s: float = 60.0) -> None:
    """PUT ``config`` to the dashboard's Serve REST API (returns once Serve's controller took it; the
    applications then deploy: ``wait_running``)."""
    _request("PUT", dashboard_url, timeout_s, json=config)


def details(dashboard_url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Serve's state as the REST API reports it (``ServeInstanceDetails``: applications, their status,
    deployed config, deployments and replicas)."""
    return _request("GET", dashboard_url, timeout_s).json()


def served_models(dashboard_url: str) -> set[str]:
    """The models deployed now (in either layout, whatever their status: ``wait_running`` waits for one)."""
    return set(_model_apps(details(dashboard_url)))


def deployed_pairs(dashboard_url: str) -> list[dict[str, Any]]:
    """The pairs of the pair applications, as deployed: give them to ``serve_config`` again unchanged and
    their applications stay as they are."""
    return [app["args"]["pair"] for app in _deployed_configs(details(dashboard_url)).values()
            if app.get("import_path") == PAIR_IMPORT]


def wait_running(dashboard_url: str, models: Iterable[str], timeout_s: float, *, app_name: str = "eagle",
                 every_s: float = 1.0) -> None:
    """Wait until the application of every model in ``models`` and the ingress application run."""
    models = set(models)
    deadline = time.monotonic() + timeout_s
    while True:
        state = details(dashboard_url)
        apps = state.get("applications") or {}
        model_apps = _model_apps(state)
        wanted = {model_apps.get(model) for model in models} | ({app_name} if app_name in apps else set())
        pending = {}
        for app in sorted(wanted - {None}):
            status = apps[app]["status"]
            if status == "DEPLOY_FAILED":
                raise RolloutError(f"application {app!r} failed to deploy: {_failure(apps[app])}")
            if status != "RUNNING":
                pending[app] = status
        missing = sorted(model for model in models if model not in model_apps)
        if not pending and not missing:
            return
        if time.monotonic() >= deadline:
            waiting = ", ".join([f"{app} {status}" for app, status in pending.items()] + [f"{m} not deployed" for m in missing])
            raise RolloutError(f"timed out after {timeout_s:.0f} s waiting for {waiting}")
        time.sleep(every_s)


def roll_out(pairs: list[dict[str, Any]], dashboard_url: str, *, tracking_uri: str | None, timeout_s: float = 900.0,
             **config: Any) -> None:
    """Serve exactly ``pairs``: start the new pair applications while the ingress keeps its routes, wait until
    they run, then route to them (and stop routing to, and delete, the pairs no longer listed).

    ``config``: ``serve_config``'s other keyword arguments (host, port, app_name, settings)."""
    app_name = config.get("app_name", "eagle")
    started = time.monotonic()
    models = {pair["model"] for pair in pairs}
    routed = _routed_models(details(dashboard_url), app_name) & models
    if new := sorted(models - routed):
        logger.info("rollout: starting %s (the ingress keeps routing to %s)", new, sorted(routed) or "none")
        apply(serve_config(pairs, tracking_uri=tracking_uri, routed=routed, **config), dashboard_url)
        wait_running(dashboard_url, models, max(1.0, timeout_s - (time.monotonic() - started)), app_name=app_name)
    apply(serve_config(pairs, tracking_uri=tracking_uri, **config), dashboard_url)
    wait_running(dashboard_url, models, max(1.0, timeout_s - (time.monotonic() - started)), app_name=app_name)
    logger.info("rollout: serving %s (%.1f s)", sorted(models), time.monotonic() - started)


def _routed_models(state: dict[str, Any], app_name: str) -> set[str]:
    """The models the ingress application routes to, from its deployed ``user_config``."""
    app = _deployed_configs(state).get(app_name) or {}
    for deployment in app.get("deployments") or ():
        if deployment.get("name") == INGRESS_DEPLOYMENT:
            return set(((deployment.get("user_config") or {}).get("pairs") or {}))
    return set()


def _model_apps(state: dict[str, Any]) -> dict[str, str]:
    """model id -> the application serving it (a pair application, or a single ``build_app`` one)."""
    out = {}
    for name, app in _deployed_configs(state).items():
        args = app.get("args") or {}
        if app.get("import_path") == PAIR_IMPORT:
            out[args["pair"]["model"]] = name
        elif app.get("import_path") == SINGLE_APP_IMPORT:
            out.update({pair["model"]: name for pair in args.get("pairs") or ()})
    return out


def _deployed_configs(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """application name -> the config it was deployed with (applications deployed by a config only)."""
    return {name: app["deployed_app_config"] for name, app in (state.get("applications") or {}).items()
            if app.get("deployed_app_config")}


def _request(method: str, dashboard_url: str, timeout_s: float, **kwargs: Any) -> httpx.Response:
    base = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    url = base.rstrip("/") + APPLICATIONS_PATH
    token = read_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, url, headers=headers, timeout=timeout_s, **kwargs)
    except httpx.HTTPError as err:
        raise RolloutError(f"{method} {url}: {type(err).__name__}: {_first_line(str(err))}") from None
    if response.status_code in (401, 403):
        raise RolloutError(f"{method} {url} answered {response.status_code} ({_first_line(response.text)}): the cluster "
                           "wants its token ($RAY_AUTH_TOKEN, or the file $RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token)")
    if response.status_code != 200:
        raise RolloutError(f"{method} {url} answered {response.status_code}: {_first_line(response.text)}")
    return response


def _failure(app: dict[str, Any]) -> str:
    """One line on why an application failed: the exception its build or a deployment's replica raised."""
    messages = [deployment.get("message") or "" for deployment in (app.get("deployments") or {}).values()
                if deployment.get("status") in ("DEPLOY_FAILED", "UNHEALTHY")]
    return _exception_line(next((m for m in messages if m), app.get("message") or ""))


def _exception_line(text: str) -> str:
    """The last exception of a traceback in ``text`` (``Name: message`` and its continuation lines, on one
    line), else the first line of ``text``."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _EXCEPTION.match(lines[i])
        if match:
            rest = [line.strip() for line in lines[i + 1:] if line.strip() and not line.strip().startswith("For further information")]
            return " ".join([f"{match['name'].rsplit('.', 1)[-1]}: {match['message']}", *rest])[:500]
    return _first_line(text)


_EXCEPTION = re.compile(r"^(?P<name>[A-Za-z_][\w.]*(?:Error|Exception)): (?P<message>.*)$")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
