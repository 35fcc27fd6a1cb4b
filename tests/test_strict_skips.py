"""tests/strict_skips.py: under EAGLE_NO_SKIP=1 a skip (in a test, a skipif marker, a module-level
importorskip) fails the run; without it the same tests skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

PROBE = '''
import pytest

def test_runtime_skip():
    pytest.skip("no moto here")

@pytest.mark.skipif(True, reason="no ray here")
def test_marker_skip():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail_is_untouched():
    assert False
'''

MODULE_SKIP = '''
import pytest
pytest.importorskip("a_module_that_is_not_installed")

def test_never_collected():
    pass
'''


def _pytest(path: Path, strict: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE_NO_SKIP"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    if strict:
        env["EAGLE_NO_SKIP"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "strict_skips", "-p", "no:cacheprovider", str(path)],
                          cwd=path.parent, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("strict", [True, False])
def test_skips_fail_only_under_make_test(tmp_path, strict):
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    tests, module = _pytest(tmp_path / "test_probe.py", strict), _pytest(tmp_path / "test_module_skip.py", strict)
    if strict:
        assert tests.returncode == 1 and "skipped" not in tests.stdout.splitlines()[-1] and "1 xfailed" in tests.stdout, tests.stdout[-2000:]
        assert "counts as a failure: Skipped: no moto here" in tests.stdout and "counts as a failure: Skipped: no ray here" in tests.stdout
        assert module.returncode != 0 and "counts as a failure" in module.stdout, module.stdout[-2000:]
    else:
        assert tests.returncode == 0 and "2 skipped" in tests.stdout and "1 xfailed" in tests.stdout, tests.stdout[-2000:]
        assert module.returncode in (0, 5) and "1 skipped" in module.stdout, module.stdout[-2000:]  # 5: nothing else collected
