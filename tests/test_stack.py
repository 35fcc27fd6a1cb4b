"""infra/local/stack.sh end to end on free ports: up (Ray head + MLflow), up again, status, a `ray job submit`
with token authentication that runs on this stack's Ray though a second stack started after it on the same
host, down; afterwards nothing it started is left listening."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import pytest

from stack_helpers import BIN, ROOT, client_env, listening, stack, stack_env

pytestmark = [pytest.mark.e2e, pytest.mark.nightly]  # the stack itself runs under test_platform and test_fresh_machine in make test


def test_stack_up_status_submit_down(tmp_path):
    env, ports = stack_env(tmp_path / "stack")
    mlflow_uri = f"http://127.0.0.1:{ports['MLFLOW_PORT']}"
    other_up = None
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

        # A second stack on this host, started later. Ray's job supervisor gives a job driver the address it reads
        # from its temp dir's ray_current_cluster: with one temp dir for both heads, that names the later one.
        other_env, other_ports = stack_env(tmp_path / "other")  # after `up`: this stack's ports are taken now
        other_up = stack("up", other_env)
        assert other_up.returncode == 0, other_up.stderr

        job_env = client_env(env, tmp_path / "stack")
        # a job reaches the authenticated MLflow with the credentials the Ray head passes it (not the password),
        # and the Ray it was submitted to
        probe = ("import os, eagle, jobs; from eagle_platform.registry import Runs; "
                 "print('job-ok', Runs().get_or_create_experiment('stack-test'), 'ray-address', os.environ['RAY_ADDRESS'])")
        job = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--working-dir", str(ROOT), "--", "python", "-c", probe],
            env={k: v for k, v in job_env.items() if not k.startswith(("MLFLOW_TRACKING", "EAGLE_MLFLOW"))},
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert job.returncode == 0 and "job-ok" in job.stdout, job.stdout[-2000:] + job.stderr[-2000:]
        address = re.search(r"ray-address ([\w.-]+:\d+)", job.stdout).group(1)  # the output, not the echoed command
        assert address.endswith(f":{ports['RAY_PORT']}"), (address, ports["RAY_PORT"], other_ports["RAY_PORT"])
        _assert_registry_writes_need_credentials(mlflow_uri, tmp_path / "stack", job_env)
    finally:
        down = stack("down", env, timeout=120)
        if other_up is not None:
            other_down = stack("down", other_env, timeout=120)
            assert other_down.returncode == 0, other_down.stderr
    assert down.returncode == 0, down.stderr
    still_open = {name: port for name, port in ports.items() if listening(port)}
    assert still_open == {}, f"still listening after down: {still_open}"
    assert not (tmp_path / "stack" / "ray-head.env").exists() and not (tmp_path / "stack" / "mlflow.pid").exists()
    status = stack("status", env, timeout=60)
    assert status.returncode == 1 and "mlflow: down" in status.stdout and "ray: down" in status.stdout


def _assert_registry_writes_need_credentials(uri: str, state_dir, job_env: dict) -> None:
    """Issue 13: the stack's MLflow answers 401 without the stack's credentials (so nobody else on the
    machine can move @production) and works with them; the password file is 0600 in a 0700 folder."""
    import base64
    import json
    import stat
    import urllib.error
    import urllib.request

    password_file = state_dir / "auth" / "mlflow-password"
    assert job_env["EAGLE_MLFLOW_PASSWORD_FILE"] == str(password_file)
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(password_file.parent.stat().st_mode) == 0o700

    def call(path: str, body: dict, auth: tuple[str, str] | None) -> int:
        request = urllib.request.Request(f"{uri}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"content-type": "application/json"})
        if auth:
            request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as err:
            return err.code

    password = password_file.read_text().strip()
    assert call("registered-models/create", {"name": "stack-test-eagle"}, None) == 401
    assert call("registered-models/create", {"name": "stack-test-eagle"}, ("eagle-admin", "wrong")) == 401
    assert call("registered-models/create", {"name": "stack-test-eagle"}, ("eagle-admin", password)) == 200
    body = {"name": "stack-test-eagle", "alias": "production", "version": "1"}
    assert call("registered-models/alias", body, None) == 401  # moving @production needs the credentials

    script = ("import sys; from eagle_platform.registry import Registry, RegistryError\n"
              "try:\n    Registry().models()\nexcept RegistryError as err:\n    print(err); sys.exit(2)\nprint('ok')")
    anonymous = {k: v for k, v in job_env.items() if k not in ("MLFLOW_TRACKING_USERNAME", "EAGLE_MLFLOW_PASSWORD_FILE", "MLFLOW_TRACKING_PASSWORD")}
    refused = subprocess.run([sys.executable, "-c", script], env=anonymous, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "refused a request without credentials" in refused.stdout, refused.stdout + refused.stderr
    allowed = subprocess.run([sys.executable, "-c", script], env=job_env, capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0 and "ok" in allowed.stdout, allowed.stdout + allowed.stderr
