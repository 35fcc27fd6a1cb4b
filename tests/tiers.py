"""A pytest plugin (loaded by conftest.py) that keeps the suite's tiers honest.

The tiers (markers registered here; the Makefile's targets select them):

* ``e2e``: the test starts Ray, the local stack, Ray Serve, vLLM, the platform service or a job subprocess;
* ``nightly``: only ``make test-all`` runs it (``make test`` is ``-m "not nightly"``);
* neither: an in-process test, the fast tier.

Two rules are enforced here rather than remembered:

1. **A marker is true.** Every process a test starts (``subprocess.Popen``, which Ray, Serve, the stack
   scripts and every job launch go through) is recorded; a test without the ``e2e`` marker that started
   one of the kinds above fails at teardown, naming what it started.
2. **The fast tier stays fast.** With ``EAGLE_TEST_BUDGET_S`` set (``make test`` and ``make test-all`` set
   it to 120), a test outside the ``e2e`` and ``nightly`` tiers whose call ran longer fails at teardown with
   its time. The call alone: set-up and teardown hold the module- and session-scoped fixtures other tests
   share (SmolLM2 dequantized into an empty cache on a new machine, an MLflow server), which would land on
   whichever test happens to come first. The tier times below count all three phases.

At the end of the run the wall time of each tier is printed (``tier times:``), which ``.ci/run`` shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections import defaultdict

import pytest

# What marks a started process as end-to-end work. Matched against the process's argv joined by spaces.
E2E_PROCESSES = {
    "Ray": re.compile(r"/ray/core/src/ray/|\bray(\.exe)? start\b|/ray/_private/|/ray/dashboard/"),
    "the local stack": re.compile(r"infra/local/(stack|platform|serve|pipeline)\.sh"),
    "the platform service": re.compile(r"-m eagle_platform\.service\b"),
    "a job": re.compile(r"-m jobs\.\w+"),
    "Ray Serve": re.compile(r"(^|/)serve (deploy|run|start|shutdown|status)\b"),
    "vLLM": re.compile(r"peers\.sh|vllm\.entrypoints|-m vllm\b|/venvs/vllm-"),
    "make": re.compile(r"(^|/)make( |$)"),
}

_LAUNCHED: list[str] = []
_TIER_SECONDS: dict[str, float] = defaultdict(float)
_STARTED = time.monotonic()


def e2e_kind(argv) -> str | None:
    """Which e2e kind of process ``argv`` starts, or None for an ordinary helper process."""
    text = os.fsdecode(argv) if isinstance(argv, (str, bytes, os.PathLike)) else " ".join(os.fsdecode(a) for a in argv)
    return next((kind for kind, pattern in E2E_PROCESSES.items() if pattern.search(text)), None)


def tier(item: pytest.Item) -> str:
    if item.get_closest_marker("nightly"):
        return "nightly"
    return "e2e" if item.get_closest_marker("e2e") else "fast"


def _budget_s() -> float | None:
    value = os.environ.get("EAGLE_TEST_BUDGET_S")
    return float(value) if value else None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts Ray, the local stack, Ray Serve, vLLM, the platform service or a job subprocess")
    config.addinivalue_line("markers", "nightly: only `make test-all` runs it (`make test` deselects it)")
    original = subprocess.Popen.__init__
    if getattr(original, "_eagle_tiers", False):
        return

    def recording_init(self, args, *a, **kw):
        _LAUNCHED.append(args)
        original(self, args, *a, **kw)

    recording_init._eagle_tiers = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = recording_init  # type: ignore[method-assign]


_SECONDS = pytest.StashKey[float]()
_CALL_SECONDS = pytest.StashKey[float]()
_FIRST_LAUNCH = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_SECONDS] = item.stash[_CALL_SECONDS] = 0.0
    item.stash[_FIRST_LAUNCH] = len(_LAUNCHED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    item.stash[_SECONDS] = item.stash.get(_SECONDS, 0.0) + call.duration
    if call.when == "call":
        item.stash[_CALL_SECONDS] = call.duration
    if call.when != "teardown":
        return
    seconds = item.stash[_SECONDS]
    name = tier(item)
    _TIER_SECONDS[name] += seconds
    if report.failed:
        return
    problems = []
    if not item.get_closest_marker("e2e"):
        started = sorted({kind for argv in _LAUNCHED[item.stash.get(_FIRST_LAUNCH, 0):] if (kind := e2e_kind(argv))})
        if started:
            problems.append(f"started {', '.join(started)} without the e2e marker (tests/tiers.py): mark it e2e")
    budget = _budget_s()
    called = item.stash.get(_CALL_SECONDS, 0.0)
    if budget is not None and name == "fast" and called > budget:
        problems.append(f"ran {called:.0f} s, past the {budget:g} s budget of a test outside the e2e and nightly tiers "
                        "(tests/tiers.py): make it cheaper, or mark it for the tier it belongs to")
    if problems:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: " + "; ".join(problems)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TIER_SECONDS:
        return
    parts = ", ".join(f"{name} {_TIER_SECONDS[name] / 60:.1f} min" for name in ("fast", "e2e", "nightly") if name in _TIER_SECONDS)
    terminalreporter.write_line(f"tier times: {parts} (summed per test; the whole run {(time.monotonic() - _STARTED) / 60:.1f} min)")
