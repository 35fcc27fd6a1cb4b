"""What every job entry point shares: a one-line-error argument parser, logging, Ray start-up, the preset
arguments and the exit-code contract.

Exit codes: 0 done; 2 bad input (one line on stderr, nothing started or registered); 1 the job failed
while running (logged with its traceback; an MLflow run, if any, is marked FAILED by the job).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

from eagle.errors import EagleError
from eagle.target import cache_root

logger = logging.getLogger("jobs")

NOISY_LOGGERS = ("transformers", "DeepSpeed", "urllib3", "matplotlib", "PIL", "botocore", "aiobotocore", "s3fs", "filelock")


class JobParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def job_parser(prog: str, description: str) -> JobParser:
    parser = JobParser(prog=prog, description=description)
    parser.add_argument("--preset", default="quick", help="preset name (jobs/presets.py): quick, cpu-long, a100-7b, ...")
    parser.add_argument("--target", default=None, help="target spec (built-in name or HF directory); default: the preset's")
    parser.add_argument("--dataset", default=None, help="dataset name under the storage URI; default: the preset's")
    parser.add_argument(
        "--storage", default=os.environ.get("EAGLE_STORAGE", default_storage()),
        help="storage URI for data and features: a local folder or s3://bucket/prefix (env EAGLE_STORAGE)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def default_storage() -> str:
    """``$EAGLE_CACHE_DIR/storage`` or ``~/.cache/eagle-platform/storage``: outside the repo, so
    ``ray job submit --working-dir .`` never uploads data."""
    return str(cache_root() / "storage")


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def torch_extensions_dir() -> str:
    """One persistent folder for DeepSpeed's JIT-built CPU ops (its shared-memory allreduce takes ~2 minutes
    to compile once; every later job and test reuses it)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_root() / "torch_extensions")


def init_ray(num_cpus: int | None = None, *, metrics_export_port: int | None = None) -> None:
    """Connect to the cluster this job was submitted to (``RAY_ADDRESS`` is set by ``ray job submit``), or
    start a private local instance when run directly (set ``RAY_ADDRESS`` to use an existing cluster).

    A bare ``ray.init()`` attaches to whatever ``ray start`` cluster runs on this host (Ray autodetects the
    latest one), and so do Ray Train's internal actors when they query the state API: on a host shared with
    another cluster, Ray Train's ``PlacementGroupCleaner`` asked *that* cluster about our controller, found
    nothing and removed our workers' placement group mid-run. So a local instance gets a chosen GCS port that
    is exported to all its processes as ``RAY_ADDRESS``, and a dashboard (which serves the state API) on a
    free port. ``metrics_export_port`` fixes where Ray's metrics agent serves Prometheus metrics (local only).
    """
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # inside `ray job submit`: the job's runtime env applies; workers call worker_env()
        ray.init(log_to_driver=True)
        return
    from ray._private.services import get_node_ip_address

    # A new local instance runs in token mode; left to itself Ray would write a world-readable token to
    # ~/.ray/auth_token on a machine that has none (eagle_platform.ray_token says why and where instead).
    from eagle_platform.ports import free_port
    from eagle_platform.ray_token import ensure_token  # here, not at the top: the jobs' plain functions (answer
    # regeneration, features) import on a machine without the control plane (infra/gpu/smollm2_head.py)

    logger.info(ensure_token().describe())
    port = free_port()
    address = f"{get_node_ip_address()}:{port}"
    env = {
        "env_vars": {
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
            "RAY_ADDRESS": address,
        }
    }
    saved = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)
    try:
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
            runtime_env=env, log_to_driver=True,
            **({"_metrics_export_port": metrics_export_port} if metrics_export_port else {}),
        )
    finally:
        if saved is None:
            os.environ.pop("RAY_GCS_SERVER_PORT", None)
        else:
            os.environ["RAY_GCS_SERVER_PORT"] = saved
    actual = ray.get_runtime_context().gcs_address
    if actual != address:  # pragma: no cover - the port was taken in between
        logger.warning("local Ray started at %s, not %s: its internal actors may address another cluster", actual, address)


def worker_env() -> None:
    """Environment every Ray worker of these jobs needs, set from inside the worker (a submitted job's
    workers do not inherit the driver's environment)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())


def run_job(name: str, main: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, set up logging and run ``main``; an ``EagleError`` or ``RegistryError`` (bad input, an unreachable
    tracking server) becomes one line and exit code 2."""
    from eagle_platform.registry import RegistryError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "verbose", False))
    try:
        return main(args)
    except (EagleError, RegistryError) as err:
        sys.stderr.write(f"{name}: error: {err}\n")
        return 2
    except KeyboardInterrupt:
        return 130
