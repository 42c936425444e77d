"""Device-side waits on page-locked host memory: the CUDA driver's stream memory operations
(``cuStreamWaitValue32``, the V2 API, available by default on every platform since CUDA
11.7; CUDA driver API, "Stream Memory Operations").

What for: the mask workers write a step's tree bitmask into a page-locked shared slab and
then a per-worker flag word (:mod:`structspec.grammar.deferred_build`). A copy stream that
waits on those flags before it uploads the slab lets the host queue the upload and the post
graph at once, instead of first waiting for every worker's reply: the GPU starts the post
graph as soon as the last worker has written its rows, and the host's wait for the replies
leaves the step's critical path.

Only the pieces that need the driver live here; the queueing order (flags, then the copy,
then the consumer's event) is :func:`structspec.staging.upload_pinned_gated`'s.

Warning (the driver's): a stream waiting on a value that is never written waits forever, and
everything ordered after it with it. Whoever queues a wait owns releasing its flag, on
every path (the deferred build's failure path writes the flags itself).
"""

from __future__ import annotations

import ctypes
import threading

import torch

#: ``CU_STREAM_WAIT_VALUE_EQ``: wait until ``*addr == value``
CU_STREAM_WAIT_VALUE_EQ = 0x1

_LOCK = threading.Lock()
_DRIVER: list[ctypes.CDLL | None] = []  # [] = not loaded yet; [None] = unavailable


def _driver() -> ctypes.CDLL | None:
    """libcuda with the two entry points used here, or None (no driver, or too old)."""
    with _LOCK:
        if not _DRIVER:
            lib: ctypes.CDLL | None
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                wait = lib.cuStreamWaitValue32_v2
                wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                                 ctypes.c_uint]
                wait.restype = ctypes.c_int
                ptr = lib.cuMemHostGetDevicePointer_v2
                ptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                ctypes.c_uint]
                ptr.restype = ctypes.c_int
            except (OSError, AttributeError):
                lib = None
            _DRIVER.append(lib)
        return _DRIVER[0]


def stream_wait_supported() -> bool:
    """Whether device-side waits on host memory can be queued here: CUDA is available and the
    driver exports ``cuStreamWaitValue32_v2`` and ``cuMemHostGetDevicePointer_v2``."""
    return torch.cuda.is_available() and _driver() is not None


def host_device_pointer(host_ptr: int) -> int:
    """The device address of a byte of page-locked host memory (:func:`structspec.staging.page_lock`).

    Args:
        host_ptr: a host address inside a registered range.

    Returns:
        The address the device reads it at (int).

    Raises:
        RuntimeError: no driver, or the driver refused (the error code is in the message;
            e.g. the memory is not registered).
    """
    lib = _driver()
    if lib is None:
        raise RuntimeError("the CUDA driver's stream memory operations are unavailable")
    torch.cuda.init()  # the calls below need the primary context current on this thread
    out = ctypes.c_uint64(0)
    err = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if err:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {err})")
    return int(out.value)


def stream_wait_equal(stream: torch.cuda.Stream, device_ptr: int, value: int) -> None:
    """Queue, on ``stream``, a wait until the 32-bit word at ``device_ptr`` equals ``value``:
    the work queued on ``stream`` after this runs only once the word holds ``value``. The host
    does not block.

    Args:
        stream: the CUDA stream to hold.
        device_ptr: 4-byte aligned device address (:func:`host_device_pointer`).
        value: the 32-bit value to wait for (0 to 2**32 - 1).

    Raises:
        RuntimeError: no driver, or the driver refused (the error code is in the message).
    """
    lib = _driver()
    if lib is None:
        raise RuntimeError("the CUDA driver's stream memory operations are unavailable")
    err = lib.cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream), device_ptr,
                                     value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_EQ)
    if err:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {err})")
