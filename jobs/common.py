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
    root = os.environ.get("EAGLE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "eagle-platform")
    return os.path.join(root, "storage")


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def init_ray(num_cpus: int | None = None) -> None:
    """Connect to the cluster this job was submitted to (``RAY_ADDRESS`` is set by ``ray job submit``), or
    start a local one when run directly."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)


def run_job(name: str, main: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, set up logging and run ``main``; an ``EagleError`` becomes one line and exit code 2."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "verbose", False))
    try:
        return main(args)
    except EagleError as err:
        sys.stderr.write(f"{name}: error: {err}\n")
        return 2
    except KeyboardInterrupt:
        return 130
