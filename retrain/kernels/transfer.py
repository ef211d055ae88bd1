"""Host tensors to the training device without waiting for the device.

A CUDA copy from ordinary (pageable) host memory first waits for all the work queued on
the stream, so every `tensor.to("cuda")` of a micro-batch's ids, positions, masks or
advantages stalled the host until the GPU had finished the previous micro-batch's
backward: the host could not prepare and queue the next forward meanwhile, and the GPU
then idled while it did. From pinned memory the copy is queued like a kernel and the host
goes on (torch keeps the pinned block until the copy has run). A CPU has nothing to wait
for: the tensor is returned as `Tensor.to` gives it.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, queued without a wait on CUDA."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
