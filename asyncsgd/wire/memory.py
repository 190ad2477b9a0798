"""Keep large freed buffers in the process instead of returning them to the OS.

glibc serves large allocations (libzmq's 4 MiB message buffers, tensors) with
fresh mmaps and trims freed heap back to the kernel. On this kind of VM the
host reclaims freed pages and touching new ones runs at ~0.8 GB/s instead of
~6 GB/s, so every message paid for page faults: a 40 MiB push+pull took
115 ms instead of 60 ms. Raising the mmap and trim thresholds makes glibc
reuse the same heap memory message after message. (Equivalent to the
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables.)
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory(mmap_threshold: int = 128 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Tune glibc malloc for reuse of big buffers; False where it is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = all(libc.mallopt(opt, val) == 1 for opt, val in (
            (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_TOP_PAD, 64 << 20)))
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt refused a setting; keeping glibc's defaults")
    return ok
