"""The llama.cpp runtime's config section: its context, threads and kernels, checked where llama.cpp
would otherwise abort the process."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from spec_plugins.config import RuntimeConfig

INT32_MAX = 2**31 - 1  # llama.cpp reads these fields as 32-bit integers: a larger value would wrap silently
MAX_THREADS = 1024  # past any CPU's useful count; llama.cpp aborts the process (std::bad_alloc) on huge ones


class LlamaCppConfig(RuntimeConfig):
    """The ``llamacpp`` target section (``LlamaCppRuntime.Config``)."""

    backend: Literal["llamacpp"] = "llamacpp"
    threads: int | None = Field(
        None, ge=1, le=MAX_THREADS, description="Threads for one-token decodes (None = every core this process "
        "may run on: its CPU affinity, e.g. taskset or a container's cpuset, not the machine's core count)."
    )
    threads_batch: int | None = Field(
        None, ge=1, le=MAX_THREADS, description="Threads for multi-token decodes: prefill, verification (None = threads)."
    )
    n_ctx: int = Field(
        4096, ge=0, le=INT32_MAX, description="KV cells shared by all rows and tree nodes (0 = model's length)."
    )
    n_batch: int = Field(
        512, ge=1, le=INT32_MAX, description="Most tokens per llama_decode call (longer inputs are split)."
    )
    max_sequences: int = Field(
        16, ge=1, le=256, description="llama.cpp sequence ids: batch rows + tree leaves beyond one per row."
    )
    flash_attn: bool = Field(
        True, description="Use llama.cpp's flash attention kernels. On by default: on the CPU backend its "
        "multi-token attention gives the same logits as one token at a time (measured: bit-identical for "
        "SmolLM2; without it they differ by up to ~1 logit), so verification matches plain decoding.")
    swa_full: bool = Field(True, description="Full-size sliding-window cache (safe rollback for SWA models).")
    gpu_layers: int = Field(0, ge=-1, description="Layers offloaded to a llama.cpp GPU backend (-1 = all).")
    extra_buffer_types: bool = Field(
        True, description="Let llama.cpp use repacked weight buffers (turn off if its AMX path crashes).")
    dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None, description="KV cache type (weights keep the GGUF's quantisation); None = llama.cpp's f16.")
    verbose: bool = Field(False, description="Print llama.cpp's own logs.")

    @model_validator(mode="after")
    def _check_outputs(self) -> "LlamaCppConfig":
        """llama.cpp reserves outputs for n_batch tokens (capped at n_ctx) and asserts, aborting the
        process, that this covers one output per sequence: refuse such a config here instead."""
        if self.n_batch < self.max_sequences:
            raise ValueError(f"n_batch ({self.n_batch}) must be at least max_sequences ({self.max_sequences}): "
                             "llama.cpp aborts the process otherwise")
        if 0 < self.n_ctx < self.max_sequences:
            raise ValueError(f"n_ctx ({self.n_ctx}) must be at least max_sequences ({self.max_sequences}) "
                             "(or 0, the model's length): llama.cpp caps n_batch at n_ctx and aborts the process "
                             "when that is below max_sequences")
        return self
