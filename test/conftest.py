"""Shared test setup: CPU JAX, single-threaded torch (the reference must not fight the engine for cores)."""

import functools
import gc
import os
import pathlib
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # the test extra's reference (a missing test extra fails, never skips)

torch.set_num_threads(1)

# every run ends with the slowest test modules; --suite-report NAME.md writes them all (test/suite_durations.py)
from suite_durations import (pytest_addoption, pytest_runtest_logreport, pytest_sessionstart,  # noqa: E402,F401
                             pytest_terminal_summary)


# pytest-timeout: server tests run under the `timeout` of pyproject.toml (900 s: it covers a module's
# server start-up with a cold compile cache); these unit-test files get a short limit per test.
UNIT_TEST_TIMEOUT_S = 120
UNIT_TEST_FILES = ("test_detokenizer.py", "test_request_validation.py", "test_ragged_paged_attention.py",
                   "test_sampler.py", "test_tool_call_parser.py", "test_import_layers.py", "test_bench_sharding.py",
                   "test_gguf_gemma3.py", "test_program_cache.py", "test_kv_allocation.py")


# scripts/test.sh runs the suite on two pytest-xdist workers (`-n 2`) with the scheduler below: tests go out in
# groups, each wholly to one worker. A test's group is its module, so that a module's tests stay on one worker and
# its module-scoped server starts once; the modules that share a session-scoped server (SHARED_SERVERS, named
# anywhere in the module: some look them up with `request.getfixturevalue`) share one group, so that only one
# worker starts those servers (a server holds ~2.6 GB: a copy per worker ran a 24 GiB machine out of memory).
# Groups go out in collection order, longest first: the shared servers' group, then SLOW_MODULES_FIRST (the
# slow modules, longest first: reports/test-suite-cpu-2026-12-04c.md), so that no long group
# starts last while the other worker idles. (xdist's own `--dist loadgroup` does not group under pytest 9: it
# renames node ids through an attribute pytest 9 ignores.)
SHARED_SERVERS = ("default_server", "hardened_server", "shared_engine")
SHARED_GROUP = "shared-servers"
SLOW_MODULES_FIRST = ("test_speculative_serving.py", "test_quantization_accuracy.py", "test_quantization.py",
                      "test_kv_lifecycle_properties.py", "test_gemma3_270m.py", "test_swa_memory.py",
                      "test_kv_cache_dtype.py", "test_data_parallel.py", "test_moe_dp_ep_serving.py",
                      "test_engine.py", "test_runtime_install.py", "test_reliability.py", "test_moe_models.py",
                      "test_gemma3_270m_serving.py", "test_tensor_parallel.py", "test_kv_cache_lifecycle.py",
                      "test_lora.py", "test_bench_multi_item_score.py", "test_multi_host.py", "test_encoders.py",
                      "test_model_parity.py", "test_quantization_checkpoints.py", "test_rl_control.py",
                      "test_hicache.py")
ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _uses_shared_server(path: pathlib.Path) -> bool:
    return any(name in path.read_text() for name in SHARED_SERVERS)


def _group(module: str) -> str:
    """The group of the tests of `module` (a path relative to the repository root)."""
    return SHARED_GROUP if _uses_shared_server(ROOT / module) else module


def _group_order(item) -> tuple:
    name = item.path.name
    slow = SLOW_MODULES_FIRST.index(name) if name in SLOW_MODULES_FIRST else len(SLOW_MODULES_FIRST)
    return (not _uses_shared_server(item.path), slow)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler: LoadScopeScheduling with `_group` as the scope, the groups in collection order (not
    re-sorted by their number of tests, xdist's default)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


@pytest.hookimpl(trylast=True)  # (after the item's own fixtures are torn down)
def pytest_runtest_teardown(item, nextitem):
    """At the end of a group (and of the session) stop the shared servers its tests started
    (`srt_helpers.stop_shared_servers`: test/srt/conftest.py's session-wide servers), and free what the group's
    tests left in this process (the worker lives on for other groups)."""
    here = str(item.path.relative_to(ROOT))
    if nextitem is not None and _group(here) == _group(str(nextitem.path.relative_to(ROOT))):
        return
    helpers = sys.modules.get("srt_helpers")
    if helpers is not None:
        helpers.stop_shared_servers()
    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def pytest_collection_modifyitems(config, items):
    items.sort(key=_group_order)  # stable: the order inside a module is kept
    for item in items:
        path = item.path
        is_unit = path.parent.name == "mem_cache" or path.name in UNIT_TEST_FILES
        if is_unit and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TEST_TIMEOUT_S))
