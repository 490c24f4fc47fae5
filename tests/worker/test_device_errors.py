"""Device error classification, from the texts CUDA and torch print (no GPU needed)."""

import pytest
import torch

from unbroken.worker.device_errors import DeviceErrorKind, classify

STICKY_TEXTS = [
    "CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: unspecified launch failure",
    "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "CUDA error: misaligned address",
    "CUDA driver error: CUDA_ERROR_ILLEGAL_ADDRESS",
    "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost.",
]


@pytest.mark.parametrize("text", STICKY_TEXTS)
def test_sticky_cuda_errors_end_the_process(text):
    assert classify(RuntimeError(text)) is DeviceErrorKind.STICKY


def test_out_of_memory_is_handled_in_process():
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is \
        DeviceErrorKind.OUT_OF_MEMORY
    assert classify(RuntimeError("CUDA error: out of memory")) is DeviceErrorKind.OUT_OF_MEMORY


def test_nccl_errors_are_transient():
    text = "NCCL error in: ProcessGroupNCCL.cpp:1234, remote process exited or there was a network error, " \
           "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error"
    assert classify(RuntimeError(text)) is DeviceErrorKind.TRANSIENT


@pytest.mark.parametrize("exc", [ValueError("illegal memory access"), RuntimeError("shape mismatch"),
                                 KeyError("x")])
def test_other_errors_are_not_device_errors(exc):
    assert classify(exc) is DeviceErrorKind.NOT_DEVICE
