"""A pytest plugin (loaded by conftest.py): with ``EAGLE_NO_SKIP=1`` (``make test`` sets it) a skipped test
fails instead, so a broken install (ray, mlflow or moto missing, a folder that cannot be locked) cannot pass
CI as a column of skips. ``xfail`` is untouched; ``-m``/``-k`` deselection is not a skip."""

from __future__ import annotations

import os

import pytest


def _strict() -> bool:
    return os.environ.get("EAGLE_NO_SKIP") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _strict() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under EAGLE_NO_SKIP=1 (make test), which counts as a failure: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _strict() and report.skipped:  # a module-level importorskip
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under EAGLE_NO_SKIP=1 (make test), which counts as a failure: {reason}"
