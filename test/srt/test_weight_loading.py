"""Safetensors weights are read lazily from the file's memory map, each device's shard alone (model_loader/loader.py:
`MappedTensor`, `_Placer.place`), on 2 virtual CPU devices (``--xla_force_host_platform_device_count=2``, set in a
subprocess before jax is imported).

A bfloat16 checkpoint placed as float32 parameters under tp 2: a column-parallel weight is read as two half slices
(never whole), a row-parallel one as two column halves, a norm (replicated) whole, once; every value equals the
file's, widened; k/v projections whose heads tp replicates are read whole and replicated as before. The end-to-end
check that a tp 2 / 4 model serves what tp 1 serves is test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

WORKER = r"""
import json, sys, types
import numpy as np, ml_dtypes, jax
from safetensors.numpy import save_file
from sgl_jax.srt.distributed.mesh import create_mesh
from sgl_jax.srt.model_loader import loader

path = sys.argv[1]
rng = np.random.default_rng(0)
tensors = {"model.layers.0.mlp.up_proj.weight": rng.normal(size=(8, 6)),
           "model.layers.0.mlp.down_proj.weight": rng.normal(size=(6, 8)),
           "model.layers.0.input_layernorm.weight": rng.normal(size=(6,)),
           "model.layers.0.self_attn.k_proj.weight": rng.normal(size=(4, 6))}
save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, path)

reads = []  # (tensor, index) of every read the placement made
read = loader.MappedTensor.__getitem__
def recording(self, index):
    reads.append((self.name, [[s.start, s.stop] if isinstance(s, slice) else repr(s) for s in
                              (index if isinstance(index, tuple) else (index,))]))
    return read(self, index)
loader.MappedTensor.__getitem__ = recording

config = types.SimpleNamespace(num_key_value_heads=int(sys.argv[2]), ep_size=1)
placer = loader._Placer(config, np.float32, create_mesh(2))
out = {}
for name, t in loader.mapped_safetensors(path):
    assert isinstance(t, loader.MappedTensor) and t.dtype == ml_dtypes.bfloat16, (name, t.dtype)
    arr = placer.place(name, t)
    want = tensors[name].astype(ml_dtypes.bfloat16).astype(np.float32)
    if name.endswith("k_proj.weight") and placer.padded_kv_heads != placer.kv_heads:
        want = loader.replicate_kv_rows(want, placer.kv_heads, placer.padded_kv_heads)
    np.testing.assert_array_equal(np.asarray(arr), want)
    out[name] = {"dtype": str(arr.dtype), "spec": [s for s in arr.sharding.spec],
                 "reads": [idx for n, idx in reads if n == name]}
print("RESULT " + json.dumps(out))
"""


def run_worker(tmp_path, kv_heads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "w.safetensors"), str(kv_heads)],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_each_device_reads_its_own_shard_of_a_mapped_tensor(tmp_path):
    r = run_worker(tmp_path, kv_heads=2)  # tp 2 divides 2 KV heads: k_proj is split like the others
    up, down = r["model.layers.0.mlp.up_proj.weight"], r["model.layers.0.mlp.down_proj.weight"]
    assert up["dtype"] == "float32" and up["spec"][0] == "tensor"
    assert sorted(up["reads"]) == [[[0, 4], [None, None]], [[4, 8], [None, None]]], up  # two row halves
    assert sorted(down["reads"]) == [[[None, None], [0, 4]], [[None, None], [4, 8]]], down  # two column halves
    k = r["model.layers.0.self_attn.k_proj.weight"]
    assert sorted(k["reads"]) == [[[0, 2], [None, None]], [[2, 4], [None, None]]], k
    norm = r["model.layers.0.input_layernorm.weight"]
    assert norm["reads"] == [[[None, None]]], norm  # replicated: read whole once (JAX copies it to each device)


def test_kv_projections_replicated_past_tp_are_read_whole(tmp_path):
    r = run_worker(tmp_path, kv_heads=1)  # tp 2 over 1 KV head: each device holds a copy of the head
    k = r["model.layers.0.self_attn.k_proj.weight"]
    assert k["reads"] == [["Ellipsis"]], k
    assert sorted(r["model.layers.0.mlp.up_proj.weight"]["reads"]) == [[[0, 4], [None, None]],
                                                                       [[4, 8], [None, None]]]
