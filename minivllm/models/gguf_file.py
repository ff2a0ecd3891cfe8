"""A GGUF file opened for loading: its metadata, its tensor table, its tensors memory-mapped.

The format (llama.cpp's `gguf.md`): a header (magic `GGUF`, version, tensor and key counts),
key/value metadata, a table of tensors (name, dimensions innermost first, ggml type, offset),
then the tensor data, aligned. `open_gguf` reads the header and the table with `struct` on a
memory map: gguf-py's `GGUFReader` builds a Python object for every string of the tokenizer's
vocabulary first, which costs seconds at every start; here string arrays are only skipped
(the tokenizer is rebuilt once, by transformers, and cached: `minivllm.models.gguf`).

Nothing is copied: a tensor's `data` is a read-only view of the mapped file, in gguf-py's
conventions (float types as arrays of their dtype in row-major shape, the others as bytes
`[..., bytes per row]`), so the pages are read when a kernel first touches them and are shared
with the page cache.

Every check that a file is whole and sane happens here, and each failure is one
`GGUFFileError` naming the file and what is wrong (bytes expected against bytes present, the
unknown type id, the byte where the header stopped making sense).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value type id -> struct format of a scalar (8: string, 9: array are read apart)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# Numeric arrays come back as lists up to this length; longer ones (a tokenizer's scores and
# token types) are skipped: nothing the engine reads from the metadata is that long.
_MAX_ARRAY_ITEMS = 4096
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


class GGUFFileError(ValueError):
    """A GGUF file that is truncated, corrupt, or of a kind we cannot read; the message names
    the file and what is wrong."""


@dataclass
class GGUFTensor:
    """One entry of the tensor table: `shape` innermost dimension first, as GGUF lists it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    n_bytes: int
    buffer: Any  # the mapped file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @cached_property
    def data(self) -> np.ndarray:
        """The stored values, read-only and uncopied: float types `[..., ne0]` in their
        dtype, every other type `[..., bytes per row]` uint8."""
        raw = np.frombuffer(self.buffer, dtype=np.uint8, count=self.n_bytes, offset=self.offset)
        dims = tuple(reversed(self.shape))
        if self.tensor_type in _FLOAT_DTYPES:
            return raw.view(_FLOAT_DTYPES[self.tensor_type]).reshape(dims)
        block, block_bytes = GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * block_bytes)


class _Cursor:
    """Reads the header's little-endian fields in order, with the file's name in every error."""

    def __init__(self, buffer: Any, path: Path) -> None:
        self.buffer, self.path, self.pos = buffer, path, 0
        self.size = len(buffer)

    def fail(self, what: str) -> GGUFFileError:
        return GGUFFileError(f"{self.path}: {what}")

    def take(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        if self.pos + width > self.size:
            raise self.fail(
                f"the header ends at byte {self.size} while reading byte "
                f"{self.pos} (the file is truncated)"
            )
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += width
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.pos + length > self.size:
            raise self.fail(
                f"a string of {length} bytes at byte {self.pos} runs past the end "
                f"of the file ({self.size} bytes): truncated or corrupt header"
            )
        raw = bytes(self.buffer[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(
                f"a string at byte {self.pos - length} is not UTF-8: corrupt header"
            ) from error

    def value(self, type_id: int, key: str) -> Any:
        if type_id in _SCALARS:
            return self.take(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array(key)
        raise self.fail(
            f"metadata key {key!r} has unknown value type {type_id} "
            f"(byte {self.pos}): corrupt header"
        )

    def array(self, key: str) -> Any:
        item_type, count = self.take("<I"), self.take("<Q")
        if item_type in _SCALARS:
            width = struct.calcsize(_SCALARS[item_type])
            if self.pos + count * width > self.size:
                raise self.fail(
                    f"metadata array {key!r} of {count} items runs past the end "
                    f"of the file: truncated or corrupt header"
                )
            start, self.pos = self.pos, self.pos + count * width
            if count > _MAX_ARRAY_ITEMS:
                return None
            dtype = np.dtype(_SCALARS[item_type].replace("?", "b1"))
            return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start).tolist()
        if item_type == _STRING:
            if count > _MAX_ARRAY_ITEMS:  # a vocabulary: skip it, string by string
                self.pos = self._skip_strings(count, key)
                return None
            return [self.string() for _ in range(count)]
        if item_type == _ARRAY:
            return [self.array(key) for _ in range(count)]
        raise self.fail(f"metadata array {key!r} has unknown item type {item_type}: corrupt header")

    def _skip_strings(self, count: int, key: str) -> int:
        """Where `count` length-prefixed strings from `pos` end. One unpack a string, not a
        checked `take`: Qwen2.5's 152k tokens and 151k merges took 0.05 s of the 0.09 of
        reading its header that way, which each start of an engine does twice."""
        length_at, pos, end = struct.Struct("<Q").unpack_from, self.pos, self.size - 8
        for _ in range(count):
            if pos > end:
                break
            pos += 8 + length_at(self.buffer, pos)[0]
        else:
            if pos <= self.size:
                return pos
        raise self.fail(
            f"metadata array {key!r} runs past the end of the file: truncated or corrupt header"
        )


class GGUFFile:
    """An opened GGUF file: `metadata` (key -> value; arrays longer than a few thousand items,
    such as the vocabulary, are None), `tensors` (the table, in file order, with views of the
    data) and `by_name`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFFileError(f"{self.path}: {size} bytes is too short for a GGUF header")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        cursor = _Cursor(self._map, self.path)
        magic = bytes(self._map[:4])
        if magic != MAGIC:
            raise GGUFFileError(
                f"{self.path}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r})"
            )
        cursor.pos = 4
        self.version = cursor.take("<I")
        if self.version not in (2, 3):
            raise GGUFFileError(
                f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)"
            )
        n_tensors, n_kv = cursor.take("<Q"), cursor.take("<Q")
        if n_tensors > size or n_kv > size:
            raise GGUFFileError(
                f"{self.path}: the header claims {n_tensors} tensors and "
                f"{n_kv} metadata keys in {size} bytes: corrupt header"
            )
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.take("<I"), key)
        self.tensors = self._read_table(cursor, n_tensors)
        self.by_name = {t.name: t for t in self.tensors}

    def _read_table(self, cursor: _Cursor, count: int) -> list[GGUFTensor]:
        entries = []
        for _ in range(count):
            name = cursor.string()
            n_dims = cursor.take("<I")
            if not 1 <= n_dims <= 4:
                raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions: corrupt header")
            shape = tuple(cursor.take("<Q") for _ in range(n_dims))
            type_id, offset = cursor.take("<I"), cursor.take("<Q")
            entries.append((name, shape, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        return [self._tensor(data_start, *entry) for entry in entries]

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], type_id: int, offset: int
    ) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFileError(
                f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}"
            ) from None
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        if 0 in shape:
            raise GGUFFileError(
                f"{self.path}: tensor {name!r} has shape {list(shape)}, with an "
                "empty dimension: corrupt tensor table"
            )
        if shape[0] % block:
            raise GGUFFileError(
                f"{self.path}: tensor {name!r} ({tensor_type.name}) has rows of "
                f"{shape[0]} values, not a multiple of its block of {block}"
            )
        n_bytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
        start = data_start + offset
        if start + n_bytes > self.size:
            raise GGUFFileError(
                f"{self.path}: tensor {name!r} needs {n_bytes} bytes at offset {start}, but "
                f"the file ends at byte {self.size} ({start + n_bytes - self.size} bytes "
                "missing: the file is truncated)"
            )
        return GGUFTensor(name, tensor_type, shape, start, n_bytes, self._map)

    @property
    def n_bytes(self) -> int:
        """The bytes of all tensors (what the weights take when every page is touched)."""
        return sum(t.n_bytes for t in self.tensors)

    def addresses(self) -> range:
        """The addresses the file is mapped at: a tensor whose memory lies in them is the
        file's own pages (shared with the page cache, not a copy)."""
        start = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data
        return range(start, start + self.size)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident set (they stay in the OS page
        cache): after a load, the tensors copied into the model need none, and those used as
        stored fault theirs back in on first use. A no-op where madvise is not offered."""
        if hasattr(mmap, "MADV_DONTNEED") and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def release_tensor_pages(self, tensor: GGUFTensor) -> None:
        """`release_pages` for one tensor's bytes (whole pages around them; a neighbour's
        page dropped too only faults back in): for a tensor copied while loading, so that the
        file's pages and the copy are not resident together until the load ends."""
        if hasattr(mmap, "MADV_DONTNEED") and hasattr(self._map, "madvise"):
            start = tensor.offset - tensor.offset % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, start, tensor.offset + tensor.n_bytes - start)
