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

Under pytest-xdist (the Makefile runs ``-n <cores> --dist loadgroup``) the e2e tests form one work unit, run
first and one after another by one worker, while the other workers run the in-process tier beside them
(``pytest_xdist_make_scheduler``); each worker gets an equal share of the cores' torch threads (conftest.py).
A module marked ``e2e(isolated=True)`` (its own HOME, state folder and free ports: nothing it starts can meet
another test's processes) is a work unit of its own, so another worker can run it beside that chain.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

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
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):  # an xdist controller
        os.environ[_E2E_LISTING] = str(Path(tempfile.mkdtemp(prefix="eagle-tiers-")) / "e2e")  # the workers inherit it
    config.addinivalue_line("markers", "e2e(isolated=False): starts Ray, the local stack, Ray Serve, vLLM, the platform service or a "
                            "job subprocess; isolated=True: on a HOME, state folder and ports of its own, so it may run beside other e2e tests")
    config.addinivalue_line("markers", "nightly: only `make test-all` runs it (`make test` deselects it)")
    original = subprocess.Popen.__init__
    if getattr(original, "_eagle_tiers", False):
        return

    def recording_init(self, args, *a, **kw):
        _LAUNCHED.append(args)
        original(self, args, *a, **kw)

    recording_init._eagle_tiers = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = recording_init  # type: ignore[method-assign]


_CALL_SECONDS = pytest.StashKey[float]()
_FIRST_LAUNCH = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CALL_SECONDS] = 0.0
    item.stash[_FIRST_LAUNCH] = len(_LAUNCHED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call":
        item.stash[_CALL_SECONDS] = call.duration
    if call.when != "teardown":
        return
    name = tier(item)
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The e2e tests go first (otherwise the collection order is kept). Under pytest-xdist a worker also writes
    their node ids where the controller's scheduler (``pytest_xdist_make_scheduler``) reads them."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)  # stable
    listing = os.environ.get(_E2E_LISTING)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if listing and worker:
        staged = Path(f"{listing}.{worker}")
        staged.write_text("".join(f"{unit}\t{item.nodeid}\n" for item in items if (unit := _e2e_unit(item))))
        staged.replace(f"{listing}.{worker}.done")


_E2E_LISTING = "EAGLE_TIERS_E2E_LISTING"  # the file (prefix) the workers list the e2e node ids in, with their units


def _e2e_unit(item: pytest.Item) -> str | None:
    """The xdist work unit of an e2e test: ``e2e`` (the chain one worker runs), or for an isolated one
    ``e2e:<module>``; None outside the e2e tier."""
    marker = item.get_closest_marker("e2e")
    if marker is None:
        return None
    return f"e2e:{item.nodeid.split('::', 1)[0]}" if marker.kwargs.get("isolated") else "e2e"


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadgroup`` (``make test``): the e2e tests are one work unit, so one worker runs them one
    after another and first (each starts Ray, Serve or a stack sized for the whole machine), while the other
    workers run the in-process tier beside them. An isolated e2e module is a unit of its own: xdist hands out the
    units with the most tests first, so the second worker starts on it (the longest single test, the fresh-machine
    quickstart) beside the chain, and both then share the in-process tests. pytest-xdist's own ``xdist_group``
    marker cannot say this with pytest 9 (xdist 3.8 renames a grouped test's ``_nodeid``, which pytest 9 no
    longer reads), so the units are made here, from the node ids the workers list at collection."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    listing = os.environ[_E2E_LISTING]

    class E2EUnits(LoadGroupScheduling):
        _e2e: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._e2e is None:  # scopes are split once every worker has collected (and listed)
                lists = sorted(Path(listing).parent.glob(Path(listing).name + ".*.done"))
                assert lists, f"no worker listed its e2e tests under {listing}"
                self._e2e = {test: unit for unit, _, test in (line.partition("\t") for line in lists[0].read_text().splitlines())}
            return self._e2e.get(nodeid) or super()._split_scope(nodeid)

    return E2EUnits(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    listing = os.environ.get(_E2E_LISTING)
    if listing and not os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "numprocesses", None):
        shutil.rmtree(Path(listing).parent, ignore_errors=True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's set-up, call and teardown, summed per tier. This runs where the reports arrive: in the one
    process, or under pytest-xdist in the controller, whose terminal prints the summary."""
    keywords = report.keywords
    _TIER_SECONDS["nightly" if "nightly" in keywords else "e2e" if "e2e" in keywords else "fast"] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TIER_SECONDS:
        return
    parts = ", ".join(f"{name} {_TIER_SECONDS[name] / 60:.1f} min" for name in ("fast", "e2e", "nightly") if name in _TIER_SECONDS)
    terminalreporter.write_line(f"tier times: {parts} (summed per test; the whole run {(time.monotonic() - _STARTED) / 60:.1f} min)")
