"""model_loader/host_pages.py: NumPy's large arrays are not advised as huge-page candidates inside
`numpy_hugepages(False)` (the kernel's ``hg`` VmFlag of the array's mapping in /proc/self/smaps), are again after
it, and a model load leaves NumPy's setting as it found it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from sgl_jax.srt.model_loader.host_pages import numpy_hugepages

BIG = 64 << 20  # bytes: far above glibc's mmap threshold, so the array has a mapping of its own


def vm_flags(arr: np.ndarray) -> set:
    """The VmFlags of the mapping that holds the middle of `arr`'s data (/proc/self/smaps; NumPy advises from the
    first page boundary in the array on, which splits off the mapping's first page)."""
    addr, flags, inside = arr.ctypes.data + arr.nbytes // 2, None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = set(line.split()[1:])
                break
    assert flags is not None, "no mapping holds the array"
    return flags


def big_array() -> np.ndarray:
    return np.ones(BIG // 4, np.float32)


def run_fresh(call: str) -> None:
    """`call` (a function of this module) in a new Python process: a fresh allocator, as the scheduler process
    that loads a model has. (In a long-lived process a large array can land in memory an earlier array had
    advised, whose flag outlives it.)"""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    env.pop("NUMPY_MADVISE_HUGEPAGE", None)
    run = subprocess.run([sys.executable, "-c", f"import test_host_pages as t; t.{call}"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def check_switch() -> None:
    assert "hg" in vm_flags(big_array())  # NumPy's default on Linux: MADV_HUGEPAGE
    with numpy_hugepages(False):
        assert "hg" not in vm_flags(big_array())
    assert "hg" in vm_flags(big_array())


def check_load(model_dir: str) -> None:
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.model_loader.loader import load_model
    from sgl_jax.srt.server_args import ServerArgs

    mc = ModelConfig.from_server_args(ServerArgs(model_path=model_dir, dtype="float32"), "cpu")
    for setting in (True, False):
        with numpy_hugepages(setting):
            load_model(mc)
            assert ("hg" in vm_flags(big_array())) == setting


def test_switch_off_inside_and_restored_after():
    run_fresh("check_switch()")


def test_a_model_load_restores_the_setting(tmp_path):
    """A tiny random Llama loaded from safetensors (the loader's whole path): NumPy advises huge pages after it
    exactly as before it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    run_fresh(f"check_load({str(tmp_path)!r})")
