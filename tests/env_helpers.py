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
