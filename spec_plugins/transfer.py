"""Host data onto the runtime's device without waiting for the device, and device data back in one read.

A blocking host-to-device copy synchronizes the stream on CUDA: the host waits for every queued
kernel before it can queue the next, which is a host sync like a read-back (``torch.cuda``'s sync
debug mode counts it; ``device_audit.HostSyncs`` counts it on a CPU). A copy with
``non_blocking=True`` from pageable memory is staged by the driver and returns at once, so the
source may be freed; the one read-back per round is the only wait left. Every per-round upload
goes through here. Coming back, ``fetch`` reads any set of a round's device tensors in one
device-to-host copy: the round's one sync.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

HOST = torch.device("cpu")  # where Python reads data without waiting for a device


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (itself where it already is), copied without a stream sync."""
    return t if t.device == device else t.to(device, non_blocking=True)


def upload_tensor(data: Any, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(data, device=device)`` without the blocking copy it makes on CUDA."""
    return upload(torch.tensor(data, dtype=dtype, device="cpu"), device)  # made on the host on purpose


def fetch(parts: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Every tensor of ``parts`` on the host, in ONE device-to-host copy: packed flat as int64
    (booleans and integers as they are, floating point as the bits of float64, so nothing is
    rounded), read once, unpacked to arrays of the tensors' shapes (bool, int64 or float64).
    Packed on a device part's device, host parts uploaded there: moving a device part to the host
    with ``non_blocking`` would let ``cat`` read it before the copy lands."""
    if not parts:
        return {}
    device = next((t.device for t in parts.values() if t.device != HOST), HOST)
    flat, meta = [], []
    for name, t in parts.items():
        t = upload(t.detach(), device)
        if t.is_floating_point():
            kind, v = "f", t.double().reshape(-1).view(torch.int64)
        else:
            kind, v = ("b" if t.dtype == torch.bool else "i"), t.reshape(-1).long()
        flat.append(v)
        meta.append((name, tuple(t.shape), kind, int(v.numel())))
    host = torch.cat(flat).cpu().numpy()  # the one sync
    out, at = {}, 0
    for name, shape, kind, n in meta:
        a = host[at:at + n]
        at += n
        out[name] = (a.view(np.float64) if kind == "f" else a.astype(bool) if kind == "b" else a).reshape(shape)
    return out
