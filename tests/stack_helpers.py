"""Run infra/local/stack.sh on free ports from tests (tests/test_stack.py, tests/test_serve_deploy.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from env_helpers import temporary_env
from mlflow_server import free_port

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "infra" / "local" / "stack.sh"
BIN = Path(sys.executable).parent
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default worker port range: no head port may fall in it
PORT_NAMES = ("MLFLOW_PORT", "RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_CLIENT_PORT", "RAY_AGENT_PORT")


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


def stack_env(state_dir: Path, num_cpus: int = 1) -> tuple[dict, dict[str, int]]:
    """The environment for a private stack in ``state_dir`` on free ports, and those ports."""
    taken: set[int] = set()
    ports = {name: stack_port(taken) for name in PORT_NAMES}
    env = dict(os.environ, EAGLE_STACK_DIR=str(state_dir), RAY_NUM_CPUS=str(num_cpus), PATH=f"{BIN}:{os.environ['PATH']}")
    env.update({name: str(port) for name, port in ports.items()})
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    return env, ports


def client_env(env: dict, state_dir: Path) -> dict:
    """``env`` plus what `stack.sh up` exported (stack.env): RAY_ADDRESS, RAY_API_SERVER_ADDRESS, MLflow, token mode."""
    out = dict(env)
    for line in (state_dir / "stack.env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        out[key] = value
    return out


def mlflow_credentials(env: dict):
    """This test process talks to the stack's authenticated MLflow (as jobs do) while the block runs: the
    user and the password from the file the stack's env names, set in os.environ and put back after."""
    password = Path(env["EAGLE_MLFLOW_PASSWORD_FILE"]).read_text().strip()
    return temporary_env({"MLFLOW_TRACKING_USERNAME": env["MLFLOW_TRACKING_USERNAME"], "MLFLOW_TRACKING_PASSWORD": password})
