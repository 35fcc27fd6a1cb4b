"""Shared fixtures: the real SmolLM2 target (loaded once per session) and offline settings."""

import os

import pytest
import torch

pytest_plugins = ["strict_skips", "tiers"]  # make test: a skipped test fails (tests/strict_skips.py); tiers: tests/tiers.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one process: two torch threads; under pytest-xdist (make test: -n 2) the cores are shared out among the workers
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32 (exact-equality tests belong in fp32, see ../shared/STACK.md)."""
    from eagle import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server for the whole session (sqlite + proxied artifacts in a temporary
    folder, one worker; see tests/mlflow_server.py). Yields its URI, e.g. ``http://127.0.0.1:43117``;
    tests point ``MLFLOW_TRACKING_URI`` at it with ``monkeypatch.setenv``."""
    from mlflow_server import start_mlflow_server, stop_mlflow_server

    uri, process = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    try:
        yield uri
    finally:
        stop_mlflow_server(process)


@pytest.fixture(scope="module", autouse=True)
def _ray_shutdown_after_module():
    """Jobs called in-process (featurize(...), prepare(...)) start a private Ray instance and leave it up for
    the rest of their module; shut it down when the module ends so the next module starts from none."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
