"""The C heap on the CPU: its free pages given back after a load, its large blocks kept.

glibc's malloc keeps what a program frees for its next allocations. A load leaves a lot of
it behind: building a tokenizer (transformers' pickled snapshot or its JSON: a 262k-token
vocabulary's strings, maps and the text they were parsed from), a GGUF's conversion and the
weights' repacking. A server does not allocate that much at once again, so the pages only sit
in its resident memory (Gemma-3-270M's tokenizer: 0.44 GB resident, 0.25 GB after a trim,
in each of the server's two processes). `malloc_trim(0)` returns them. Torch-free: the HTTP
process calls it too.

The other way round during steps: glibc serves a block over its mmap threshold (dynamic, at
most 32 MB) as fresh pages from the system and unmaps it on free, so every step that allocates
one page-faults it in again (about 3 us a 4 KB page, the zeroing included). A prefill's MLP
intermediates are such blocks, so an engine on the CPU has malloc serve blocks up to
`HELD_BLOCK_BYTES` from its heap and keep as much freed at the heap's top (`hold_large_blocks`):
a step reuses the previous step's pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Blocks up to this size come from the heap once held; the freed heap kept at its top is as large
# (only what steps used: their peak)
HELD_BLOCK_BYTES = 512 << 20
# The largest block a step should allocate for a temporary such as the MLP's gate_up output: a
# quarter of the held size (an fp32 stored-block step makes blocks twice that: its second
# activation codes are rows of their own), or, where malloc's defaults rule, half its largest
# dynamic mmap threshold
_GLIBC_BLOCK_BYTES = 16 << 20
_block_budget = _GLIBC_BLOCK_BYTES


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def hold_large_blocks() -> bool:
    """Have malloc serve blocks up to HELD_BLOCK_BYTES from its heap and keep as much freed at
    its top (no fresh pages each step); False where the C library has no such settings."""
    global _block_budget
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (
        mallopt(M_MMAP_THRESHOLD, HELD_BLOCK_BYTES) and mallopt(M_TRIM_THRESHOLD, HELD_BLOCK_BYTES)
    ):
        return False
    _block_budget = HELD_BLOCK_BYTES // 4
    return True


def block_budget() -> int:
    """The largest block a step should allocate at once for a temporary (bytes) without
    page-faulting it in again each step: a long prefill's MLP runs in slices of rows within it."""
    return _block_budget
