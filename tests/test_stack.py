"""infra/local/stack.sh end to end on free ports: up (Ray head + MLflow), up again, status, a `ray job submit`
with token authentication, down; afterwards nothing it started is left listening."""

from __future__ import annotations

import subprocess
import urllib.request

import pytest

from stack_helpers import BIN, ROOT, client_env, listening, stack, stack_env

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (BIN / "ray").is_file() or not (BIN / "mlflow").is_file(), reason="needs ray and mlflow in the venv")
def test_stack_up_status_submit_down(tmp_path):
    env, ports = stack_env(tmp_path / "stack")
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

        job_env = client_env(env, tmp_path / "stack")
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
