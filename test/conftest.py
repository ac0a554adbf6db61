"""Shared test setup: CPU JAX, single-threaded torch (the reference must not fight the engine for cores)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # the test extra's reference (a missing test extra fails, never skips)

torch.set_num_threads(1)


# pytest-timeout: server tests run under the `timeout` of pyproject.toml (900 s: it covers a module's
# server start-up with a cold compile cache); these unit-test files get a short limit per test.
UNIT_TEST_TIMEOUT_S = 120
UNIT_TEST_FILES = ("test_detokenizer.py", "test_request_validation.py", "test_ragged_paged_attention.py",
                   "test_sampler.py", "test_tool_call_parser.py", "test_import_layers.py", "test_bench_sharding.py", "test_gguf_gemma3.py")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        path = item.path
        is_unit = path.parent.name == "mem_cache" or path.name in UNIT_TEST_FILES
        if is_unit and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TEST_TIMEOUT_S))
