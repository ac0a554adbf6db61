"""test/suite_durations.py on a small synthetic suite run by pytest in a subprocess (on two xdist workers, as
scripts/test.sh runs the real one, a module wholly on one worker): each module's time is its phases' sum, set-up
(a slow fixture) included, and the printed slowest modules and the --suite-report files agree with it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

TEST_DIR = pathlib.Path(__file__).resolve().parent.parent

SLOW = '''
import time, pytest

@pytest.fixture(scope="module")
def server():
    time.sleep(1.2)  # a module's server start-up
    yield
    time.sleep(0.4)

def test_a(server):
    time.sleep(0.3)

def test_b(server):
    pass
'''
FAST = '''
import pytest

def test_c():
    pass

@pytest.mark.skip(reason="planted")
def test_d():
    pass

def test_e():
    assert False
'''


def test_module_times_and_report(tmp_path):
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TEST_DIR)!r})\n"
                                          "from suite_durations import *  # noqa\n")
    (tmp_path / "test_slow.py").write_text(SLOW)
    (tmp_path / "test_fast.py").write_text(FAST)
    report = tmp_path / "out" / "suite.md"
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # (only xdist: the installed plugins load slowly)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist.plugin", "-n", "2", "--dist",
                          "loadfile", "-p", "no:cacheprovider", "--rootdir",
                          str(tmp_path), "-c", "/dev/null", "--suite-report", str(report), str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr  # (test_e fails)
    raw = json.loads(report.with_suffix(".json").read_text())
    mods = {m["module"]: m for m in raw["modules"]}
    slow, fast = mods["test_slow.py"], mods["test_fast.py"]
    assert 1.1 <= slow["setup_s"] <= 2 and 0.25 <= slow["call_s"] <= 2 and 0.35 <= slow["teardown_s"] <= 2, slow
    assert abs(slow["total_s"] - slow["setup_s"] - slow["call_s"] - slow["teardown_s"]) < 1e-9
    assert slow["tests"] == 2 and fast["tests"] == 3 and fast["total_s"] < slow["total_s"]
    assert [m["module"] for m in raw["modules"]] == ["test_slow.py", "test_fast.py"]
    assert raw["outcomes"] == {"passed": 3, "failed": 1, "skipped": 1} and raw["exit_status"] == 1
    assert raw["xdist_workers"] == 2 and raw["wall_s"] >= slow["total_s"] / 2
    assert "slowest test modules" in run.stdout
    line = next(ln for ln in run.stdout.splitlines() if ln.strip().endswith("(set-up "
                f"{slow['setup_s']:.1f}, call {slow['call_s']:.1f}, teardown {slow['teardown_s']:.1f}; 2 tests)"))
    assert f"{slow['total_s']:.1f} s  test_slow.py" in line
    md = report.read_text()
    assert f"| test_slow.py | {slow['total_s']:.1f} |" in md and "--suite-report" in md and "not edited" in md
