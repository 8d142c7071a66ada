"""glibc's allocator, set so that resident memory tracks what is live."""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def tune_malloc(threshold_bytes: int = 128 * 1024) -> bool:
    """Serve every allocation of `threshold_bytes` or more from a mapping of its own, given back to the
    system when freed. glibc raises its mmap threshold once it frees such an allocation and from then
    on carves them out of the heap, which fragments and does not shrink. A fixed threshold (which also ends glibc's adjusting it) keeps resident memory what is live:
    the gateway's trace buffers (up to hundreds of KiB each; under bench/gateway_load its resident
    memory grew by tens of MiB a minute without it), and the activation probes' tensors
    (tests/activation_memory.py: a step's peak, not the heap an earlier step left behind). False where
    the C library has no glibc mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1)
