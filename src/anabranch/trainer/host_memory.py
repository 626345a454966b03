"""Keep freed host memory in the process for reuse (glibc malloc), for training on CPU.

torch's CPU allocator is plain ``malloc``/``free``. glibc gives the top of its heap back to the OS
once more than its trim threshold is free there (by default twice the mmap threshold, which adapts
up to 32 MiB). An RL update on CPU frees gigabytes of activations at the end of every backward pass
(a SmolLM2 W1 update: about 2.6 GB over 30 layers), so glibc trims them away and the next step
faults every page in again, the kernel zeroing each one first: about 1.2 million page faults per
SmolLM2 update on the 2-core development VMs.

``keep_freed_host_memory`` sets two documented ``mallopt`` parameters: the mmap threshold fixed at
its largest value, 32 MiB (blocks up to that size come from the heap; larger ones keep their own
mapping, so a huge block is never split up by small allocations), and ``M_TRIM_THRESHOLD = -1``
(the heap is never trimmed). A block freed in one step is then reused by the next without a fault.
The price: the process keeps its peak heap until it exits, so its RSS no longer falls between
steps. Blocks above 32 MiB still come and go with the OS; the largest of the step's own (the LM
head's logits buffer) is kept by :mod:`anabranch.models.fused_head`. Preloading jemalloc or
tcmalloc does the same job more thoroughly; the setting is then harmless. Off with
``trainer.keep_freed_host_memory=false``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2); mallopt refuses more.
MMAP_THRESHOLD = 32 * 2**20

_applied = False


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # mallopt exists in musl too, but as a stub; gnu_get_libc_version marks glibc.
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep and reuse freed memory; True if this process now does."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; -1 for the trim threshold means "never trim" (mallopt(3)).
    _applied = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                and libc.mallopt(M_TRIM_THRESHOLD, -1) == 1)
    return _applied
