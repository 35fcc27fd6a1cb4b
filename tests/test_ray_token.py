"""eagle_platform.ray_token: the path Ray reads, a token created 0600 when missing, an open one tightened, the
token a client sends."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from eagle_platform.ray_token import TOKEN_ENV, TOKEN_PATH_ENV, ensure_token, read_token, token_path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_creates_a_private_token_at_the_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(TOKEN_PATH_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    state = ensure_token()
    path = tmp_path / ".ray" / "auth_token"
    assert state.path == path == token_path() and state.created
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    again = ensure_token()  # the second call keeps the token it finds
    assert not again.created and not again.tightened and path.read_text() == token


def test_honours_ray_auth_token_path(tmp_path, monkeypatch):
    path = tmp_path / "nested" / "dir" / "token"
    monkeypatch.setenv(TOKEN_PATH_ENV, str(path))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    state = ensure_token()
    assert state.created and state.path == path and _mode(path) == 0o600
    assert state.describe() == f"ray token: created {path} (mode 0600)"


def test_tightens_a_world_readable_token(tmp_path, monkeypatch):
    path = tmp_path / "auth_token"
    path.write_text("a" * 64)
    path.chmod(0o644)
    monkeypatch.setenv(TOKEN_PATH_ENV, str(path))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    state = ensure_token()
    assert state.tightened and not state.created and _mode(path) == 0o600 and path.read_text() == "a" * 64


def test_a_token_in_the_environment_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(TOKEN_PATH_ENV, raising=False)
    monkeypatch.setenv(TOKEN_ENV, "b" * 64)
    assert ensure_token().path is None
    assert not (tmp_path / ".ray").exists()


def test_command_line_reports_in_one_line(tmp_path):
    path = tmp_path / "t"
    env = {"HOME": str(tmp_path), TOKEN_PATH_ENV: str(path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "eagle_platform.ray_token"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == f"ray token: created {path} (mode 0600)\n"
    blocked = tmp_path / "file"
    blocked.write_text("")
    env[TOKEN_PATH_ENV] = str(blocked / "token")  # its parent is a file: cannot be created
    out = subprocess.run([sys.executable, "-m", "eagle_platform.ray_token"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("ray token: error: cannot create")


def test_read_token_prefers_the_environment_then_the_file_and_is_none_without_either(tmp_path, monkeypatch):
    path = tmp_path / "token"
    monkeypatch.setenv(TOKEN_PATH_ENV, str(path))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert read_token() is None
    path.write_text("ab" * 32 + "\n")
    assert read_token() == "ab" * 32
    monkeypatch.setenv(TOKEN_ENV, "cd" * 32)
    assert read_token() == "cd" * 32
