"""RL and operator endpoints (scheduler/engine_control.py, model_executor/weight_update.py) on a real server.

Two tiny random Llama checkpoints of one architecture, A and B (B = A + noise), and transformers on each as the
reference. One server (admin key, profile dir) starts on A; the tests run in order and leave it serving
whichever checkpoint they last loaded (`Served.current`):
- updates A <-> B while requests run, in each in-flight mode (wait, abort_all_requests, pause in_place, pause
  retract): requests complete or abort as the mode says; afterwards greedy output equals transformers on the new
  weights, the prefix cache serves nothing computed with the old ones, and nothing compiled;
- a checkpoint of another shape is refused (400 naming the field) and the server keeps serving;
- /get_weights_by_name equals the checkpoint's tensor;
- pause in each mode with streams running, then continue: the right outputs, no progress while paused;
- release then resume memory: device bytes drop by the KV pool and the weights, 503 with Retry-After meanwhile,
  outputs identical after;
- a profile bounded in steps writes a TensorBoard and a Perfetto trace;
- the offline Engine's update_weights_from_tensor (torch tensors) serves B;
- under tp 2 (virtual CPU devices, a subprocess) a tensor update places every shard as the loader does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import orjson
import pytest
import torch

from srt_helpers import ServerProcess, check_clean, edit_checkpoint, hf_greedy, server_env, wait_pool_idle

torch.set_num_threads(1)

ADMIN = {"Authorization": "Bearer adm"}
STEPS = 12
LONG = 160  # tokens of the requests that run while the weights change


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"A": dir, "B": dir, "bad": dir (3 layers)}, the tokenizer dir, and the prompts."""
    from srt_helpers import save_tiny_llama

    root = tmp_path_factory.mktemp("rl")
    a, tok = save_tiny_llama(root / "A", num_layers=2, init_std=0.2)
    b = str(root / "B")
    shutil.copytree(a, b)
    rng = np.random.default_rng(1)
    edit_checkpoint(b, lambda t: {k: (v + rng.normal(0, 0.1, v.shape)).astype(v.dtype) if "norm" not in k else v
                                  for k, v in t.items()})
    bad, _ = save_tiny_llama(root / "bad", num_layers=3, init_std=0.2)
    prompts = [[1] + np.random.default_rng(i).integers(2, 49152, size=n).tolist()
               for i, n in enumerate((9, 23, 40))]
    return {"A": a, "B": b, "bad": bad}, tok, prompts


@pytest.fixture(scope="module")
def refs(ckpts):
    """Greedy transformers tokens per checkpoint: {"A"|"B": [STEPS tokens per prompt], "A_long": [LONG ...]}."""
    from transformers import AutoModelForCausalLM

    dirs, _, prompts = ckpts
    out = {}
    for name in ("A", "B"):
        model = AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32).eval()
        out[name] = [hf_greedy(model, p, STEPS) for p in prompts]
        out[name + "_long"] = [hf_greedy(model, p, LONG) for p in prompts]
    return out


class Served:
    current = "A"


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    dirs, tok, _ = ckpts
    s = ServerProcess(["--model-path", dirs["A"], "--tokenizer-path", tok, "--admin-api-key", "adm",
                       "--profile-dir", str(tmp_path_factory.mktemp("profiles")), "--max-running-requests", "8",
                       "--log-level", "info"])
    yield s
    s.stop_checked(ADMIN)


def post(url: str, path: str, body=None, headers=ADMIN, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


def generate(url: str, ids, n: int = STEPS, **extra) -> dict:
    r = post(url, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                                      "ignore_eos": True}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def check_serving(url: str, prompts, want) -> list:
    outs = [generate(url, p) for p in prompts]
    assert [o["output_ids"] for o in outs] == want
    return outs


class Stream(threading.Thread):
    """A streamed greedy /generate of `n` tokens: ``times`` of each chunk and the final response."""

    def __init__(self, url: str, ids, n: int = LONG):
        super().__init__(daemon=True)
        self.url, self.ids, self.n = url, ids, n
        self.times, self.final, self.error = [], None, None

    def run(self):
        body = {"input_ids": self.ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": self.n, "ignore_eos": True}}
        try:
            with httpx.stream("POST", self.url + "/generate", json=body, headers=ADMIN, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.final = orjson.loads(line[6:])
                        self.times.append((time.monotonic(), len(self.final.get("output_ids", []))))
        except Exception as e:  # (reported by the test)
            self.error = e

    def tokens(self) -> int:
        return self.times[-1][1] if self.times else 0


def start_streams(url: str, prompts, min_tokens: int = 8) -> list:
    streams = [Stream(url, p) for p in prompts]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while min(s.tokens() for s in streams) < min_tokens:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)
    return streams


def finish(streams) -> list:
    for s in streams:
        s.join(300)
        assert not s.is_alive() and s.error is None, s.error
    return [s.final for s in streams]


def state(url: str) -> dict:
    return httpx.get(url + "/get_server_info", headers=ADMIN, timeout=30).json()["internal_states"][0]


def update(url: str, path: str, **extra) -> httpx.Response:
    return post(url, "/update_weights_from_disk", {"model_path": path, **extra})


def other(name: str) -> str:
    return "B" if name == "A" else "A"


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_no_old_kv(url: str, prompts, want, recomputed: bool = False) -> None:
    """The prompts (cached before the update) are served with the new weights' tokens, reusing only KV computed
    after the update: what the prompts before computed (their shared BOS), or, for requests retracted and
    recomputed after it (`recomputed`), their whole prompts."""
    outs = [generate(url, p) for p in prompts]
    shared = [len(p) - 1 if recomputed else max([0] + [common_prefix(p, q) for q in prompts[:i]])
              for i, p in enumerate(prompts)]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == shared
    assert [o["output_ids"] for o in outs] == want


@pytest.mark.parametrize("mode", ["wait", "abort", "in_place", "retract"])
def test_update_weights_while_requests_run(server, ckpts, refs, mode):
    """Each in-flight mode: the running requests complete (wait: entirely on the old weights; in_place, retract:
    resumed on the new ones) or abort; then the new weights serve exactly transformers' tokens, nothing cached
    before the update is matched, and nothing compiled."""
    dirs, _, prompts = ckpts
    url, old = server.url, Served.current
    new = other(old)
    check_serving(url, prompts, refs[old])  # (and caches the prompts under the old weights)
    streams = start_streams(url, prompts)
    if mode in ("in_place", "retract"):
        assert post(url, "/pause_generation", {"mode": mode}).json()["success"]
    if mode == "in_place":  # (an RL loop may update several times while paused: the held KV is retired once)
        assert update(url, dirs[new], weight_version="v-first").json()["num_paused_requests"] == len(prompts)
    # (with fields of SGLang's newer releases: rid and a null manifest)
    r = update(url, dirs[new], weight_version=f"v-{mode}", abort_all_requests=mode == "abort", rid=f"upd-{mode}",
               manifest=None)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert r.json()["num_paused_requests"] == (len(prompts) if mode == "in_place" else 0)
    Served.current = new
    if mode in ("in_place", "retract"):
        assert post(url, "/continue_generation", {"torch_empty_cache": True}).json()["success"]
    finals = finish(streams)
    reasons = [f["meta_info"]["finish_reason"]["type"] for f in finals]
    if mode == "abort":
        assert reasons == ["abort"] * len(prompts)
    else:
        assert reasons == ["length"] * len(prompts)
        assert all(len(f["output_ids"]) == LONG for f in finals)
    if mode == "wait":  # (the update waited: every token came from the old weights)
        assert [f["output_ids"] for f in finals] == refs[old + "_long"]
    check_no_old_kv(url, prompts, refs[new], recomputed=mode == "retract")
    info = httpx.get(url + "/get_server_info", headers=ADMIN, timeout=30).json()
    assert info["weight_version"] == f"v-{mode}"
    assert generate(url, prompts[0], 1)["meta_info"]["weight_version"] == f"v-{mode}"
    for path in ("/get_weight_version", "/weight_version"):
        assert httpx.get(url + path, headers=ADMIN).json() == {"weight_version": f"v-{mode}"}
    assert httpx.get(url + "/model_info", headers=ADMIN).json()["weight_version"] == f"v-{mode}"
    st = wait_pool_idle(url, ADMIN)
    assert st["retired_cache_namespaces"] == 0 and st["num_compiles_after_warmup"] == 0, st


def test_mismatched_checkpoint_is_refused(server, ckpts, refs):
    """Another shape (3 layers) and a missing directory: 400 naming why; the served weights stay. Unknown fields
    are refused, the admin key is needed, and the endpoints that stop something need a JSON body."""
    dirs, _, prompts = ckpts
    r = update(server.url, dirs["bad"])
    assert r.status_code == 400 and "num_hidden_layers" in r.json()["message"], r.text
    r = update(server.url, dirs["A"] + "-missing")
    assert r.status_code == 400 and not r.json()["success"], r.text
    r = post(server.url, "/update_weights_from_disk", {"model_path": dirs["A"], "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.text
    r = post(server.url, "/update_weights_from_disk", {"model_path": dirs["A"], "manifest": {"tensors": []}})
    assert r.status_code == 400 and "manifest" in r.text
    assert post(server.url, "/update_weights_from_disk", {"model_path": dirs["A"]}, headers={}).status_code == 401
    for path in ("/pause_generation", "/release_memory_occupation", "/start_profile"):  # (no cross-site forms)
        assert httpx.post(server.url + path, headers=ADMIN, content=b"").status_code == 415
    check_serving(server.url, prompts, refs[Served.current])


def test_get_weights_by_name(server, ckpts):
    from safetensors.numpy import load_file

    dirs, _, _ = ckpts
    name = "model.layers.1.mlp.down_proj.weight"
    want = load_file(os.path.join(dirs[Served.current], "model.safetensors"))[name][:3]
    r = httpx.get(server.url + "/get_weights_by_name", params={"name": name, "truncate_size": 3}, headers=ADMIN)
    assert r.status_code == 200 and np.allclose(np.asarray(r.json()), want, atol=1e-6)
    r = post(server.url, "/get_weights_by_name", {"name": name, "truncate_size": 3})
    assert np.allclose(np.asarray(r.json()), want, atol=1e-6)
    r = post(server.url, "/get_weights_by_name", {"name": "model.nope.weight"})
    assert r.status_code == 400 and "model.nope.weight" in r.text


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_pause_and_continue(server, ckpts, refs, mode):
    """Streams stop while paused and finish with the right tokens after continue (abort: aborted; new requests
    queue while paused and run after)."""
    _, _, prompts = ckpts
    url, cur = server.url, Served.current
    streams = start_streams(url, prompts)
    r = post(url, "/pause_generation", {"mode": mode})
    try:
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        queued = Stream(url, prompts[0], STEPS)
        queued.start()
        time.sleep(0.5)  # (the tokens of the step in flight at the pause may still be on their way to the client)
        counts = [s.tokens() for s in streams]
        time.sleep(1.0)
        assert [s.tokens() for s in streams] == counts and queued.tokens() == 0  # (nothing runs while paused)
        assert state(url)["generation_paused"] == mode
    finally:  # (a failure here must not leave the module's server paused for the tests after it)
        assert post(url, "/continue_generation").json()["success"]
    finals = finish(streams + [queued])
    if mode == "abort":
        assert [f["meta_info"]["finish_reason"]["type"] for f in finals[:-1]] == ["abort"] * len(prompts)
    else:
        assert [f["output_ids"] for f in finals[:-1]] == refs[cur + "_long"]
    assert finals[-1]["output_ids"] == refs[cur][0]
    wait_pool_idle(url, ADMIN)


def test_abort_while_paused_in_place(server, ckpts):
    """A pause with mode abort while paused in_place aborts the held requests at once (no step has to run)."""
    _, _, prompts = ckpts
    url = server.url
    streams = start_streams(url, prompts)
    assert post(url, "/pause_generation", {"mode": "in_place"}).json()["success"]
    assert post(url, "/pause_generation", {"mode": "abort"}).json()["success"]
    finals = finish(streams)  # (before continue)
    assert [f["meta_info"]["finish_reason"]["type"] for f in finals] == ["abort"] * len(prompts)
    assert state(url)["num_running_reqs"] == 0
    assert post(url, "/continue_generation").json()["success"]
    wait_pool_idle(url, ADMIN)


def test_release_and_resume_memory(server, ckpts, refs):
    """The KV pool's and the weights' device bytes are freed (live arrays on CPU), requests get 503 with
    Retry-After meanwhile, and the outputs after resume are identical."""
    _, _, prompts = ckpts
    url, cur = server.url, Served.current
    info = httpx.get(url + "/get_server_info", headers=ADMIN, timeout=30).json()
    sched = info["scheduler_info"]
    r = post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 200, r.text
    body = r.json()
    # K and V of 2 layers, each [pool pages + the padding page, page_size, 2 KV heads, head_dim 16] float32
    kv_bytes = 2 * 2 * (sched["max_total_tokens"] + sched["page_size"]) * 2 * 16 * 4
    assert body["bytes_released"] == kv_bytes, body
    # (the live arrays also hold a step's small transient outputs: within 5 %)
    assert body["device_bytes_before"] - body["device_bytes_after"] >= 0.95 * kv_bytes, body
    r = post(url, "/release_memory_occupation", {"tags": ["weights"]})
    body = r.json()
    assert body["bytes_released"] == sched["weight_bytes_per_device"], body
    assert body["device_bytes_before"] - body["device_bytes_after"] >= 0.95 * body["bytes_released"], body
    r = post(url, "/generate", {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
    assert state(url)["memory_released"] == {"kv_cache": True, "weights": True}
    r = post(url, "/resume_memory_occupation", {})
    grown = r.json()["device_bytes_after"] - r.json()["device_bytes_before"]
    assert r.status_code == 200 and grown >= 0.95 * (kv_bytes + sched["weight_bytes_per_device"]), r.json()
    check_serving(url, prompts, refs[cur])
    assert check_clean(url, ADMIN)["num_compiles_after_warmup"] == 0


def test_profile_bounded_in_steps(server, ckpts):
    _, _, prompts = ckpts
    url = server.url
    r = post(url, "/start_profile", {"output_dir": "../escape"})
    assert r.status_code == 400 and "output_dir" in r.text
    r = post(url, "/start_profile", {"output_dir": "run1", "num_steps": 4, "merge_profiles": True,
                                     "profile_prefix": "rl", "activities": ["CPU", "GPU"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    out_dir = r.json()["output_dir"]
    generate(url, prompts[0])
    deadline = time.monotonic() + 60
    while state(url)["profiling"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    files = [os.path.join(d, f) for d, _, fs in os.walk(out_dir) for f in fs]
    assert any(f.endswith(".xplane.pb") for f in files) and any(f.endswith("perfetto_trace.json.gz") for f in files)
    assert post(url, "/stop_profile").status_code == 400  # (nothing running now)
    r = post(url, "/start_profile", {"duration_s": 30})
    assert r.status_code == 200
    r = post(url, "/stop_profile")
    assert r.status_code == 200 and any(f.endswith(".xplane.pb") for f in r.json()["files"]), r.text


def test_engine_update_weights_from_tensor(ckpts, refs, tmp_path):
    """Engine.update_weights_from_tensor with torch tensors of B: B's tokens, get_weights_by_name agrees; an
    unknown name fails without changing anything. Engine.start_profile takes SGLang's keywords."""
    from safetensors.torch import load_file

    from sgl_jax.srt.errors import RequestError
    from srt_helpers import checked_engine

    dirs, tok, prompts = ckpts
    with checked_engine(model_path=dirs["A"], tokenizer_path=tok, max_running_requests=4,
                        profile_dir=str(tmp_path)) as engine:
        with pytest.raises(RequestError, match="bogus"):
            engine.start_profile(bogus=1)
        out = engine.start_profile(duration_s=30, with_stack=True, record_shapes=False, merge_profiles=True)
        assert out["success"], out
        assert engine.stop_profile()["success"]
        tensors = list(load_file(os.path.join(dirs["B"], "model.safetensors")).items())
        ok, msg = engine.update_weights_from_tensor([("model.nope.weight", tensors[0][1])])
        assert not ok and "model.nope.weight" in msg
        ok, msg = engine.update_weights_from_tensor(tensors, weight_version="B")
        assert ok, msg
        outs = [engine.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": STEPS,
                                                              "ignore_eos": True}) for p in prompts]
        assert [o["output_ids"] for o in outs] == refs["B"]
        name, t = tensors[-1]
        assert np.allclose(np.asarray(engine.get_weights_by_name(name, 2)), t[:2].numpy(), atol=1e-6)


TP2_SCRIPT = r"""
import sys, numpy as np, jax
from safetensors.numpy import load_file
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.distributed.mesh import create_mesh
from sgl_jax.srt.model_executor.weight_update import param_index, swap_values, tensor_values
from sgl_jax.srt.model_loader.loader import load_model
from sgl_jax.srt.server_args import ServerArgs

a, b, tok = sys.argv[1:4]
mesh = create_mesh(2, 1, None)

class Runner:  # what the weight-update functions read of a ModelRunner
    def __init__(self, path):
        self.model_config = ModelConfig.from_server_args(ServerArgs(model_path=path, tokenizer_path=tok, tp_size=2),
                                                         "cpu")
        self.mesh = mesh
        _, params = load_model(self.model_config, mesh=mesh)
        self._param_leaves, self._param_treedef = jax.tree.flatten(params)

    @property
    def params(self):
        return jax.tree.unflatten(self._param_treedef, self._param_leaves)

    @params.setter
    def params(self, value):
        self._param_leaves, self._param_treedef = jax.tree.flatten(value)

served, loaded = Runner(a), Runner(b)
import os
swap_values(served, tensor_values(served, load_file(os.path.join(b, "model.safetensors")).items()))
n = 0
for name, i in param_index(served).items():
    x, y = served._param_leaves[i], loaded._param_leaves[i]
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim), name
    for sx, sy in zip(x.addressable_shards, y.addressable_shards):
        assert sx.device == sy.device and sx.index == sy.index, name
        assert np.array_equal(np.asarray(sx.data), np.asarray(sy.data)), name
    n += any(s.data.shape != x.shape for s in x.addressable_shards)
print("sharded", n)
assert n > 0
"""


def test_tensor_update_places_shards_as_the_loader_tp2(ckpts):
    dirs, tok, _ = ckpts
    env = server_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"})
    r = subprocess.run([sys.executable, "-c", TP2_SCRIPT, dirs["A"], dirs["B"], tok], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split("sharded")[1]) > 0
