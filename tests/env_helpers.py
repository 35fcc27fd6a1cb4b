"""``temporary_env``: environment variables set for the length of a block, then put back as they were."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def temporary_env(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


SPECULATORS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".speculators")


def speculators_env() -> dict[str, str]:
    """The environment of a subprocess that imports speculators: `make install` puts it (and the two packages it
    imports at load time) in .speculators beside the venv, without its dependencies (it pins transformers <=
    5.19; this project runs 5.24), so it can never change what the venv resolves."""
    if not os.path.isdir(os.path.join(SPECULATORS_DIR, "speculators")):
        raise AssertionError(f"{SPECULATORS_DIR} has no speculators: run `make install`")
    return {**os.environ, "PYTHONPATH": SPECULATORS_DIR}
