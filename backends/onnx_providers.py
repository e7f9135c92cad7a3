"""ONNX Runtime's execution providers for the onnxruntime backend: which ones a device setting
asks for, their options (CUDA runs on a torch stream), and the check that a session got the CUDA
provider it asked for: ONNX Runtime builds a CPU-only session when its CUDA provider fails to
start (cuDNN or cuBLAS missing, a CUDA version its build was not made for) and only logs it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

CUDA = "CUDAExecutionProvider"
_log = logging.getLogger(__name__)


def providers_for(device: str, available: Sequence[str], torch_cuda: bool = True) -> list[str]:
    """Execution providers for a device setting; CUDA requested but absent is a config error
    (``ValueError``: the CLI prints it as one line naming the setting). ``auto``
    takes CUDA only where ONNX Runtime has the provider and torch has CUDA (``torch_cuda``:
    ``create_session`` passes ``torch.cuda.is_available()``): the KV cache lives in torch tensors on
    the session's device, and onnxruntime-gpu lists its CUDA provider on any machine."""
    has_cuda = CUDA in available
    if device == "cuda" and not has_cuda:
        raise ValueError(
            "device 'cuda' requested but this onnxruntime has no CUDAExecutionProvider (available: "
            f"{', '.join(available)}); install onnxruntime-gpu (pip install 'spec-plugins[gpu]') or set device: cpu"
        )
    if device == "cuda" or (device == "auto" and has_cuda and torch_cuda):
        return [CUDA, "CPUExecutionProvider"]
    if device == "auto" and has_cuda:
        _log.warning("device 'auto': onnxruntime has the CUDAExecutionProvider but this torch has no CUDA (the "
                     "runtime keeps the KV cache in torch tensors on the session's device); running on the CPU: "
                     "install a CUDA torch to run on the GPU, or set device: cpu")
    return ["CPUExecutionProvider"]


def provider_options(providers: Sequence[str], device_id: int, stream: int | None) -> list[dict[str, str]]:
    """Each provider's options. CUDA: the device, and ``stream`` (a torch CUDA stream's handle) as
    the compute stream ONNX Runtime queues its kernels on, so that the runtime can order them after
    the torch work that writes their inputs (``OnnxRuntime._call``); without it ONNX Runtime runs
    on a stream of its own that nothing orders. The null stream (torch's default stream, handle 0)
    cannot serve: ONNX Runtime reads a null ``user_compute_stream`` as none given."""
    out = []
    for p in providers:
        if p != CUDA:
            out.append({})
            continue
        if not stream:
            raise ValueError(f"the CUDA execution provider needs a torch stream other than the default (null) one as "
                             f"its user_compute_stream, got {stream!r}")
        out.append({"device_id": str(device_id), "user_compute_stream": str(stream)})
    return out


def check_session_providers(session: Any, requested: Sequence[str], device: str, file: Any) -> None:
    """Refuse a session that asked for CUDA and came back without it (``device: cuda``: the run
    would go on silently on the CPU), or say so (``device: auto``, whose fallback is the CPU)."""
    got = list(session.get_providers())
    if CUDA not in requested or CUDA in got:
        return
    why = (f"ONNX Runtime could not start its CUDAExecutionProvider for {file} and fell back to "
           f"{', '.join(got) or 'no provider'} (its log above says why); the CUDA provider usually needs the "
           "cuDNN and cuBLAS libraries and the CUDA major version its onnxruntime-gpu build was made for, on the "
           "library path (see ONNX Runtime's CUDA requirements table)")
    if device == "cuda":
        raise RuntimeError(f"device 'cuda' requested, but {why}; install those, or set device: cpu to run on the CPU")
    _log.warning("device 'auto': %s; running on the CPU", why)


def check_torch_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA execution provider keeps the KV cache in torch CUDA tensors, "
                           "but this torch has no CUDA; install a CUDA torch or set device: cpu")


def session_stream(session: Any, device: torch.device) -> Any:
    """The CUDA stream a session queues its kernels on, as a torch stream (its
    ``user_compute_stream``); a session without one is refused, since nothing could order its
    kernels after the torch work that writes their inputs."""
    handle = int(session.get_provider_options().get(CUDA, {}).get("user_compute_stream", 0))
    if not handle:
        raise ValueError("this CUDA session runs on a stream of ONNX Runtime's own, which torch cannot order after "
                         "the work that writes its inputs; build it with create_session, which gives it a torch "
                         "stream (user_compute_stream)")
    return torch.cuda.ExternalStream(handle, device=device)
