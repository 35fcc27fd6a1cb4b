"""infra/local/venv.sh, which stack.sh, serve.sh and pipeline.sh source: from a plain shell (no venv on PATH)
their bare ``python`` and ``ray`` must be the project's, and a caller's own active venv must be left first."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"


def _resolve(path: str) -> list[str]:
    script = f'REPO_ROOT={ROOT}; source infra/local/venv.sh; command -v python; command -v ray || echo none'
    out = subprocess.run(["/bin/bash", "-c", script], cwd=ROOT, env={"PATH": path, "HOME": "/nonexistent"},
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()


def _fake_bin(tmp_path: Path, *names: str) -> Path:
    """A folder of do-nothing executables named ``names``, to put first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in names:
        tool = folder / name
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    return folder


def test_a_plain_shell_gets_the_projects_python_and_ray():
    assert (VENV_BIN / "ray").exists(), "make install builds .venv"
    assert _resolve("/usr/local/bin:/usr/bin:/bin") == [str(VENV_BIN / "python"), str(VENV_BIN / "ray")]


def test_an_active_venv_with_ray_and_mlflow_stays_first(tmp_path):
    other = _fake_bin(tmp_path, "python", "ray", "mlflow")
    assert _resolve(f"{other}:/usr/bin:/bin") == [str(other / "python"), str(other / "ray")]


def test_a_python_without_ray_beside_it_is_replaced(tmp_path):
    other = _fake_bin(tmp_path, "python")
    assert _resolve(f"{other}:/usr/bin:/bin") == [str(VENV_BIN / "python"), str(VENV_BIN / "ray")]
