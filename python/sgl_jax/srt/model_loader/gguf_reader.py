"""A GGUF file's metadata and tensor table, read in well under a second.

`gguf.GGUFReader` builds numpy views for every element of every metadata array, which takes 10-20 s for a
262k-token vocabulary (three such arrays: tokens, scores, token types). This reader parses the same layout
(GGUF spec v2/v3, little-endian: header, key/value pairs, tensor infos, aligned tensor data) with plain
`struct` for strings and `numpy.frombuffer` for numeric arrays, and memory-maps the tensor data. Tensor
bytes are handed to `gguf.quants.dequantize` unchanged, so dequantized values are the same as through
`GGUFReader`.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Dict, List, Tuple

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # the spec's default for general.alignment

# GGUF value types (gguf-py GGUFValueType) -> struct format of one scalar
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass
class GGUFTensor:
    """One tensor: its GGUF name, `gguf.GGMLQuantizationType`, numpy-order shape (the reverse of GGUF's
    dims: [out, in] for a projection) and its raw bytes (a read-only memory map)."""

    name: str
    tensor_type: Any
    shape: Tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """The parsed file: ``metadata`` (key -> int/float/bool/str, a list of str for string arrays, a numpy
    array for numeric ones) and ``tensors`` (in file order).

    Raises:
        ValueError: not a GGUF file, or a version / byte order this reader does not handle (v1, big-endian).
    """

    def __init__(self, path: str):
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._buf)
        self._pos = 0
        if bytes(self._view[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (or big-endian byte order) is not supported")
        n_tensors, n_kv = self._scalar("Q"), self._scalar("Q")
        self.metadata: Dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
            infos.append((name, dims, self._scalar("I"), self._scalar("Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: List[GGUFTensor] = [self._tensor(data_start, *info) for info in infos]

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self._view, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        s = str(self._view[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            return self._scalar(_SCALAR_FORMATS[vtype])
        etype, count = self._scalar("I"), self._scalar("Q")
        if etype in (_STRING, _ARRAY):
            return [self._value(etype) for _ in range(count)]
        dtype = np.dtype("<" + _SCALAR_FORMATS[etype])
        arr = np.frombuffer(self._view, dtype=dtype, count=count, offset=self._pos)
        self._pos += count * dtype.itemsize
        return arr

    def _tensor(self, data_start: int, name: str, dims: List[int], ggml_type: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block_size * type_size
        start = data_start + offset
        return GGUFTensor(name, qtype, tuple(int(d) for d in reversed(dims)), self._buf[start:start + n_bytes])


def open_gguf(path: str) -> GGUFFile:
    """Parse the GGUF file at `path` (see `GGUFFile`)."""
    return GGUFFile(path)
