"""The gateway's allocator setting (common/malloc.py tune_malloc): buffers of a trace's size go back to
the system when freed, where glibc's default keeps them in a heap that does not shrink."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# In a fresh interpreter: free one 8 MiB buffer (glibc's default then raises its mmap threshold above
# 1 MiB), allocate 64 MiB in 1 MiB buffers interleaved with 40 KB ones that stay alive, free the big
# ones, and print how much of the 64 MiB is still resident.
PROBE = """
import sys
from tether.common.malloc import tune_malloc

def rss_mib():
    # smaps_rollup walks the page tables: exact, where /proc/self/status's VmRSS sums per-CPU counters
    # that may lag (CI once read 14 MiB retained of the 64 through it on a loaded box).
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Rss:"):
            return int(line.split()[1]) / 1024

if sys.argv[1] == "tuned":
    assert tune_malloc()
freed = b"\\x01" * (8 << 20)
del freed
before = rss_mib()
big, kept = [], []
for i in range(64):
    big.append(b"\\x01" * (1 << 20))
    kept.append(b"\\x02" * (40_000 + i))
del big
print(rss_mib() - before)
"""


def retained_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


def test_freed_trace_sized_buffers_leave_the_process():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("tune_malloc sets glibc's allocator only")
    default, tuned = retained_mib("default"), retained_mib("tuned")
    assert tuned < 8, tuned
    # The probe shows growth the setting removes. Alone, glibc's default keeps 60+ of the 64 MiB; twice
    # in a whole `make test` run it kept only 14 (cause not found: not the environment, not the counter),
    # so the baseline asks for a clear difference, not a figure.
    assert default > tuned + 8, (default, tuned)
