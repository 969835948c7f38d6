"""Host data to the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`. To a GPU the copy is queued from pinned memory: a plain copy from pageable memory
    would first wait for everything the GPU has queued (torch's allocator keeps the pinned buffer until the
    copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
