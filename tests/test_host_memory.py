"""trainer/host_memory.py: freed blocks are reused without page faults once the setting is on."""

import subprocess
import sys

import pytest

from anabranch.trainer.host_memory import _glibc

# A fresh interpreter (the setting is process-wide). One round is what a training step does to the
# heap: 16 activation-sized blocks of 16 MiB allocated (malloc, as torch's CPU allocator does) and
# written, then all freed. Counted: the minor page faults of rounds 4 to 8. The blocks come straight
# from libc so that no other allocation lands between them and the top of the heap.
PROBE = r"""
import ctypes, resource, sys
from anabranch.trainer.host_memory import _glibc, keep_freed_host_memory
if sys.argv[1] == "on":
    assert keep_freed_host_memory()
libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
SIZE = 16 * 2**20
def round_():
    blocks = [libc.malloc(SIZE) for _ in range(16)]
    for b in blocks:
        libc.memset(b, 1, SIZE)
    for b in blocks:
        libc.free(b)
for _ in range(3):
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

PAGES_PER_ROUND = 16 * 16 * 2**20 // 4096  # 65,536 4-KiB pages


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt is needed (Linux with glibc)")
def test_freed_blocks_are_reused_without_page_faults():
    # Default glibc: the freed blocks are unmapped or trimmed off the heap's top, and every round
    # faults them in again (huge pages could lower the count: a quarter of the pages is required).
    assert faults("off") > 5 * PAGES_PER_ROUND // 4
    # Kept: the freed blocks are reused; five rounds fault in less than a quarter of one.
    assert faults("on") < PAGES_PER_ROUND // 4
