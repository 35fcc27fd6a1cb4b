"""The Ray cluster token of this machine: where it lives, and creating it on a machine that has none.

Ray 2.60 turns token authentication on: ``ray start --head`` in token mode refuses to start without a token
("Token authentication is enabled but no authentication token was found"), and a local ``ray.init()``
writes one itself, world-readable (mode 0644 under the default umask) and always at ``~/.ray/auth_token``,
whatever ``RAY_AUTH_TOKEN_PATH`` says (``ray/_private/authentication/authentication_token_setup.py``).
This module is the one place that decides the path and creates the token, so every path of the platform
(``infra/local/stack.sh``, the jobs' private Ray instances, the tests) agrees on it:

* ``RAY_AUTH_TOKEN`` set: the token is in the environment; nothing is read or written.
* otherwise the file ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token`` (Ray's own lookup order);
  created when missing with 64 hex characters (as Ray's ``generate_new_authentication_token``), mode 0600
  in a folder created 0700; an existing file readable by group or others is tightened to 0600.

``python -m eagle_platform.ray_token`` ensures the token and prints one line saying what it did;
``read_token`` is what HTTP clients of the dashboard send (``eagle_platform.rollout``).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


@dataclass(frozen=True)
class TokenState:
    """What ``ensure_token`` found or did: ``path`` is None when the token comes from ``RAY_AUTH_TOKEN``."""

    path: Path | None
    created: bool = False
    tightened: bool = False

    def describe(self) -> str:
        if self.path is None:
            return f"ray token: from ${TOKEN_ENV}"
        if self.created:
            return f"ray token: created {self.path} (mode 0600)"
        if self.tightened:
            return f"ray token: {self.path} was readable by others; now mode 0600"
        return f"ray token: using {self.path}"


def token_path() -> Path:
    """The token file Ray's clients and servers read: ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``."""
    configured = os.environ.get(TOKEN_PATH_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".ray" / "auth_token"


def read_token() -> str | None:
    """The token a client sends (``Authorization: Bearer <token>``): ``$RAY_AUTH_TOKEN``, else the token
    file's content; None when there is neither (a cluster without token authentication)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    try:
        return token_path().read_text().strip() or None
    except FileNotFoundError:
        return None


def ensure_secret_file(path: Path) -> TokenState:
    """Make sure ``path`` holds a secret readable by this user only: created when missing (64 hex characters,
    mode 0600, its folder 0700), tightened to 0600 when group or others could read it. The one place that
    writes secret files: the Ray token here, the platform service's API token and webhook secret."""
    if path.is_file():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            path.chmod(0o600)
            return TokenState(path, tightened=True)
        return TokenState(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it in between: use theirs
        return TokenState(path)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
        handle.flush()
        os.fsync(handle.fileno())
    logger.info("created %s (mode 0600)", path)
    return TokenState(path, created=True)


def ensure_token() -> TokenState:
    """Make sure a token exists where Ray looks for it, readable by this user only."""
    if os.environ.get(TOKEN_ENV):
        return TokenState(None)
    return ensure_secret_file(token_path())


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle_platform.ray_token``: make the Ray token; ``--secret PATH``: make that secret file
    instead (infra/local/stack.sh: the MLflow admin password and the MLflow server's session key)."""
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[1]) if len(argv) == 2 and argv[0] == "--secret" else None
    if argv and path is None:
        sys.stderr.write("usage: python -m eagle_platform.ray_token [--secret PATH]\n")
        return 2
    try:
        state = ensure_secret_file(path) if path is not None else ensure_token()
    except OSError as err:
        sys.stderr.write(f"ray token: error: cannot create {path or token_path()}: {err.strerror or err}\n")
        return 2
    sys.stdout.write(state.describe() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
