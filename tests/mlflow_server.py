"""A real MLflow tracking server for tests: sqlite backend and proxied artifacts in a temporary folder.

``start_mlflow_server(tmp_path)`` starts ``mlflow server`` on a free 127.0.0.1 port (one worker, no job
runner: ~0.5 GiB, see ../shared/STACK.md), polls ``GET /health`` until it answers (deadline, no fixed sleeps)
and returns ``(uri, process)``; ``stop_mlflow_server(process)`` terminates its whole process group. The
``mlflow_server`` session fixture in conftest.py wraps both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle_platform.ports import free_port  # noqa: F401  (re-exported: the tests import it from here)

STARTUP_TIMEOUT_S = 90.0


def health_ok(uri: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _mlflow_executable() -> list[str]:
    script = Path(sys.executable).parent / "mlflow"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "mlflow"]


def start_mlflow_server(tmp_path: str | os.PathLike, port: int | None = None) -> tuple[str, subprocess.Popen]:
    """Start a server whose state lives under ``tmp_path``; return its URI and process once /health answers."""
    root = Path(tmp_path)
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(root / "mlflow-server.log", "wb")
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [
        *_mlflow_executable(), "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    delay = 0.05
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {process.returncode}: {_tail(root / 'mlflow-server.log')}")
        if health_ok(uri):
            return uri, process
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    stop_mlflow_server(process)
    raise RuntimeError(f"mlflow server at {uri} did not answer /health within {STARTUP_TIMEOUT_S:.0f}s: {_tail(root / 'mlflow-server.log')}")


def stop_mlflow_server(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """Terminate the server and its workers (its own process group: started with a new session)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=timeout)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
