"""Helpers for end-to-end tests: the common small configuration, a launched server, the HF reference."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import httpx

from sgl_jax.bench_utils import fetch_server_info, rank_is_idle, wait_idle_info
from sgl_jax.srt.model_loader.default_model import find_default_model_path
from sgl_jax.srt.utils import find_free_port

# One configuration for every SmolLM2 engine/server in the suite, so the JAX persistent compilation
# cache built by the first one serves all the others.
SMALL_ENGINE_ARGS = dict(
    context_length=2048,
    max_total_tokens=16384,
    precompile_token_paddings=[64, 256],
    precompile_bs_paddings=[1, 8, 32],
    chunked_prefill_size=256,
    max_running_requests=32,
    random_seed=0,
)


# Server processes see the packages as the runtime installs them, without the test extras' torch:
# runtime_env/sitecustomize.py (~7 s less per server start on a 2-core CPU).
RUNTIME_ENV_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime_env")


# The exact page-ownership check after every step (mem_cache/kv_invariants.py) is on for every test server and
# engine: a violation counts in memory_errors, which every teardown asserts is 0 (check_clean).
CHECK_KV_ENV = {"SGL_JAX_CHECK_KV_INVARIANTS": "1"}


def server_env(env: Optional[dict] = None) -> dict:
    """The environment of a server process: os.environ plus CHECK_KV_ENV plus `env`, RUNTIME_ENV_DIR first on
    PYTHONPATH."""
    out = {**os.environ, **CHECK_KV_ENV, **(env or {})}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (RUNTIME_ENV_DIR, out.get("PYTHONPATH")) if p)
    return out


def start_engine(**kwargs):
    """``sgl_jax.Engine(**kwargs)`` whose child processes (scheduler, detokenizer: spawned, so they read
    os.environ when they start) run with RUNTIME_ENV_DIR first on PYTHONPATH, as a server's do. This process
    keeps its modules and its environment."""
    from sgl_jax import Engine

    env = server_env()
    names = ["PYTHONPATH", *CHECK_KV_ENV]
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update({k: env[k] for k in names})
    try:
        return Engine(**kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def engine_children() -> set:
    """The child processes of this process that an Engine may have started (multiprocessing's resource tracker,
    which lives as long as this process and is not an Engine's to stop, left out)."""
    return {p for p in child_pids(os.getpid()) if "resource_tracker" not in cmdline(p)}


@contextlib.contextmanager
def checked_engine(**kwargs):
    """``with checked_engine(**kwargs) as e:`` -- `start_engine(**kwargs)`, checked as every test server is: once
    the block ends without an exception the Engine must be clean (`check_engine_clean`), and leaving it must stop
    both child processes the Engine started (the scheduler, for every DP rank, and the detokenizer)."""
    before = engine_children()
    with start_engine(**kwargs) as e:
        ours = engine_children() - before
        assert len(ours) == 2 and all(pid_alive(p) for p in ours), ours
        yield e
        check_engine_clean(e)
    assert not alive_after(ours), "the Engine left child processes behind"


# conftest's session-wide servers while the tests that share them run: name -> (the server or Engine, its stop)
_SHARED: dict = {}


def shared_server(name: str, start):
    """The running shared server `name` (conftest's default_server, hardened_server, shared_engine), started by
    ``start() -> (server, stop)`` when it is not running. They run until `stop_shared_servers`."""
    if name not in _SHARED:
        _SHARED[name] = start()
    return _SHARED[name][0]


def stop_shared_servers() -> None:
    """Stop every running shared server, each with its own checks (clean pool, no compile after warm-up, exit 0,
    no child left). test/conftest.py calls it at the end of the group of tests that share them (so they do not
    hold memory while other modules run) and at the end of the session. Raises the first check that failed, once
    all are stopped."""
    errors = []
    while _SHARED:
        _, (_, stop) = _SHARED.popitem()
        try:
            stop()
        except BaseException as exc:  # (stop the others first)
            errors.append(exc)
    if errors:
        raise errors[0]


def generator_server(gen) -> tuple:
    """(server, stop) of a `module_server` generator: its server, and the rest of it (checks and stop)."""
    return next(gen), lambda: next(gen, None)


# conftest.shared_engine's configuration: the suite's, plus the scoring flags test_score.py exercises (a small pack
# limit, so that packed requests are split into several packs; 3 items per extend request; handles that expire
# after 3 s unused). None of them changes generation.
SHARED_ENGINE_ARGS = dict(SMALL_ENGINE_ARGS, log_level="warning", max_multi_item_seq_len=300, enable_scoring_cache=True,
                          multi_item_prefill_extend_cache_timeout=3.0, multi_item_extend_batch_size=3)

# the keys and --served-model-name of conftest.hardened_server
API_KEY = "test-api-key"
ADMIN_API_KEY = "test-admin-key"
SERVED_MODEL_NAME = "my-model"
ALLOWED_ORIGIN = "http://localhost:5173"  # the hardened server's --allowed-origins (a local web UI)


def engine_cli_args(extra: Optional[dict] = None) -> List[str]:
    args = []
    for k, v in {**SMALL_ENGINE_ARGS, **(extra or {})}.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v:
                args.append(flag)
        elif isinstance(v, list):
            args += [flag] + [str(x) for x in v]
        else:
            args += [flag, str(v)]
    return args


def child_pids(pid: int) -> List[int]:
    """Direct children of `pid` (from /proc)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except FileNotFoundError:
        pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def alive_after(pids, timeout: float = 15.0) -> List[int]:
    """The pids still running after waiting up to `timeout` s for them to exit (children exit
    asynchronously once their parent is gone, e.g. multiprocessing's resource tracker)."""
    deadline = time.time() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


HEALTH_POLL_S = 0.2  # a test server's /health poll while it starts (1 s before: 0.5 s lost per start on average)


class ServerProcess:
    """``python -m sgl_jax.launch_server`` on 127.0.0.1 and a free port, in `server_env(env)`; stderr/stdout go
    to a log file.

    Raises RuntimeError (with the log tail) if the server exits or is not healthy within `timeout` seconds.
    """

    def __init__(self, extra_args: Optional[List[str]] = None, env: Optional[dict] = None,
                 timeout: float = 900.0, engine_args: Optional[dict] = None, start_new_session: bool = False):
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sgl_jax_server_", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1", "--port", str(self.port),
               *engine_cli_args(engine_args), *(extra_args or [])]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=server_env(env),
                                     start_new_session=start_new_session)  # (own process group: killpg)
        if self._wait_healthy(timeout):
            self.children = child_pids(self.proc.pid)
            return
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_text()[-5000:]}")

    def _wait_healthy(self, timeout: float) -> bool:
        """Poll /health every HEALTH_POLL_S until it answers 200 (True) or `timeout` s pass (False), on one client
        (httpx.get builds a client, and its SSL context, at every call: CPU this process took from the server's
        start). Raises RuntimeError (with the log tail) if the server exits first."""
        deadline = time.time() + timeout
        with httpx.Client(timeout=2) as client:
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-5000:]}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(HEALTH_POLL_S)
        return False

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 20 s; returns the exit status."""
        return stop_process(self.proc)

    def stop_checked(self, headers: Optional[dict] = None) -> None:
        """The teardown of every test server that is still up: `check_clean` (pool back to free + cached, the
        exact ownership and idle checks clean, no compile after warm-up), then a stop with exit 0 and no child
        process left. The log file is removed once all of that holds (kept, in the temporary directory, when not)."""
        try:
            check_clean(self.url, headers)
        finally:
            code = self.stop()
        assert code == 0, f"server exited with {code}:\n{self.log_text()[-3000:]}"
        assert not alive_after(self.children), "child processes left behind"
        self.log.close()
        os.unlink(self.log.name)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int:
    """Send `sig` (if it still runs), SIGKILL after `grace_s` seconds; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class RouterProcess:
    """sglang-router (``python -m sglang_router.launch_router``, PyPI ``sglang-router``) on 127.0.0.1 and a free
    port in front of `worker_urls`; ready once it answers ``/get_model_info`` (it has registered a worker).

    Raises AssertionError (with the router's log tail) if it exits or is not ready within `timeout` s.
    """

    def __init__(self, worker_urls: List[str], extra_args: Optional[List[str]] = None, timeout: float = 60.0):
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang_router_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
                                      *worker_urls, "--host", "127.0.0.1", "--port", str(self.port),
                                      "--log-level", "warn", "--prometheus-port", str(find_free_port()),
                                      *(extra_args or [])],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while True:
            assert self.proc.poll() is None, f"router exited with {self.proc.returncode}: {self.log_tail()}"
            try:
                if httpx.get(self.url + "/get_model_info", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise AssertionError(f"router not ready after {timeout} s: {self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log.name) as f:
            return f.read()[-n:]

    def stop(self) -> int:
        return stop_process(self.proc, signal.SIGINT)


def module_server(extra_args: Optional[List[str]] = None, headers: Optional[dict] = None, **kwargs):
    """Body of a module-scoped pytest fixture: ``yield from module_server(...)`` yields a `ServerProcess`,
    then checks it is clean and stops cleanly (`ServerProcess.stop_checked`; `headers`: the API key, if any)."""
    s = ServerProcess(extra_args, **kwargs)
    try:
        yield s
    except BaseException:
        s.stop()
        raise
    s.stop_checked(headers)


def assert_pool_clean(st: dict) -> None:
    """One DP rank's KV memory at rest: nothing in use or locked in the full pool (and the SWA pool, with hybrid
    SWA memory), each pool exactly free + cached (the host pool of --enable-hierarchical-cache too), every request slot free, no memory error (the exact
    page-ownership check after every step and the idle check count there)."""
    assert st["kv_tokens_in_use"] == 0 and st["kv_tokens_protected"] == 0, st
    assert st["kv_tokens_free"] + st["kv_tokens_cached"] == st["kv_tokens_total"], st
    assert st["req_slots_free"] == st["max_running_requests"] and st["memory_errors"] == 0, st
    if "swa_tokens_total" in st:  # hybrid SWA memory: the SWA pool too
        assert st["swa_tokens_in_use"] == 0 and st["swa_tokens_protected"] == 0, st
        assert st["swa_tokens_free"] + st["swa_tokens_cached"] == st["swa_tokens_total"], st
    if "host_kv_tokens_total" in st:  # the hierarchical cache's host pool: free + cached
        assert st["host_kv_tokens_free"] + st["host_kv_tokens_cached"] == st["host_kv_tokens_total"], st


def check_clean_info(info: dict) -> None:
    """What every test server or engine must be once its tests are done, asserted on its /get_server_info (live,
    or saved at the end of a benchmark): every DP rank idle (`rank_is_idle`), its KV memory at rest
    (`assert_pool_clean`), and no program compiled after warm-up (``num_compiles_after_warmup`` 0, or None when
    compiles are not counted: ``disable_precompile``)."""
    expected = None if info["disable_precompile"] else 0
    assert info["internal_states"], info
    for st in info["internal_states"]:
        assert rank_is_idle(st), st
        assert_pool_clean(st)
        assert st["num_compiles_after_warmup"] == expected, st


def check_clean(url: str, headers: Optional[dict] = None) -> dict:
    """`check_clean_info` on a live server, once it is idle (`wait_idle_info`): nothing running, every DP rank's
    KV memory at rest, no memory error, no program compiled after warm-up. Returns rank 0's internal state (all
    ranks' under ``"dp_ranks"``)."""
    info = wait_idle_info(lambda: fetch_server_info(url, 30, headers))
    check_clean_info(info)
    return {**info["internal_states"][0], "dp_ranks": info["internal_states"]}


def check_engine_clean(engine) -> dict:
    """`check_clean` for an in-process Engine (its first rank's state)."""
    info = wait_idle_info(engine.get_server_info)
    check_clean_info(info)
    return info["internal_states"][0]


def wait_pool_idle(url: str, headers: Optional[dict] = None, timeout: float = 60.0) -> dict:
    """Wait until nothing runs, then assert every DP rank's KV memory is at rest (`assert_pool_clean`; compiles
    are left to the teardown's `check_clean`). Returns rank 0's internal state (all ranks' under
    ``"dp_ranks"``)."""
    ranks = wait_idle_info(lambda: fetch_server_info(url, 30, headers), timeout)["internal_states"]
    for st in ranks:
        assert_pool_clean(st)
    return {**ranks[0], "dp_ranks": ranks}


def default_model_path() -> str:
    return find_default_model_path()


def load_hf_reference():
    """transformers' LlamaForCausalLM for the SmolLM2 GGUF, float32, eval mode (torch CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy(model, input_ids: List[int], n: int) -> List[int]:
    """n greedy tokens from an HF causal LM (no EOS stopping), with its KV cache."""
    import torch

    out = []
    with torch.no_grad():
        res = model(torch.tensor([input_ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def penalized_logits(logits, prompt: List[int], output: List[int], frequency: float = 0.0, presence: float = 0.0,
                     repetition: float = 1.0, logit_bias: Optional[dict] = None):
    """Reference for the sampling step's adjustments of one row of float logits, from the definitions rather
    than from our code, applied in the engine's documented order (layers/sampler.py). Returns float64[V].

    1. Repetition penalty: transformers' own `RepetitionPenaltyLogitsProcessor(repetition)` called, as
       transformers' generation calls it, with the prompt + output token ids as ``input_ids`` (each token seen
       there: a negative logit multiplied by the penalty, another divided, once however often it occurs).
    2. Frequency and presence penalties as OpenAI's API documentation states them ("Parameter details:
       frequency and presence penalties"): ``mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) *
       alpha_presence``, mu[j] the logit of token j, c[j] "how often that token was sampled prior to the
       current position" (counted over the output tokens, not the prompt).
    3. logit_bias as OpenAI's API reference states it ("the bias is added to the logits generated by the model
       prior to sampling"), keys token ids (int or str).
    """
    import numpy as np
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    scores = torch.tensor(np.asarray(logits, np.float64)[None, :])  # [batch 1, V]
    input_ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long)
    mu = RepetitionPenaltyLogitsProcessor(float(repetition))(input_ids, scores)[0].numpy().copy()
    c = np.zeros(len(mu))
    for j in output:  # c[j]: how often token j was generated
        c[int(j)] += 1
    mu = mu - c * frequency - (c > 0).astype(np.float64) * presence
    for j, bias in (logit_bias or {}).items():
        mu[int(j)] += bias
    return mu


def hf_greedy_penalized(model, input_ids: List[int], n: int, **penalties) -> List[int]:
    """n greedy tokens (no EOS stopping) from an HF causal LM with its KV cache, each the argmax of the step's
    float32 logits adjusted by `penalized_logits` (transformers' RepetitionPenaltyLogitsProcessor over prompt +
    tokens so far, then OpenAI's frequency / presence formula over the tokens so far, then logit_bias)."""
    import numpy as np
    import torch

    out: List[int] = []
    with torch.no_grad():
        res = model(torch.tensor([input_ids]), use_cache=True)
        for _ in range(n):
            logits = res.logits[0, -1].float().numpy()
            tok = int(np.argmax(penalized_logits(logits, input_ids, out, **penalties)))
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def save_tiny_llama(path, num_layers: int = 2, init_std: float = 0.02, final_norm: float = 1.0,
                    max_positions: int = 1024) -> tuple:
    """A random tiny Llama (SmolLM2's vocabulary, 4 heads, 2 KV heads, `num_layers` layers, weights drawn with
    standard deviation `init_std`: at transformers' default 0.02 its greedy output repeats one token whatever the
    context, at 0.2 it follows the context; the final norm's weight set to `final_norm`, which scales the logits
    alone: at 5 a few tokens hold most of the next token's probability; `max_positions` its context) saved as
    safetensors in `path`; returns (model dir, tokenizer dir: SmolLM2's, for --tokenizer-path)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgl_jax.srt.configs.model_config import resolve_model_path

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=init_std)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.fill_(final_norm)
    model.save_pretrained(path, safe_serialization=True)
    return str(path), resolve_model_path(default_model_path()).hf_dir


def save_tiny_eagle3_head(path, hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                          draft_vocab_size: int = 512, aux_layer_ids=(0, 1, 2), seed: int = 0) -> str:
    """A random EAGLE-3 head in the published ``LlamaForCausalLMEagle3`` format (SGLang's / SpecForge's tensor names,
    an int64 ``d2t`` offset map of `draft_vocab_size` ids over SmolLM2's 49,152, a bool ``t2d``, no embedding),
    written by hand with safetensors (transformers has no class for it) in `path`; `aux_layer_ids` None leaves
    ``eagle_config`` out (the default layers). Returns the directory."""
    import torch
    from safetensors.torch import save_file

    vocab, inter = 49152, 2 * hidden
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    hot = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab_size]).values
    a = "midlayer.self_attn."
    tensors = {
        "fc.weight": rand(hidden, len(aux_layer_ids or (0, 0, 0)) * hidden), "norm.weight": 1 + rand(hidden),
        "midlayer.input_layernorm.weight": 1 + rand(hidden), "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        a + "q_proj.weight": rand(num_heads * head_dim, 2 * hidden),
        a + "k_proj.weight": rand(num_kv_heads * head_dim, 2 * hidden),
        a + "v_proj.weight": rand(num_kv_heads * head_dim, 2 * hidden),
        a + "o_proj.weight": rand(hidden, num_heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter), "lm_head.weight": rand(draft_vocab_size, hidden),
        "d2t": (hot - torch.arange(draft_vocab_size)).long(),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True),
    }
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": num_heads,
              "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024, "vocab_size": vocab,
              "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False, "torch_dtype": "float32"}
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def save_tiny_eagle_head(path, hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                         seed: int = 0) -> str:
    """A random EAGLE (1/2) head in SafeAILab's published format (``fc`` over [embedding, hidden] with a bias,
    ``layers.0.*`` without an input norm, an ``embed_tokens.weight`` the server does not read, a config naming
    ``LlamaForCausalLM`` with one layer), written with safetensors in `path`. Returns the directory."""
    import torch
    from safetensors.torch import save_file

    vocab, inter = 49152, 2 * hidden
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    a = "layers.0.self_attn."
    tensors = {
        "fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden), "embed_tokens.weight": rand(vocab, hidden),
        "layers.0.post_attention_layernorm.weight": 1 + rand(hidden),
        a + "q_proj.weight": rand(num_heads * head_dim, hidden),
        a + "k_proj.weight": rand(num_kv_heads * head_dim, hidden),
        a + "v_proj.weight": rand(num_kv_heads * head_dim, hidden),
        a + "o_proj.weight": rand(hidden, num_heads * head_dim),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden), "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
    }
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": num_heads,
              "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu", "bias": True,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024, "vocab_size": vocab,
              "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def edit_checkpoint(model_dir: str, edit) -> None:
    """Rewrite `model_dir`'s model.safetensors (as save_tiny_llama writes it) with `edit(tensors)`: a dict of
    name -> numpy array in, the dict to save out."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


def save_tiny_gemma3(path, window: int = 16, num_layers: int = 3) -> tuple:
    """A random tiny Gemma 3 (SmolLM2's vocabulary, sliding window `window` on every layer but the middle one)
    saved as safetensors in `path`; returns (model dir, tokenizer dir: SmolLM2's, for --tokenizer-path)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from sgl_jax.srt.configs.model_config import resolve_model_path

    torch.set_num_threads(1)
    torch.manual_seed(0)
    types = ["full_attention" if i == num_layers // 2 else "sliding_attention" for i in range(num_layers)]
    cfg = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                           sliding_window=window, layer_types=types, query_pre_attn_scalar=16,
                           architectures=["Gemma3ForCausalLM"])
    Gemma3ForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return str(path), resolve_model_path(default_model_path()).hf_dir


def free_port_range(n: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port P with P .. P+n-1 all free (for --dist-init-addr, which uses 4 consecutive ports)."""
    import socket

    for _ in range(tries):
        base = find_free_port(host)
        socks = []
        try:
            for k in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")
