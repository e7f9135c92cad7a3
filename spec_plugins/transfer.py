"""Host data onto the runtime's device without waiting for the device.

A blocking host-to-device copy synchronizes the stream on CUDA: the host waits for every queued
kernel before it can queue the next, which is a host sync like a read-back (``torch.cuda``'s sync
debug mode counts it; ``device_audit.HostSyncs`` counts it on a CPU). A copy with
``non_blocking=True`` from pageable memory is staged by the driver and returns at once, so the
source may be freed; the one read-back per round is the only wait left. Every per-round upload
goes through here.
"""

from __future__ import annotations

from typing import Any

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (itself where it already is), copied without a stream sync."""
    return t if t.device == device else t.to(device, non_blocking=True)


def upload_tensor(data: Any, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(data, device=device)`` without the blocking copy it makes on CUDA."""
    return upload(torch.tensor(data, dtype=dtype, device="cpu"), device)  # made on the host on purpose
