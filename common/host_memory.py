"""Giving freed heap memory back to the OS after large transient buffers.

glibc's malloc raises its mmap threshold after a large block is freed, so later
blocks of that size come from the heap, and freed heap memory in the middle of
it stays in the process: a device that saves its cache every few seconds would
see its RSS climb by several model sizes and stay there.  `malloc_trim(0)`
returns those pages; the cost is one walk of the heap, so it is called after
rare, large events (a save), not per step.  Elsewhere (musl, macOS) this does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.lru_cache(maxsize=1)
def _trim() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> bool:
    """Return free heap pages to the OS; True if the C library could."""
    trim = _trim()
    if trim is None:
        return False
    trim(0)  # type: ignore[operator]
    return True
