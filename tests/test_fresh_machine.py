"""A fresh machine, which CI otherwise never sees: no Ray token, no project caches, no per-user state.

A clean checkout is not a clean machine: a token in ``~/.ray``, the dequantized target and DeepSpeed's
compiled ops under ``~/.cache/eagle-platform`` hide set-up steps the repo's own commands must perform. So
these tests run with ``HOME`` pointed at an empty folder and every variable that could point elsewhere
removed (``EAGLE_CACHE_DIR``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``TORCH_EXTENSIONS_DIR``,
``XDG_*``, Hugging Face / matplotlib / torch cache variables; ``TORCHINDUCTOR_CACHE_DIR``, whose default
lies in /tmp rather than the home folder, goes to an empty folder too):

* ``make quickstart PRESET=smoke`` (the README's first command, on a toy-sized preset, eager serving) against
  the installed venv, on a private stack (its own state folder and free ports, stopped by ``make down``):
  the stack creates the Ray token (mode 0600) and says so, the platform service creates its API token, the
  onboarding's four stages run as Ray jobs, the target is converted into the empty cache, the head passes
  its gate, and the served pair answers a chat request; ``eaglectl targets status --json`` then says
  ``ready`` with the measured tau.
* a job run directly (a private Ray started by ``jobs.common.init_ray``) creates the token with mode 0600,
  where Ray left alone writes a world-readable one.

Installing from the lock is what ``make test`` itself does first on a clean checkout (``.ci/run``), and
``tests/test_lock.py`` checks that the installed packages are the lock's.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mlflow_server import free_port
from stack_helpers import BIN, ROOT, listening, stack, stack_env

pytestmark = pytest.mark.e2e(isolated=True)  # HOME, stack state and ports of its own (tests/tiers.py)

PER_USER_VARIABLES = (
    "EAGLE_CACHE_DIR", "EAGLE_STORAGE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "TORCH_EXTENSIONS_DIR",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "HF_HOME", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE",
    "MPLCONFIGDIR", "TORCH_HOME", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI",
    "EAGLE_PLATFORM_DIR", "EAGLE_PLATFORM_TOKEN", "EAGLE_PLATFORM_URL", "EAGLE_SERVE_URL",
)


def fresh_env(base: dict[str, str], home: Path) -> dict[str, str]:
    """``base`` as a new user's machine would have it: an empty home folder and no per-user overrides."""
    home.mkdir(parents=True, exist_ok=True)
    assert not any(home.iterdir()), f"{home} is not empty"
    env = {k: v for k, v in base.items() if k not in PER_USER_VARIABLES}
    env.update(HOME=str(home), TORCHINDUCTOR_CACHE_DIR=str(home.parent / "inductor-cache"), HF_HUB_OFFLINE="1")
    return env


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_make_quickstart_on_a_fresh_machine(tmp_path):
    state = tmp_path / "stack"
    env, ports = stack_env(state, num_cpus=2)
    env = fresh_env(env, tmp_path / "home")
    home = Path(env["HOME"])
    platform_port, serve_port = free_port(), free_port()
    env.update(EAGLE_PLATFORM_PORT=str(platform_port), SERVE_PORT=str(serve_port), EAGLE_SERVE_URL=f"http://127.0.0.1:{serve_port}")
    make = ["make", "-C", str(ROOT), f"VENV={BIN.parent}", "PRESET=smoke", "SERVE_COMPILE=off", "-o", f"{BIN.parent}/.installed"]
    try:
        run = subprocess.run([*make, "quickstart"], env=env, capture_output=True, text=True, timeout=1800)
        log = f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-6000:]}"
        assert run.returncode == 0, log
        token = home / ".ray" / "auth_token"
        assert f"ray token: created {token} (mode 0600)" in run.stderr, log
        assert _mode(token) == 0o600 and _mode(token.parent) == 0o700
        assert len(token.read_text().strip()) == 64
        assert (state / "stack.env").read_text().count(f"RAY_AUTH_TOKEN_PATH={token}") == 1
        platform_token = home / ".cache" / "eagle-platform" / "platform" / "token"
        assert _mode(platform_token) == 0o600
        # the repo's own commands made the state a used machine has: the converted target, the data, the head
        cache = home / ".cache" / "eagle-platform"
        assert (cache / "targets" / "smollm2-135m" / "eagle_target.json").is_file()
        assert any((cache / "storage" / "smollm2-135m").iterdir())
        assert any((cache / "heads").iterdir())
        assert sorted(p.name for p in home.iterdir() if p.name not in (".cache", ".config", ".ray")) == [], "state outside the known folders"
        status = subprocess.run([str(BIN / "eaglectl"), "targets", "status", "smollm2-135m", "--json"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["state"] == "ready" and report["outputs_match_plain"] is True, report
        assert sorted(report["jobs"]) == ["evaluating", "featurizing", "preparing", "training"]
        assert run.stdout.strip().splitlines()[-1].strip(), "the served reply is empty"
        assert f"evaluation: tau {report['tau']:.2f}" in run.stderr, log  # the onboarding printed the tau the registry holds
    finally:
        subprocess.run([*make, "down"], env=env, capture_output=True, text=True, timeout=300)
        down = stack("down", env, timeout=180)
    assert down.returncode == 0, down.stderr
    assert {name: port for name, port in {**ports, "platform": platform_port, "serve": serve_port}.items() if listening(port)} == {}


def test_a_direct_job_run_creates_a_private_token(tmp_path):
    """``init_ray`` (a job run without the stack) creates the token itself, readable by this user only."""
    env = fresh_env(dict(os.environ), tmp_path / "home")
    code = "from jobs.common import init_ray; init_ray(num_cpus=1); import ray; print(ray.get(ray.put(41)) + 1); ray.shutdown()"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "42", run.stderr[-3000:]
    token = Path(env["HOME"]) / ".ray" / "auth_token"
    assert _mode(token) == 0o600 and _mode(token.parent) == 0o700
