"""The contracts of pyproject.toml ([tool.importlinter]: imports point down; the batch descriptions and the KV
bookkeeping are JAX-free) hold, and import-linter reports a planted fault against each (a copy of the package
where a layer imports the scheduler, or the shape buckets import jax)."""

from __future__ import annotations

import ast
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


def lint_planted(tmp_path, module: str, line: str) -> subprocess.CompletedProcess:
    """`lint_imports` on a copy of the package where `module` (a path under sgl_jax/) ends with `line`."""
    copy = tmp_path / "sgl_jax"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    planted = copy / module
    planted.write_text(planted.read_text() + f"\n{line}  # planted\n")
    return lint_imports(str(tmp_path))


def test_an_upward_import_breaks_the_contract(tmp_path):
    res = lint_planted(tmp_path, "srt/layers/linear.py", "from sgl_jax.srt.scheduler import schedule_batch")
    assert res.returncode != 0
    assert "BROKEN" in res.stdout and "sgl_jax.srt.layers.linear -> sgl_jax.srt.scheduler.schedule_batch" in res.stdout


def test_an_import_of_jax_in_a_batch_description_breaks_the_contract(tmp_path):
    res = lint_planted(tmp_path, "srt/model_executor/buckets.py", "import jax")
    assert res.returncode != 0
    assert "JAX-free" in res.stdout and "BROKEN" in res.stdout
    assert "sgl_jax.srt.model_executor.buckets -> jax" in res.stdout, res.stdout


JAX_FREE = ["sgl_jax.srt.scheduler.schedule_batch", "sgl_jax.srt.forward_batch",
            "sgl_jax.srt.sampling.sampling_batch", "sgl_jax.srt.model_executor.buckets",
            "sgl_jax.srt.mem_cache.kv_memory"]


def modules_loaded(imports: str, watched) -> list:
    """The `watched` module names that a fresh interpreter has loaded after running `imports` (Python source),
    with the repository's package first on the path."""
    code = f"import sys\n{imports}\nprint(sorted(m for m in {tuple(watched)!r} if m in sys.modules))\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.join(REPO, "python")})
    assert res.returncode == 0, res.stderr
    return ast.literal_eval(res.stdout)


def test_the_batch_descriptions_load_without_jax():
    """What the contract cannot see: importing them runs their packages' __init__ too, and none loads JAX."""
    imports = "import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in JAX_FREE)
    assert modules_loaded(imports, ("jax", "jaxlib", "flax")) == []


# what the HTTP process loads and the other processes must not
HTTP_ONLY = ("fastapi", "uvicorn", "sgl_jax.srt.entrypoints.http_server", "sgl_jax.srt.tokenizer.tokenizer_manager")


def test_the_server_entry_module_loads_nothing_at_import():
    """The scheduler and detokenizer processes are spawned, and a spawned child imports the parent's ``__main__``
    module (``sgl_jax.launch_server``) before it runs: importing it must not load the HTTP side (at the top, FastAPI,
    the routes and their protocol models cost each child ~1 s of a start-up on a 2-core CPU)."""
    assert modules_loaded("import sgl_jax.launch_server", HTTP_ONLY + ("jax", "transformers")) == []


def test_the_http_and_detokenizer_processes_load_no_jax_and_no_float8_types():
    """The HTTP process's and the detokenizer's modules load neither JAX nor ml_dtypes (its import alone takes
    ~0.75 s on a 2-core CPU, in each process that starts beside the scheduler's compiles): quantization methods name
    their float8 weight type and import ml_dtypes only when a weight is built."""
    imports = "import sgl_jax.srt.entrypoints.http_server, sgl_jax.srt.tokenizer.detokenizer_manager"
    assert modules_loaded(imports, ("jax", "jaxlib", "flax", "ml_dtypes")) == []
