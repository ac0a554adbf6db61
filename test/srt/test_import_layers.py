"""The layering contract of pyproject.toml ([tool.importlinter]: imports point down) holds, and import-linter
reports a planted upward import (a copy of the package where a layer imports the scheduler)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "python", "sgl_jax")


def lint_imports(pythonpath: str) -> subprocess.CompletedProcess:
    """``lint-imports`` (import-linter's command) on the contract of the repository's pyproject.toml, with the
    package found first on `pythonpath`."""
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([exe, "--config", os.path.join(REPO, "pyproject.toml"), "--no-cache"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_imports_point_down():
    res = lint_imports(os.path.join(REPO, "python"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    copy = tmp_path / "sgl_jax"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    linear = copy / "srt" / "layers" / "linear.py"
    linear.write_text(linear.read_text() + "\nfrom sgl_jax.srt.scheduler import schedule_batch  # planted\n")
    res = lint_imports(str(tmp_path))
    assert res.returncode != 0
    assert "BROKEN" in res.stdout and "sgl_jax.srt.layers.linear -> sgl_jax.srt.scheduler.schedule_batch" in res.stdout
