"""ServerArgs: the flags SGLang users expect (issue #20) and their validation."""

from __future__ import annotations

import os

import pytest

from sgl_jax.srt.server_args import ServerArgs, prepare_server_args


def test_compilation_cache_dir_flag_then_environment_then_default(monkeypatch, tmp_path):
    monkeypatch.setenv("SGL_JAX_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert ServerArgs().compilation_cache_dir == str(tmp_path / "root" / "jax_compilation_cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert ServerArgs().compilation_cache_dir == str(tmp_path / "env")
    assert prepare_server_args([]).compilation_cache_dir == str(tmp_path / "env")
    flag = prepare_server_args(["--compilation-cache-dir", str(tmp_path / "flag")])
    assert flag.compilation_cache_dir == str(tmp_path / "flag")


def test_jax_uses_the_environment_cache_dir(tmp_path):
    """setup_jax hands the resolved directory to JAX (run in a child: jax's config is process-wide)."""
    import subprocess
    import sys

    code = ("import jax; from sgl_jax.srt.server_args import ServerArgs; "
            "from sgl_jax.srt.model_executor.model_runner import setup_jax; setup_jax(ServerArgs()); "
            "print(jax.config.jax_compilation_cache_dir)")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env"), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "env")
    assert (tmp_path / "env").is_dir()


@pytest.mark.parametrize("flag,want", [("float16", "float16"), ("half", "float16"), ("bfloat16", "bfloat16"),
                                       ("float32", "float32"), ("float", "float32"), ("auto", "auto")])
def test_dtype_names(flag, want):
    assert prepare_server_args(["--dtype", flag]).dtype == want


@pytest.mark.parametrize("field,value,fragment", [
    ("dtype", "float8", "--dtype must be one of"),
    ("reasoning_parser", "kimi", "--reasoning-parser must be one of"),
    ("tokenizer_mode", "fast", "--tokenizer-mode must be one of"),
])
def test_bad_choices_name_the_flag(field, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        ServerArgs(**{field: value})


def test_hub_and_request_log_flags_parse():
    a = prepare_server_args(["--model-path", "org/name", "--revision", "v1", "--download-dir", "/tmp/hub",
                             "--gguf-file", "m.Q4_K_M.gguf", "--tokenizer-mode", "slow", "--reasoning-parser",
                             "deepseek-r1", "--enable-request-log", "--trust-remote-code"])
    assert (a.model_path, a.revision, a.download_dir, a.gguf_file) == ("org/name", "v1", "/tmp/hub", "m.Q4_K_M.gguf")
    assert (a.tokenizer_mode, a.reasoning_parser, a.enable_request_log, a.trust_remote_code) == (
        "slow", "deepseek-r1", True, True)


def test_page_size_default_per_platform(monkeypatch):
    """--page-size defaults to 128 on TPU, 16 on GPU and 1 on CPU (issue #38); the platform comes from --device,
    else $JAX_PLATFORMS, else the plugin installed (none here: cpu); an explicit flag wins."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert ServerArgs().page_size == 1
    assert ServerArgs(device="tpu").page_size == 128
    assert ServerArgs(device="gpu").page_size == 16
    assert ServerArgs(device="tpu", page_size=1).page_size == 1
    assert prepare_server_args(["--device", "gpu", "--page-size", "64"]).page_size == 64
    for platforms, want in (("cuda", 16), ("tpu,cpu", 128), ("cpu", 1)):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert ServerArgs().page_size == want, platforms
    with pytest.raises(ValueError, match="--chunked-prefill-size"):
        ServerArgs(device="tpu", chunked_prefill_size=64)  # under the TPU's 128-token page
    with pytest.raises(ValueError, match="--page-size"):
        ServerArgs(page_size=0)


def test_speculative_flags():
    """SGLang's --speculative-* flags: NGRAM's defaults, and every combination that cannot run refused at start-up
    with a message naming the flags."""
    a = prepare_server_args(["--speculative-algorithm", "NGRAM"])
    assert a.speculative_num_draft_tokens == 12 and a.speculative_ngram_branch_length == 18
    a = prepare_server_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
                             "--speculative-ngram-match-type", "PROB", "--speculative-ngram-max-bfs-breadth", "3"])
    assert (a.speculative_num_draft_tokens, a.speculative_ngram_match_type, a.speculative_ngram_max_bfs_breadth) == (
        4, "PROB", 3)
    a = prepare_server_args(["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d"])
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (3, 1, 4)
    a = prepare_server_args(["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
                             "--speculative-num-draft-tokens", "6"])
    assert (a.speculative_num_steps, a.speculative_num_draft_tokens) == (5, 6)
    a = prepare_server_args(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h",
                             "--speculative-num-steps", "5"])
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (5, 1, 6)
    a = prepare_server_args(["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
                             "--speculative-eagle-topk", "4"])
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (3, 4, 13)
    a = prepare_server_args(["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
                             "--speculative-eagle-topk", "2", "--speculative-num-steps", "2",
                             "--speculative-num-draft-tokens", "7"])  # the root and all 2 + 4 candidates
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (2, 2, 7)
    a = prepare_server_args(["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "h",
                             "--speculative-eagle-topk", "4"])  # SGLang's EAGLE trees
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (3, 4, 13)
    standalone = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "d"}
    refused = [
        ({"speculative_algorithm": "MEDUSA"}, "--speculative-algorithm must be one of"),
        ({"speculative_algorithm": "STANDALONE"}, "STANDALONE needs --speculative-draft-model-path"),
        ({**standalone, "speculative_eagle_topk": 2, "speculative_num_steps": 2, "speculative_num_draft_tokens": 8},
         r"--speculative-num-draft-tokens must be in \[2, 7\] with --speculative-eagle-topk 2"),
        ({**standalone, "speculative_eagle_topk": 8, "speculative_num_steps": 5, "speculative_num_draft_tokens": 33},
         r"--speculative-num-draft-tokens must be in \[2, 32\]"),  # (the tree mask's bits)
        ({**standalone, "speculative_eagle_topk": 0}, "--speculative-eagle-topk must be an integer >= 1"),
        ({**standalone, "speculative_num_steps": 3, "speculative_num_draft_tokens": 8},
         r"--speculative-num-draft-tokens \(8\) must be --speculative-num-steps \(3\) \+ 1"),
        ({**standalone, "speculative_num_steps": 32}, r"--speculative-num-steps must be in \[1, 31\]"),
        ({"speculative_algorithm": "EAGLE3"}, "EAGLE3 needs --speculative-draft-model-path"),
        ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "h", "speculative_eagle_topk": 4,
          "speculative_num_steps": 2, "speculative_num_draft_tokens": 22},
         r"--speculative-num-draft-tokens must be in \[2, 21\] with --speculative-eagle-topk 4"),
        ({"speculative_algorithm": "EAGLE"}, "EAGLE needs --speculative-draft-model-path"),
        ({"speculative_num_draft_tokens": 4}, "--speculative-num-draft-tokens needs --speculative-algorithm"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 33},
         r"--speculative-num-draft-tokens must be in \[2, 32\]"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "--speculative-num-draft-tokens"),
        ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"},
         "--speculative-draft-model-path does not apply to --speculative-algorithm NGRAM"),
        ({"speculative_algorithm": "NGRAM", "speculative_ngram_max_match_window_size": 20},
         "--speculative-ngram-max-match-window-size .* < --speculative-ngram-branch-length"),
        ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_bfs_breadth": 11},
         "--speculative-ngram-min-bfs-breadth"),
        ({"speculative_algorithm": "NGRAM", "speculative_ngram_match_type": "DFS"},
         "--speculative-ngram-match-type must be one of"),
        ({"speculative_algorithm": "NGRAM", "speculative_accept_threshold_single": 0.5},
         "--speculative-accept-threshold-single: only 1.0"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=message):
            ServerArgs(**kwargs)


def test_hierarchical_cache_flags():
    """SGLang's HiCache flags parse with its defaults (ratio 2, size 0 GB, write_through); bad sizes and the
    combinations the host tier cannot serve are refused naming the flag; the host pool's size follows the size
    over the ratio and is checked against the memory there is."""
    from types import SimpleNamespace

    from sgl_jax.srt.model_executor.host_kv import host_pool_tokens

    a = prepare_server_args(["--enable-hierarchical-cache"])
    assert (a.enable_hierarchical_cache, a.hicache_ratio, a.hicache_size, a.hicache_write_policy) == (
        True, 2.0, 0.0, "write_through")
    b = prepare_server_args(["--enable-hierarchical-cache", "--hicache-ratio", "1.5", "--hicache-size", "3",
                             "--hicache-write-policy", "write_back"])
    assert (b.hicache_ratio, b.hicache_size, b.hicache_write_policy) == (1.5, 3.0, "write_back")
    for kwargs, message in (({"hicache_ratio": 0}, "--hicache-ratio"), ({"hicache_ratio": float("inf")},
                            "--hicache-ratio"), ({"hicache_size": -1}, "--hicache-size"),
                            ({"hicache_write_policy": "write_around"}, "--hicache-write-policy must be one of"),
                            ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "--disable-radix-cache"),
                            ({"enable_hierarchical_cache": True, "radix_eviction_policy": "lfu"},
                             "--radix-eviction-policy"),
                            ({"enable_hierarchical_cache": True, "nnodes": 2, "dist_init_addr": "127.0.0.1:5000"},
                             "--nnodes")):
        with pytest.raises(ValueError, match=message):
            ServerArgs(**kwargs)
    flags = SimpleNamespace(hicache_size=0.0, hicache_ratio=2.0, dp_size=2)
    assert host_pool_tokens(flags, 1000, 100, page_size=16) == 2000 // 16 * 16
    flags.hicache_size = 0.001  # 10^6 bytes of 100 per token, over the ratio
    assert host_pool_tokens(flags, 1000, 100, page_size=16) == 10000 // 16 * 16
    with pytest.raises(ValueError, match="--hicache-size"):
        host_pool_tokens(flags, 1000, 100, page_size=16, available_bytes=10**6)  # (two ranks: 2 MB)
    flags.hicache_size, flags.hicache_ratio = 0.0, 0.001
    with pytest.raises(ValueError, match="less than one page"):
        host_pool_tokens(flags, 1000, 100, page_size=16)
