"""A GGUF file's metadata and tensor table, read in one pass over its header, with the tensors' data as
views of one memory map. The `gguf` package's reader builds a numpy view for every part of every
field: 1.7 s for the 49k-token vocabulary and 48k merges of the default model's tokenizer, longer
than the rest of loading a 1B model; this takes about 0.1 s.

Format (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count; metadata as (key,
type, value); tensor infos as (name, dims, type, offset); the data after the header, aligned to
general.alignment (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# metadata value types: struct format of the scalars; 8 string, 9 array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
FLOAT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: ne0 (the row length) first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # [rows, row bytes] uint8 for block types, else the values [.., ne1, ne0]
    n_bytes: int
    start: int  # its first byte in the file


class GgufFile:
    """`values`: metadata key -> value (a list for arrays); `kinds`: key -> its GGUF value type
    (GGUFValueType's number: what a writer copying the key needs); `tensors` in the file's order."""

    def __init__(self, path: Path):
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        self._buffer, self._at = memoryview(raw.data), 0
        if bytes(self._buffer[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        self._at = 4
        version, n_tensors, n_values = self._take("I"), self._take("Q"), self._take("Q")
        if version < 2:
            raise ValueError(f"GGUF version {version} (2 or later is read)")
        self.values: dict[str, Any] = {}
        self.kinds: dict[str, int] = {}
        for _ in range(n_values):
            key = self._string()
            self.kinds[key] = self._take("I")
            self.values[key] = self._value(self.kinds[key])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._take("Q") for _ in range(self._take("I")))
            infos.append((name, dims, GGMLQuantizationType(self._take("I")), self._take("Q")))
        alignment = int(self.values.get("general.alignment", 32))
        start = -(-self._at // alignment) * alignment
        self._buffer.release()  # the tensors hold the map; nothing else does once they are gone
        self._map: mmap.mmap = raw._mmap  # type: ignore[attr-defined]
        self.tensors = [self._tensor(raw, start, *info) for info in infos]

    def drop_pages(self, tensor: GgufTensor) -> None:
        """Unmap the tensor's pages from this process once its data was copied: they count in its
        resident memory while mapped (a 7B load peaked at the file's size twice). The map stays
        valid: a later read faults them in again from the page cache."""
        page = mmap.PAGESIZE
        first = tensor.start // page * page
        self._map.madvise(mmap.MADV_DONTNEED, first, tensor.start + tensor.n_bytes - first)

    def _take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self._buffer, self._at)[0]
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._take("Q")
        text = bytes(self._buffer[self._at : self._at + n]).decode("utf-8", errors="replace")
        self._at += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self._take(SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._take("I"), self._take("Q")
            if item in SCALARS:  # numbers: one read
                fmt = f"<{count}{SCALARS[item]}"
                items = list(struct.unpack_from(fmt, self._buffer, self._at))
                self._at += struct.calcsize(fmt)
                return items
            return [self._value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata type {kind}")

    @staticmethod
    def _tensor(
        raw: np.ndarray, start: int, name: str, dims: tuple[int, ...], kind, offset: int
    ) -> GgufTensor:
        block, size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(dims))
        n_bytes = count // block * size
        data = raw[start + offset : start + offset + n_bytes]
        if len(data) != n_bytes:
            raise ValueError(f"tensor {name} runs past the end of the file")
        shape = tuple(reversed(dims))
        if kind in FLOAT_DTYPES:
            values = data.view(FLOAT_DTYPES[kind]).reshape(shape)
        else:
            values = data.reshape(count // dims[0], dims[0] // block * size)
        return GgufTensor(name, dims, kind, values, n_bytes, start + offset)
