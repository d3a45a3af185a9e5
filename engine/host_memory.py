"""Keep freed activation buffers inside the process (glibc ``malloc`` tuning for CPU serving).

On the CPU every activation of a forward (a 2,400-token prefill allocates ~80 MB per layer:
qkv, gate_up, ...) comes from ``malloc``. glibc serves large blocks with fresh ``mmap`` pages
and gives freed memory at the top of the heap back to the kernel (``trim``), so the next step
page-faults and zeroes the same megabytes again. PyTorch's CPU performance guide and vLLM's CPU
backend recommend jemalloc or tcmalloc for this reason; with glibc the same effect is three
``mallopt`` settings: serve blocks up to 32 MiB from the heap (``M_MMAP_THRESHOLD``), never trim
the heap (``M_TRIM_THRESHOLD = -1``) and grow it 64 MiB at a time (``M_TOP_PAD``). Measured on the
c=32 burst (docs/performance.md, section 3.6): the first (2,455-token) prefill step 5.2-6.0 s -> 4.3-4.5 s.

The cost: the process keeps its peak heap instead of returning it, as a server that preallocates
would. The settings are process-wide (anything else running in the process, e.g. the HF peers
of a multirun, gets them too) and only exist for glibc: elsewhere :func:`keep_freed_memory`
reports False and changes nothing.

:func:`huge_page_empty` is the other host-memory setting, for the weights a decode step streams:
a buffer on 2 MiB-aligned memory advised as transparent huge pages (``madvise(MADV_HUGEPAGE)``;
the kernel's THP mode ``madvise`` or ``always``), so a 538 MB stream of packed weights crosses
~270 pages instead of ~131,000 and the TLB stops missing on every 4 KiB (docs/performance.md,
section 3.3).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

import torch

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, -1), (_M_TOP_PAD, 64 << 20))


def keep_freed_memory() -> bool:
    """Apply the settings above; True if glibc accepted all of them."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return all(libc.mallopt(option, value) == 1 for option, value in _SETTINGS)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


def huge_page_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``numel`` elements of ``dtype`` starting on a 2 MiB boundary, its
    memory advised as transparent huge pages before first touch (Linux); elsewhere, or if the
    kernel refuses the advice, the same tensor on ordinary pages. Costs up to 2 MiB of slack."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(numel + _HUGE_PAGE // size, dtype=dtype)
    start = (-raw.data_ptr()) % _HUGE_PAGE // size
    tensor = raw[start : start + numel]  # a view: keeps the whole allocation alive
    if platform.system() == "Linux" and numel > 0:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(tensor.data_ptr(), numel * size, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return tensor
