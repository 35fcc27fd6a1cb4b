"""infra/local/stack.sh end to end on free ports: up (Ray head + MLflow), up again, status, a `ray job submit`
with token authentication, down; afterwards nothing it started is left listening."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from mlflow_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "infra" / "local" / "stack.sh"
BIN = Path(sys.executable).parent
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default worker port range: no head port may fall in it


def stack_port(taken: set[int]) -> int:
    while True:
        port = free_port()
        if port not in RAY_WORKER_PORTS and port not in taken:
            taken.add(port)
            return port


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stack(command: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(STACK), command], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not (BIN / "ray").is_file() or not (BIN / "mlflow").is_file(), reason="needs ray and mlflow in the venv")
def test_stack_up_status_submit_down(tmp_path):
    taken: set[int] = set()
    ports = {name: stack_port(taken) for name in ("MLFLOW_PORT", "RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_CLIENT_PORT", "RAY_AGENT_PORT")}
    env = dict(os.environ, EAGLE_STACK_DIR=str(tmp_path / "stack"), RAY_NUM_CPUS="1", PATH=f"{BIN}:{os.environ['PATH']}")
    env.update({name: str(port) for name, port in ports.items()})
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    mlflow_uri = f"http://127.0.0.1:{ports['MLFLOW_PORT']}"
    try:
        up = stack("up", env)
        assert up.returncode == 0, up.stderr
        assert f"export MLFLOW_TRACKING_URI={mlflow_uri}" in up.stdout
        assert f"export RAY_API_SERVER_ADDRESS=http://127.0.0.1:{ports['RAY_DASHBOARD_PORT']}" in up.stdout
        with urllib.request.urlopen(f"{mlflow_uri}/health", timeout=5) as response:
            assert response.status == 200
        record = (tmp_path / "stack" / "ray-head.env").read_text()
        assert "RAY_SESSION=session_" in record and (tmp_path / "stack" / "mlflow.db").is_file()

        again = stack("up", env, timeout=60)  # idempotent: nothing new starts
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stderr and (tmp_path / "stack" / "ray-head.env").read_text() == record

        status = stack("status", env, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "mlflow: up" in status.stdout and "ray: up" in status.stdout

        job_env = dict(env)
        for line in (tmp_path / "stack" / "stack.env").read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            job_env[key] = value
        job = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--working-dir", str(ROOT), "--", "python", "-c", "import eagle, jobs; print('job-ok')"],
            env=job_env, cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert job.returncode == 0 and "job-ok" in job.stdout, job.stdout[-2000:] + job.stderr[-2000:]
    finally:
        down = stack("down", env, timeout=120)
    assert down.returncode == 0, down.stderr
    still_open = {name: port for name, port in ports.items() if listening(port)}
    assert still_open == {}, f"still listening after down: {still_open}"
    assert not (tmp_path / "stack" / "ray-head.env").exists() and not (tmp_path / "stack" / "mlflow.pid").exists()
    status = stack("status", env, timeout=60)
    assert status.returncode == 1 and "mlflow: down" in status.stdout and "ray: down" in status.stdout
