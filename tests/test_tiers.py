"""tests/tiers.py: a test that starts end-to-end processes without the ``e2e`` marker fails, and so does a
fast-tier test whose call runs past ``EAGLE_TEST_BUDGET_S`` (a slow shared fixture does not count); the run
ends with the time of each tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import e2e_kind

HERE = Path(__file__).resolve().parent

PROBE = '''
import subprocess, sys, time
import pytest

def _job():
    subprocess.run([sys.executable, "-m", "jobs.a_job_that_does_not_exist"], capture_output=True)

def test_unmarked_job():
    _job()

@pytest.mark.e2e
def test_marked_job():
    _job()

def test_slow_fast_tier():
    time.sleep(1.0)  # the subject: a test slower than the budget

@pytest.mark.e2e
def test_slow_e2e():
    time.sleep(1.0)

@pytest.mark.e2e(isolated=True)
def test_isolated_e2e():
    pass

@pytest.mark.nightly
def test_slow_nightly():
    time.sleep(1.0)

def test_ordinary_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.fixture(scope="module")
def shared_and_slow():
    time.sleep(1.0)  # a shared fixture's cost (a model loaded once), not the test's

def test_fast_on_a_slow_shared_fixture(shared_and_slow):
    pass
'''


def test_e2e_processes_are_told_from_helpers():
    python = sys.executable
    e2e = {
        "Ray": [f"{Path(python).parent}/../lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--port=0"],
        "the local stack": ["bash", "/repo/infra/local/stack.sh", "up"],
        "a job": [python, "-m", "jobs.train_head", "--preset", "smoke"],
        "the platform service": [python, "-m", "eagle_platform.service", "--port", "1"],
        "Ray Serve": ["/venv/bin/serve", "deploy", "serve/config.yaml"],
        "vLLM": ["/repo/infra/bench/peers.sh", "vllm-serve", "/m", "8000"],
        "make": ["make", "-C", "/repo", "quickstart"],
    }
    for kind, argv in e2e.items():
        assert e2e_kind(argv) == kind, argv
    assert e2e_kind("ray start --head --port=0") == "Ray"
    for argv in (["bash", "/repo/infra/local/venv.sh"], [python, "-c", "print(1)"], ["chattr", "+i", "/x"],
                 [python, "-m", "eagle.cli", "generate"], ["git", "status"], [python, "-m", "pytest", "-q"],
                 [python, "-m", "eagle.cli", "head", "export", "--to", "vllm", "/h", "/v"]):
        assert e2e_kind(argv) is None, argv


@pytest.mark.parametrize("budget, workers", [("0.5", None), (None, None), ("0.5", "2")], ids=["budget", "no-budget", "xdist"])
def test_unmarked_e2e_work_and_slow_fast_tests_fail_with_their_names(tmp_path, budget, workers):
    """The same verdicts in one process and under pytest-xdist's ``--dist loadgroup`` (make test), where the e2e
    chain shares one worker, an isolated e2e test runs on the other, and the controller prints the tier times."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE_TEST_BUDGET_S", "EAGLE_NO_SKIP") and not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    if budget:
        env["EAGLE_TEST_BUDGET_S"] = budget
    xdist = ["-n", workers, "--dist", "loadgroup", "-vv"] if workers else []  # -q -vv: one line per test, with its worker
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tiers", "-p", "no:cacheprovider", "-rA", *xdist, str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    assert "test_unmarked_job: started a job without the e2e marker" in out, out[-3000:]
    failed = set(re.findall(r"^(?:FAILED|ERROR) \S+::(\w+)", out, flags=re.MULTILINE))
    assert failed == ({"test_unmarked_job", "test_slow_fast_tier"} if budget else {"test_unmarked_job"}), out[-3000:]
    if budget:
        assert "test_slow_fast_tier: ran 1 s, past the 0.5 s budget of a test outside the e2e and nightly tiers" in out, out[-3000:]
    assert "tier times: fast " in out and " e2e " in out and " nightly " in out, out[-3000:]
    if workers:
        ran_on = {name: worker for worker, name in re.findall(r"\[(gw\d+)\][^\n]*? (?:PASSED|FAILED|ERROR) \S+::(\w+)", out)}
        assert len(ran_on) == 8, out[-3000:]
        assert ran_on["test_marked_job"] == ran_on["test_slow_e2e"], ran_on  # the e2e chain: one worker
        assert ran_on["test_isolated_e2e"] != ran_on["test_marked_job"], ran_on  # an isolated one: beside it


def test_e2e_tests_are_collected_first(tmp_path):
    """The e2e tests come first (collection order otherwise kept), so that under ``--dist loadgroup`` the longest
    chain starts at once."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "tiers", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    order = re.findall(r"::(\w+)$", run.stdout, flags=re.MULTILINE)
    assert order == ["test_marked_job", "test_slow_e2e", "test_isolated_e2e", "test_unmarked_job", "test_slow_fast_tier", "test_slow_nightly",
                     "test_ordinary_process", "test_fast_on_a_slow_shared_fixture"], run.stdout
