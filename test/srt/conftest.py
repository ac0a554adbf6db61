import pytest

from srt_helpers import load_hf_reference


@pytest.fixture(scope="session")
def hf_smollm2():
    """The transformers reference for SmolLM2 (float32), loaded once per session."""
    return load_hf_reference()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from sgl_jax.srt.configs.model_config import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None).hf_dir)


# The shared servers below (default_server, hardened_server, shared_engine) start on first use and run until the
# end of the group of modules that use them (test/conftest.py: those modules run one after the other, on one
# worker), then stop with their checks (`srt_helpers.stop_shared_servers`), so that they hold no memory while the
# rest of the suite runs.


@pytest.fixture(scope="session")
def shared_engine():
    """One in-process Engine (srt_helpers.SHARED_ENGINE_ARGS), shared by test_engine.py and test_score.py: an
    Engine start costs ~25 s on a 2-core CPU. When it stops it must be clean, and leaving its context manager must
    stop both of its child processes (`srt_helpers.checked_engine`)."""
    from srt_helpers import SHARED_ENGINE_ARGS, checked_engine, shared_server

    def start():
        engine = checked_engine(**SHARED_ENGINE_ARGS)
        return engine.__enter__(), lambda: engine.__exit__(None, None, None)

    return shared_server("shared_engine", start)


@pytest.fixture(scope="session")
def scoring_delimiter(smollm2_tokenizer):
    """The token id of a newline: hardened_server's --multi-item-scoring-delimiter."""
    return smollm2_tokenizer.encode("\n", add_special_tokens=False)[0]


@pytest.fixture(scope="session")
def hardened_server(scoring_delimiter):
    """A server as an operator would expose it -- API key and admin key set, scoring cache on, a multi-item
    scoring delimiter (at most 64 items a request), Prometheus metrics on, a --served-model-name, CORS for one
    origin (ALLOWED_ORIGIN), /v1/rerank with Qwen3-Reranker's template -- with the fault-injection test hook on
    (requests whose rid starts with ``fault-<stage>`` fail at that stage) and max_running_requests 8 (so 32
    concurrent requests are 4x what it runs at once). Shared by test_bad_requests.py, test_bad_requests_fuzz.py,
    test_api_surfaces.py, test_anthropic_api.py, test_rerank.py, test_metrics_and_tokenize.py (whose metric checks
    look at differences, not at a fresh server's counters) and test_score.py's HTTP tests."""
    from srt_helpers import (ADMIN_API_KEY, ALLOWED_ORIGIN, API_KEY, SERVED_MODEL_NAME, SMALL_ENGINE_ARGS,
                             ServerProcess, shared_server)

    def start():
        s = ServerProcess(env={"SGL_JAX_TEST_FAULT_INJECTION": "1"},
                          engine_args={**SMALL_ENGINE_ARGS, "max_running_requests": 8, "enable_scoring_cache": True,
                                       "multi_item_scoring_delimiter": scoring_delimiter, "max_multi_item_count": 64,
                                       "api_key": API_KEY, "admin_api_key": ADMIN_API_KEY, "enable_metrics": True,
                                       "served_model_name": SERVED_MODEL_NAME, "allowed_origins": [ALLOWED_ORIGIN],
                                       "rerank_template": "qwen3_reranker"})
        return s, lambda: s.stop_checked({"authorization": f"Bearer {API_KEY}"})

    return shared_server("hardened_server", start)


@pytest.fixture(scope="session")
def default_server():
    """One server with the suite's common configuration (SMALL_ENGINE_ARGS) plus --enable-metrics (and
    --rerank-template qwen3_reranker for test_rerank, which changes nothing else), shared by
    the modules that need nothing else (test_bench_serving, test_bench_structured_output, test_clients,
    test_http_server, test_load_disconnects, test_rerank, test_router_replicas' first worker, test_sampling_features,
    test_sessions at page 1): a server start costs ~35 s on a 2-core CPU. Tests on it must not assume a fresh
    server: they flush the cache first or look at differences. Its checks of the whole server's life (no compile
    after warm-up, no leaked KV) cover every module's traffic; when it stops it must exit 0 and leave no child
    process."""
    from srt_helpers import generator_server, module_server, shared_server

    return shared_server("default_server",
                         lambda: generator_server(module_server(["--enable-metrics", "--enable-streaming-session",
                                                                 "--rerank-template", "qwen3_reranker"])))
