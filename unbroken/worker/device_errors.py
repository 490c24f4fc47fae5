"""What a device error means for the process that raised it: one function, no GPU needed.

A training step on a GPU can fail in ways that leave the process usable and in ways that
do not. CUDA reports some errors as *sticky*: once raised, every later call on that
context fails (an uncorrectable ECC error, an illegal memory access, a launch failure, a
device-side assert). A process holding such a context cannot take part in recovery: it
must end, so the agent replaces it (rung ``recover-in-place``). An out-of-memory error
leaves the context usable (the allocator failed, nothing was corrupted): the step can be
reported with the allocator's summary and the process stays. Non-finite values are not
device errors at all; :mod:`unbroken.worker.integrity` turns them into a ``retry``.

:func:`classify` reads the exception (its type and CUDA's error text, which is what torch
surfaces) and says which; it runs anywhere, so it is unit-tested on CPU with the texts.
"""

from __future__ import annotations

import enum
import re

import torch


class DeviceErrorKind(enum.StrEnum):
    STICKY = "sticky"           # the device context is unusable: end the process, replace the rank
    OUT_OF_MEMORY = "oom"       # the context is usable: report it (allocator summary), the process stays
    TRANSIENT = "transient"     # a communication error (NCCL): the collective's group is abandoned
    NOT_DEVICE = "not-device"   # not a device error: the caller's usual handling applies


# CUDA runtime/driver error texts that poison the context (cudaGetErrorString forms and
# the names torch prints); matched case-insensitively anywhere in the message.
_STICKY = re.compile("|".join((
    r"uncorrectable ecc error", r"ecc error encountered", r"illegal memory access",
    r"illegal address", r"unspecified launch failure", r"device-side assert",
    r"misaligned address", r"illegal instruction", r"hardware stack error",
    r"cudaErrorIllegalAddress", r"cudaErrorLaunchFailure", r"cudaErrorECCUncorrectable",
    r"cudaErrorAssert", r"CUDA_ERROR_ILLEGAL_ADDRESS", r"CUDA_ERROR_ECC_UNCORRECTABLE",
    r"an illegal memory access was encountered", r"GPU is lost", r"fallen off the bus",
)), re.IGNORECASE)
_OOM = re.compile(r"out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)
_NCCL = re.compile(r"\bNCCL\b.*(error|timeout|abort)|ncclRemoteError|ncclSystemError|ncclInternalError",
                   re.IGNORECASE)


def classify(exc: BaseException) -> DeviceErrorKind:
    """The kind of device error ``exc`` is (see the module docstring)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return DeviceErrorKind.OUT_OF_MEMORY
    if not isinstance(exc, RuntimeError):
        return DeviceErrorKind.NOT_DEVICE
    text = str(exc)
    if _STICKY.search(text):
        return DeviceErrorKind.STICKY
    if _OOM.search(text):
        return DeviceErrorKind.OUT_OF_MEMORY
    if _NCCL.search(text):
        return DeviceErrorKind.TRANSIENT
    return DeviceErrorKind.NOT_DEVICE


def memory_summary(device: torch.device) -> str:
    """The allocator's summary for an OOM report ('' off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    return torch.cuda.memory_summary(device, abbreviated=True)
