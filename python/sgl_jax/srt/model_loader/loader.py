"""Build a model and fill its parameters from a GGUF file, safetensors files, or random (dummy) values.

Parameter paths of our NNX models equal HF state-dict keys (see `models/llama.py`), so loading is a
rename-free copy: each checkpoint tensor goes to the parameter with the same dotted path. The exception: a
mixture-of-experts model's per-expert tensors are stacked into one parameter per weight (`ExpertStacker`).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import re
import struct
from typing import Dict, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from sgl_jax.srt.distributed.sharding import expert_axes, padded_kv_heads, param_spec, replicate_kv_rows
from sgl_jax.srt.models.registry import get_model_class
from sgl_jax.srt.model_loader.gguf_blocks import GroupQuantized
from sgl_jax.srt.model_loader.host_pages import numpy_hugepages
from sgl_jax.srt.quantization.methods import get_method, quantize_for

logger = logging.getLogger(__name__)

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def _safetensors_files(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {model_dir}")
    return files


def _iterate_safetensors(model_dir: str) -> Iterator[Tuple[str, object]]:
    for path in _safetensors_files(model_dir):
        yield from mapped_safetensors(path)


# safetensors dtypes -> numpy's (bfloat16 and fp8 as ml_dtypes' types)
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
                       "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class MappedTensor:
    """A tensor of an open safetensors file, read only where it is indexed: ``t[index]`` reads that slice from the
    file's memory map (safetensors' ``get_slice``), ``np.asarray(t)`` the whole tensor. `_Placer.place` reads each
    device's shard of it alone, so a sharded parameter never exists whole on the host. Valid while its file is
    open (`mapped_safetensors` yields each tensor inside it).

    Attributes:
        name: the tensor's name in the file; shape, dtype, ndim: as a numpy array's.
    """

    def __init__(self, f, path: str, name: str):
        self._file, self._path, self.name = f, path, name
        self._slice = f.get_slice(name)
        self.shape = tuple(int(d) for d in self._slice.get_shape())
        self._kind = self._slice.get_dtype()
        self.dtype = np.dtype(_SAFETENSORS_DTYPES.get(self._kind, np.float32))
        self.ndim = len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        """The slice at `index` (a tuple of slices, one per axis, or ``()`` / ``...``) as a host array."""
        if self._kind in _FP8_DTYPES:  # (safetensors' numpy reader has no fp8 type: read through the bytes)
            return np.array(_get_tensor(self._file, self._path, self.name)[index])
        return self._slice[index] if self.shape else self._slice[()]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[...] if self.shape else self[()]
        return whole if dtype is None else whole.astype(dtype, copy=False)


def mapped_safetensors(path: str) -> Iterator[Tuple[str, MappedTensor]]:
    """(name, `MappedTensor`) of every tensor of safetensors file `path`, the file open while each is consumed.
    Raises what safetensors raises for a file that is not one."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            yield name, MappedTensor(f, path, name)


def safetensors_tensors(path: str) -> Iterator[Tuple[str, np.ndarray]]:
    """(name, host array in the file's dtype) of every tensor of safetensors file `path`; bfloat16 and fp8 as
    ml_dtypes' types (``safetensors.numpy.load_file`` refuses bfloat16). Raises what safetensors raises for a file
    that is not one."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:  # host arrays: each is placed shard by shard
        for name in f.keys():
            yield name, _get_tensor(f, path, name)


# safetensors dtypes numpy has no type for, read through their bytes as ml_dtypes' types
_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _get_tensor(f, path: str, name: str) -> np.ndarray:
    """Tensor `name` of the open safetensors file `f` (at `path`) as a host array; fp8 tensors (which safetensors'
    numpy reader cannot return: numpy has no fp8 dtype) are mapped from the file as ml_dtypes' float8 arrays."""
    dtype = f.get_slice(name).get_dtype()
    if dtype not in _FP8_DTYPES:
        return f.get_tensor(name)
    header_len, header = _safetensors_header(path)
    info = header[name]
    start, end = info["data_offsets"]
    raw = np.memmap(path, np.uint8, "r", offset=8 + header_len + start, shape=(end - start,))
    return raw.view(_FP8_DTYPES[dtype]).reshape(info["shape"])


@functools.lru_cache(maxsize=64)
def _safetensors_header(path: str) -> Tuple[int, dict]:
    """(header bytes, header) of a safetensors file: an 8-byte little-endian length, then a JSON object mapping
    each tensor to its dtype, shape and data_offsets (relative to the end of the header); the safetensors format."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return n, json.loads(fh.read(n))


def read_checkpoint_tensor(model_config, name: str) -> Optional[np.ndarray]:
    """The host array of the checkpoint tensor `name` (first match in the model's *.safetensors files, in its own
    dtype), None when no file has it: tensors that are not parameters, as an EAGLE-3 head's int64 ``d2t`` map.

    Raises:
        FileNotFoundError: the model directory has no *.safetensors files.
    """
    from safetensors import safe_open

    for path in _safetensors_files(model_config.resolved.hf_dir):
        with safe_open(path, framework="numpy") as f:
            if name in f.keys():
                return _get_tensor(f, path, name)
    return None


def _count_safetensors(model_dir: str) -> int:
    from safetensors import safe_open

    n = 0
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="flax") as f:
            n += len(list(f.keys()))
    return n


def weight_source(model_config, load_format: str):
    """(iterator of (hf_name, array), total count) for the model's checkpoint."""
    from sgl_jax.srt.model_loader.gguf_file import iterate_gguf_tensors
    from sgl_jax.srt.model_loader.gguf_reader import open_gguf

    gguf = model_config.resolved.gguf_file
    fmt = load_format
    if fmt == "auto":
        fmt = "gguf" if gguf else "safetensors"
    if fmt == "gguf":
        if not gguf:
            raise ValueError("--load-format gguf needs a .gguf --model-path")
        reader = open_gguf(gguf)
        quant = getattr(model_config, "quant_checkpoint", None)
        keep = quant is not None and quant.checkpoint == "gguf"
        return iterate_gguf_tensors(gguf, reader, keep_blocks=keep), len(reader.tensors)
    if fmt == "safetensors":
        d = model_config.resolved.hf_dir
        return _iterate_safetensors(d), _count_safetensors(d)
    raise ValueError(f"--load-format {load_format!r} is not a checkpoint format")


# an fp8 KV cache's per-KV-head scales (models/llama.LlamaAttention), 1 where the checkpoint has none
KV_SCALES = (".self_attn.k_scale", ".self_attn.v_scale")
LORA_SLOTS = (".lora_a", ".lora_b")  # LoRA adapter slots (layers/lora.py), zeros at load
_KV_PROJ = tuple(f".{p}.{t}" for p in ("k_proj", "v_proj")
                 for t in ("weight", "bias", "weight_scale", "weight_min")) + KV_SCALES


class _Placer:
    """Host array -> device array in its parameter's sharding (distributed/sharding.py). Only each device's
    shard is transferred (``jax.device_put`` of a host array slices it on the host), so no device ever holds
    a full copy of a sharded tensor. k/v projections get their heads replicated when tp exceeds the KV heads.
    Without a mesh, plain single-device arrays."""

    def __init__(self, model_config, dtype, mesh: Optional[Mesh]):
        self.dtype = np.dtype(dtype)
        self.mesh = mesh
        self.kv_heads = model_config.num_key_value_heads
        tp = 1 if mesh is None else int(mesh.shape["tensor"])
        self.padded_kv_heads = padded_kv_heads(self.kv_heads, tp)
        dp = 1 if mesh is None else int(mesh.shape["data"])
        self.expert_axes = expert_axes(getattr(model_config, "ep_size", 1), tp, dp) if mesh is not None else ()
        self._dummy_fns: dict = {}

    def checkpoint_shape(self, name: str, shape: tuple) -> tuple:
        """The shape the checkpoint has for a parameter of `shape` (k/v projections before replication)."""
        if name.endswith(_KV_PROJ) and self.padded_kv_heads != self.kv_heads:
            return (shape[0] * self.kv_heads // self.padded_kv_heads, *shape[1:])
        return tuple(shape)

    def place(self, name: str, arr, dtype=None) -> jax.Array:
        """`arr` (a host array or a `MappedTensor`) as parameter `name` on the devices, in `dtype` (None: the model
        dtype). A `MappedTensor` is read shard by shard, each device's slice alone and converted alone
        (``jax.make_array_from_callback``), except k/v projections whose heads are replicated past tp."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if isinstance(arr, MappedTensor) and not (name.endswith(_KV_PROJ) and self.padded_kv_heads != self.kv_heads):
            sharding = self.sharding(name, arr.shape)
            if sharding is not None:
                return jax.make_array_from_callback(arr.shape, sharding,
                                                    lambda index: arr[index].astype(dtype, copy=False))
        host = np.asarray(arr).astype(dtype, copy=False)
        if name.endswith(_KV_PROJ):
            host = replicate_kv_rows(host, self.kv_heads, self.padded_kv_heads)
        if self.mesh is None:
            return jnp.asarray(host)
        return jax.device_put(host, self.sharding(name, host.shape))

    def sharding(self, name: str, shape: tuple) -> Optional[NamedSharding]:
        """Parameter `name`'s sharding (distributed/sharding.param_spec) for an array of `shape`; a quantized
        layer's scales or mins are replicated where a split axis does not divide evenly (a row-parallel layer's
        [out, groups] scales with groups not a multiple of tp; any other parameter then fails in device_put,
        naming its shape). None without a mesh."""
        if self.mesh is None:
            return None
        spec = param_spec(name, self.expert_axes, len(shape))
        if not name.endswith(("_scale", "_min")):
            return NamedSharding(self.mesh, spec)
        for dim, axes in zip(shape, spec):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
            if dim % int(np.prod([self.mesh.shape[a] for a in axes])):
                spec = P()
        return NamedSharding(self.mesh, spec)

    def dummy(self, name: str, shape: tuple, seed: int, index: int) -> jax.Array:
        """A random parameter of `shape` made on the devices, each computing only its own shard (no host copy:
        a full-size model's dummy weights take seconds, not the minutes a host RNG needs for 30 B values).
        normal(0, 0.02) from ``fold_in(key(seed), index)``, norms ("*norm.weight") 1; k/v projections drawn
        at the checkpoint's shape and their heads replicated as `place` does. The values depend on `seed` and
        `index` only, not on the mesh (JAX's partitionable threefry)."""
        ones = name.endswith("norm.weight")
        ckpt = self.checkpoint_shape(name, shape)
        kv = name.endswith(_KV_PROJ) and ckpt != shape
        sharding = self.sharding(name, shape)
        key = (ckpt, ones, kv, sharding)
        fn = self._dummy_fns.get(key)
        if fn is None:
            fn = jax.jit(functools.partial(_dummy_value, ckpt, jnp.dtype(self.dtype), ones,
                                           (self.kv_heads, self.padded_kv_heads) if kv else None),
                         out_shardings=sharding)
            self._dummy_fns[key] = fn
        return fn(jnp.uint32(seed), jnp.uint32(index))

    def dummy_quantized(self, name: str, shapes: dict, seed: int, index: int, scheme) -> dict:
        """`dummy`'s random weight for a quantized linear layer, quantized on the devices with `scheme`
        (quantization/methods.QuantScheme): {parameter name: array} for ``name`` (q [out, in]), its
        ``_scale`` and, with mins, ``_min`` (zeros), each in its sharding; `shapes`: those parameters' shapes.
        One compiled function per (shape, scheme, sharding), as `dummy` keeps."""
        shape = shapes[name]
        ckpt = self.checkpoint_shape(name, shape)
        kv = (self.kv_heads, self.padded_kv_heads) if name.endswith(_KV_PROJ) and ckpt != shape else None
        names = tuple(n for n in (name, name + "_scale", name + "_min") if n in shapes)
        shardings = None if self.mesh is None else tuple(self.sharding(n, shapes[n]) for n in names)
        key = (ckpt, kv, shardings, scheme)
        fn = self._dummy_fns.get(key)
        if fn is None:
            def make(seed, index):
                w = _dummy_value(ckpt, jnp.dtype(self.dtype), False, kv, seed, index)
                return quantize_for(w, scheme, jnp)[:len(names)]

            fn = self._dummy_fns[key] = jax.jit(make, out_shardings=shardings)
        return dict(zip(names, fn(jnp.uint32(seed), jnp.uint32(index))))


def _dummy_value(shape, dtype, ones, kv_heads, seed, index):
    """The random tensor `_Placer.dummy` makes (traced under jit; `kv_heads`: (heads, padded) to replicate)."""
    if ones:
        return jnp.ones(shape, dtype)
    x = jax.random.normal(jax.random.fold_in(jax.random.key(seed), index), shape, jnp.float32) * 0.02
    if kv_heads is not None:
        x = replicate_kv_rows(x, *kv_heads)
    return x.astype(dtype)


# a mixture-of-experts checkpoint's per-expert weight ([out, in]) and the stacked parameter it goes into
_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<name>\w+)\.weight$")


class ExpertStacker:
    """Collects a checkpoint's per-expert tensors ``<prefix>.experts.<e>.<name>.weight`` [out, in] into the
    model's stacked parameter ``<prefix>.experts.<name>`` [E, in, out] (layers/moe.py's layout), one host
    buffer per stacked parameter while it fills (in the parameter dtype), handed back once every expert came.

    Args:
        shapes: dotted parameter path -> shape, of the model's parameters.
        dtype: the host buffers' dtype.
    """

    def __init__(self, shapes: dict, dtype):
        self.shapes = shapes
        self.dtype = np.dtype(dtype)
        self.buffers: dict = {}
        self.filled: dict = {}

    def target(self, name: str) -> Optional[str]:
        """The stacked parameter a checkpoint tensor goes into, or None when it is not a per-expert weight of
        this model."""
        m = _EXPERT_WEIGHT.match(name)
        target = f"{m['experts']}.{m['name']}" if m else None
        return target if target in self.shapes else None

    def add(self, name: str, arr) -> Tuple[str, Optional[np.ndarray]]:
        """Put expert tensor `name` in its stacked buffer; returns (stacked name, the full [E, in, out] array once
        every expert has come, else None).

        Raises:
            ValueError: an expert index out of range, a tensor whose transpose has the wrong shape, or an expert
                given twice.
        """
        m = _EXPERT_WEIGHT.match(name)
        target, e = self.target(name), int(m["e"])
        if np.dtype(arr.dtype).itemsize == 1:
            raise ValueError(f"Checkpoint tensor {name} is stored quantized ({np.dtype(arr.dtype)}): pre-quantized "
                             f"mixture-of-experts experts are not served yet; load the float checkpoint with "
                             f"--quantization")
        shape = tuple(self.shapes[target])
        if e >= shape[0] or tuple(arr.shape[::-1]) != shape[1:]:
            raise ValueError(f"Checkpoint tensor {name} has shape {tuple(arr.shape)}: expected expert < {shape[0]} "
                             f"of shape {shape[1:][::-1]}")
        if target not in self.buffers:
            self.buffers[target], self.filled[target] = np.empty(shape, self.dtype), set()
        if e in self.filled[target]:
            raise ValueError(f"Checkpoint tensor {name} appears twice")
        self.buffers[target][e] = np.asarray(arr).T
        self.filled[target].add(e)
        if len(self.filled[target]) < shape[0]:
            return target, None
        del self.filled[target]
        return target, self.buffers.pop(target)


# the token embedding table and the LM head, quantized with ModelConfig.table_quant_scheme
_TABLES = r"(^|\.)(embed_tokens|lm_head)\.weight$"
# the dtypes of a weight stored quantized (HF FP8, compressed-tensors int8)
_QUANTIZED_DTYPES = (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


class _CheckpointQuantization:
    """Turns one checkpoint tensor into the parameters it fills, for quantized linear layers
    (quantization/checkpoint.py):

    - a float weight of a quantized layer: quantized on the host with the layer's scheme (only int8/fp8 values
      and their scales reach the devices);
    - a weight stored quantized (HF FP8, compressed-tensors int8): placed as stored;
    - HF FP8's ``weight_scale_inv`` [ceil(out / bo), in / bi]: the layer's ``weight_scale``, each block row's
      scale repeated for its bo rows ([out, in / bi]);
    - compressed-tensors' ``weight_scale`` [out, 1]: the layer's [out];
    - a GGUF block tensor (gguf_blocks.GroupQuantized): its values, scales and mins.

    Args:
        scheme: the model's QuantScheme (None: not quantized); quant: its ResolvedQuantization (None: a float
            checkpoint); quantized: the quantized layers' weight names; checkpoint_shape: parameter name -> the
            shape its checkpoint tensor has; table_scheme: the token embedding table's and LM head's
            (ModelConfig.table_quant_scheme; None: not quantized).
    """

    def scheme_of(self, name: str):
        """The QuantScheme of quantized parameter `name` (a weight): the tables' or the linear layers'."""
        return self.table_scheme if re.search(_TABLES, name) else self.scheme

    def __init__(self, scheme, quant, quantized: set, checkpoint_shape, table_scheme=None):
        self.scheme = scheme
        self.table_scheme = table_scheme
        self.format = getattr(quant, "checkpoint", None)
        self.block = getattr(quant, "block", None)
        self.quantized = quantized
        self.checkpoint_shape = checkpoint_shape
        self.blocks_kept = self.quantized_here = 0  # layers read as stored blocks / quantized from float here

    def entries(self, name: str, arr) -> list:
        """[(parameter name, host array, dtype to place it in (None: the model dtype))] for checkpoint tensor
        `name`."""
        if name.endswith(KV_SCALES):  # per tensor ([] or [1]) or per KV head ([kv_heads])
            try:
                heads = self.checkpoint_shape(name)
            except KeyError:  # no fp8 KV cache: no scale parameters
                return [(name, arr, None)]
            a = np.asarray(arr, np.float32).reshape(-1)
            return [(name, np.full(heads, a[0], np.float32) if a.size == 1 else a, np.float32)]
        if isinstance(arr, GroupQuantized):
            self.blocks_kept += 1
            out = [(name, arr.q, np.int8), (name + "_scale", arr.scale, np.float32)]
            if self.scheme.with_min:
                out.append((name + "_min", np.zeros_like(arr.scale) if arr.minimum is None else arr.minimum,
                            np.float32))
            return out
        if self.format == "fp8" and name.endswith(".weight_scale_inv"):
            target = name[:-len("_inv")]
            if target[:-len("_scale")] in self.quantized:
                rows = self.checkpoint_shape(target)[0]
                return [(target, np.repeat(np.asarray(arr, np.float32), self.block[0], axis=0)[:rows], np.float32)]
        if self.format == "compressed-tensors" and name.endswith(".weight_scale") and np.ndim(arr) == 2:
            return [(name, np.asarray(arr, np.float32).reshape(-1), np.float32)]
        if name not in self.quantized:
            stored_quantized = name.endswith(".weight") and np.dtype(arr.dtype) in _QUANTIZED_DTYPES
            if stored_quantized or name.endswith((".weight_scale", ".weight_scale_inv")):
                raise ValueError(f"Checkpoint tensor {name} ({np.dtype(arr.dtype)}) belongs to a layer sgl-jax "
                                 f"serves unquantized (embedding, LM head, router, ...): it cannot be loaded "
                                 f"without its scales")
            return [(name, arr, None)]
        scheme = self.scheme_of(name)
        if np.dtype(arr.dtype) == get_method(scheme.method).weight_dtype:  # stored quantized: scales come apart
            return [(name, arr, arr.dtype)]
        self.quantized_here += 1
        q, *scales = quantize_for(np.asarray(arr, np.float32), scheme)
        return [(name, q, q.dtype)] + [(name + suffix, a, np.float32) for suffix, a in zip(("_scale", "_min"), scales)]


class CheckpointPlacer:
    """Checkpoint tensors -> the device arrays of the parameters they fill, each in its sharding: the loader's
    per-tensor path (a decoder stack saved alone gets ``model.``; per-expert tensors are stacked, `ExpertStacker`;
    quantized layers are quantized or read as stored, `_CheckpointQuantization`; k/v heads replicated past tp,
    `_Placer`). Used at load and by weight updates (model_executor/weight_update.py).

    Args:
        model_config: `ModelConfig` (dtype, quantization, KV heads).
        shapes: parameter name -> its shape in the model.
        mesh: the device mesh (None: one device).
        placer, quant: the `_Placer` and `_CheckpointQuantization` to use (None: new ones).

    Attributes:
        values: parameter name -> device array, filled by `add`.
        ignored: checkpoint tensors that match no parameter.
    """

    def __init__(self, model_config, shapes: dict, mesh: Optional[Mesh], placer=None, quant=None):
        dtype = JNP_DTYPES[model_config.dtype]
        self.placer = placer or _Placer(model_config, dtype, mesh)
        self.shapes = shapes
        self.quant = quant or _CheckpointQuantization(
            getattr(model_config, "quant_scheme", None), getattr(model_config, "quant_checkpoint", None),
            {n for n in shapes if n + "_scale" in shapes}, lambda n: self.placer.checkpoint_shape(n, shapes[n]),
            getattr(model_config, "table_quant_scheme", None))
        self.stacker = ExpertStacker(shapes, dtype)
        self.values: Dict[str, jax.Array] = {}
        self.ignored: List[str] = []

    def add(self, name: str, arr) -> None:
        """Place checkpoint tensor `name` (a host array). Raises ValueError when its shape is not the one the
        model expects (naming both)."""
        if name not in self.shapes and "model." + name in self.shapes:  # a decoder stack saved alone (LlamaModel)
            name = "model." + name
        if name not in self.shapes and self.stacker.target(name) is not None:  # one expert of a stacked parameter
            name, arr = self.stacker.add(name, arr)
            if arr is None:
                return
        for target, host, host_dtype in self.quant.entries(name, arr):
            if target not in self.shapes:  # (then none of its entries is: a quantized tensor's scales neither)
                self.ignored.append(name)
                return
            expected = self.placer.checkpoint_shape(target, self.shapes[target])
            if tuple(host.shape) != expected:
                raise ValueError(f"Checkpoint tensor {name} has shape {tuple(host.shape)}, model expects "
                                 f"{expected}")
            self.values[target] = self.placer.place(target, host, host_dtype)


def load_model(model_config, load_format: str = "auto", seed: int = 0, mesh: Optional[Mesh] = None):
    """Instantiate the model for ``model_config.architecture`` and load its weights.

    Args:
        model_config: `ModelConfig` (its ``dtype`` picks the parameter dtype).
        load_format: "auto" | "gguf" | "safetensors" | "dummy" (random normal(0, 0.02) weights, norms 1).
        seed: randomness for dummy weights.
        mesh: the device mesh; each parameter is placed in its sharding straight from host memory.
    Returns:
        (graphdef, params): the NNX graph definition and a State of device arrays.
    Raises:
        ValueError: a checkpoint tensor has the wrong shape, or a parameter has no tensor.

    The host arrays of the load are made without transparent huge pages (host_pages.py: the kernel's compaction
    for them made loads 1.5-4.5x slower).
    """
    with numpy_hugepages(False):
        return _load_model(model_config, load_format, seed, mesh)


def _load_model(model_config, load_format: str, seed: int, mesh: Optional[Mesh]):
    cls = get_model_class(model_config.architecture, getattr(model_config, "is_embedding", False))
    dtype = JNP_DTYPES[model_config.dtype]
    abstract = nnx.eval_shape(lambda: cls(model_config, dtype=dtype, rngs=None, mesh=mesh))  # (shapes only)
    graphdef, abstract_state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(abstract_state))
    by_name = {_path_name(path): (i, var) for i, (path, var) in enumerate(flat)}
    placer = _Placer(model_config, dtype, mesh)
    scheme = getattr(model_config, "quant_scheme", None)
    quantized = {n for n in by_name if n + "_scale" in by_name}  # quantized layers' weights (layers/linear.py)
    shapes = {n: tuple(v.get_value().shape) for n, (_, v) in by_name.items()}
    values = {}

    quant = _CheckpointQuantization(scheme, getattr(model_config, "quant_checkpoint", None), quantized,
                                    lambda n: placer.checkpoint_shape(n, shapes[n]),
                                    getattr(model_config, "table_quant_scheme", None))
    if load_format == "dummy":
        # a tensor's randomness is indexed among the unquantized model's parameters (scales are not counted), so
        # a quantized model's dummy weights are the unquantized model's, quantized
        # (an fp8 KV cache's scales are not drawn: they are 1, filled below)
        tensors = [n for n in by_name if (n in quantized or re.sub(r"_(scale|min)$", "", n) not in quantized)
                   and not n.endswith(KV_SCALES + LORA_SLOTS)]
        for i, name in enumerate(tqdm(tensors, desc="Initializing dummy weights", unit="tensor")):
            if name in quantized:
                values.update(placer.dummy_quantized(name, shapes, seed, i, quant.scheme_of(name)))
            else:
                values[name] = placer.dummy(name, shapes[name], seed, i)
    else:
        source, total = weight_source(model_config, load_format)
        writer = CheckpointPlacer(model_config, shapes, mesh, placer=placer, quant=quant)
        for name, arr in tqdm(source, total=total, desc="Loading weights", unit="tensor"):
            writer.add(name, arr)
        values = writer.values
        if writer.ignored:
            logger.info("%d checkpoint tensors match no parameter of %s and are not loaded, e.g. %s",
                        len(writer.ignored), cls.__name__, ", ".join(writer.ignored[:4]))
        if quant.format == "gguf":
            logger.info("--quantization gguf: %d linear layers kept as the file's Q8_0 / Q4_0 / Q4_1 blocks, %d of "
                        "other types quantized to int8 groups of 32 from their float values", quant.blocks_kept,
                        quant.quantized_here)
    unscaled = [n for n in by_name if n.endswith(KV_SCALES) and n not in values]
    if unscaled:
        logger.info("fp8 KV cache: the checkpoint has no k_scale / v_scale for %d layers; scale 1 (saturating)",
                    len(unscaled) // 2)
        for n in unscaled:
            values[n] = placer.place(n, np.ones(placer.checkpoint_shape(n, shapes[n]), np.float32), np.float32)
    for n in by_name:  # LoRA adapter slots (layers/lora.py): empty until an adapter is written into one
        if n.endswith(LORA_SLOTS) and n not in values:
            values[n] = placer.place(n, np.zeros(shapes[n], np.float32))
    missing = [n for n in by_name if n not in values]
    if missing:
        raise ValueError(f"Checkpoint has no tensors for {len(missing)} parameters, e.g. {missing[:5]}")
    new_flat = [(path, var.replace(values[_path_name(path)])) for path, var in flat]
    params = nnx.from_flat_state(new_flat)
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    tables = [n for n in quantized if re.search(_TABLES, n)]
    quant = f", {len(quantized) - len(tables)} linear layers quantized {model_config.quantization}" if quantized else ""
    if tables:
        quant += f" and the token table{'s' if len(tables) > 1 else ''} int8 in groups of " \
                 f"{model_config.table_quant_scheme.group_size} (quantization/methods.table_scheme)"
    logger.info("Loaded %s: %.1fM parameters in %s%s", model_config.architecture, n_params / 1e6, model_config.dtype,
                quant)
    return graphdef, params
