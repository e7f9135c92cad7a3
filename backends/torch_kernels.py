"""Measured choice of the matmul kernel for the few-row linears of decoding and verification.

Why: speculative decoding lives on forwards over 1-16 new positions, and on some CPUs the
BLAS behind ``F.linear`` is poor exactly there: a few rows can cost far more than one, while
the same product issued as ``weight @ x.T`` (row-major weight, no transposed operand) need not.
How much verifying a few tokens costs over one token is what decides whether drafting pays.

Nothing is assumed: at load the runtime times both kernels over the model's own linear layers
for each row count (interleaved, median) and uses ``weight @ x.T`` only where it is faster by a
margin. The patch is active only inside the runtime's own forward (``active()``), so the same
model object used elsewhere (transformers ``generate()``, exporters, heads) keeps stock
``nn.Linear`` behaviour. Results differ from ``F.linear`` only in float rounding order.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

_ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
_LOCAL = threading.local()  # per thread: how deep inside ``active()`` this thread is


@dataclass(frozen=True)
class KernelChoice:
    """Per row count: True = ``weight @ x.T``; plus the timings that justified it (seconds)."""

    rows: tuple[int, ...]
    use_rowmajor: tuple[bool, ...]
    linear_s: tuple[float, ...]
    rowmajor_s: tuple[float, ...]
    # one-row product against a transposed copy of the weight (2x weight memory); None = not tried
    transposed_s: float | None = None
    use_transposed: bool = False

    def __post_init__(self) -> None:
        # row count -> kernel, precomputed: the lookup runs for every linear of every forward
        table = [False] * (max(self.rows) + 1)
        for m in range(1, len(table)):
            table[m] = next(use for r, use in zip(self.rows, self.use_rowmajor) if m <= r)
        object.__setattr__(self, "_table", tuple(table))

    def rowmajor_for(self, m: int) -> bool:
        return self._table[m] if m < len(self._table) else False  # type: ignore[attr-defined]

    def describe(self) -> str:
        on = [r for r, u in zip(self.rows, self.use_rowmajor) if u]
        text = f"weight@x.T for row counts {on}, F.linear otherwise" if on else "F.linear everywhere"
        if self.use_transposed:
            text = "x@weight.T (a transposed weight copy) for one row; " + text
        return text

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": list(self.rows), "use_rowmajor": list(self.use_rowmajor),
                               "linear_ms": [round(t * 1e3, 2) for t in self.linear_s],
                               "rowmajor_ms": [round(t * 1e3, 2) for t in self.rowmajor_s]}
        if self.transposed_s is not None:
            out.update(transposed_1row_ms=round(self.transposed_s * 1e3, 2), use_transposed=self.use_transposed)
        return out


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Scope in which patched linears use the measured kernel choice. Per thread: another
    thread running the same model meanwhile (e.g. transformers ``generate()``) keeps F.linear."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def is_active() -> bool:
    """Whether this thread is inside ``active()``."""
    return getattr(_LOCAL, "depth", 0) > 0


def _rowmajor(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _transposed(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x @ weight_t
    return y + bias if bias is not None else y


def _time_pass(linears: list[torch.nn.Linear], xs: dict[int, torch.Tensor], kind: str,
               copies: list[torch.Tensor] | None = None) -> float:
    t0 = time.perf_counter()
    for i, lin in enumerate(linears):
        x = xs[lin.in_features]
        if kind == "rowmajor":
            _rowmajor(x, lin.weight, lin.bias)
        elif kind == "transposed":
            _transposed(x, copies[i], lin.bias)  # type: ignore[index]
        else:
            F.linear(x, lin.weight, lin.bias)
    return time.perf_counter() - t0


def _race(linears: list[torch.nn.Linear], m: int, kinds: tuple[str, ...], repeats: int,
          copies: list[torch.Tensor] | None = None) -> list[float]:
    """Median seconds of one pass over ``linears`` with ``m`` rows, per kernel (order rotated)."""
    g = torch.Generator().manual_seed(m)
    dtype = linears[0].weight.dtype
    xs = {f: torch.randn(m, f, generator=g, device="cpu").to(dtype) for f in {lin.in_features for lin in linears}}
    for k in kinds:  # warm-up
        _time_pass(linears, xs, k, copies)
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats):
        for k in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            samples[k].append(_time_pass(linears, xs, k, copies))
    return [statistics.median(samples[k]) for k in kinds]


@torch.inference_mode()
def measure(linears: list[torch.nn.Linear], repeats: int = 3, margin: float = 0.93,
            transposed: bool = False) -> KernelChoice:
    """Time the kernels over all ``linears`` for each row bucket; a kernel replaces F.linear only
    when faster by ``margin``. ``transposed``: also try x@W.T against a contiguous W.T for one row
    (the copies are made here only for timing and freed)."""
    lin_s, row_s, use = [], [], []
    for m in _ROW_BUCKETS:
        ta, tb = _race(linears, m, ("linear", "rowmajor"), repeats)
        lin_s.append(ta)
        row_s.append(tb)
        use.append(tb < margin * ta)
    t_s, use_t = None, False
    if transposed:
        copies = [lin.weight.t().contiguous() for lin in linears]
        one_row = min(lin_s[0], row_s[0]) if use[0] else lin_s[0]
        t_s = _race(linears, 1, ("transposed",), repeats, copies)[0]
        use_t = t_s < margin * one_row
        del copies
    return KernelChoice(_ROW_BUCKETS, tuple(use), tuple(lin_s), tuple(row_s), t_s, use_t)


def install(model: torch.nn.Module, choice: KernelChoice) -> int:
    """Give every ``nn.Linear`` of ``model`` a forward that follows ``choice`` inside ``active()``.
    Returns the number of layers patched. Idempotent (a second install replaces the choice)."""
    count = 0
    for lin in model.modules():
        if not isinstance(lin, torch.nn.Linear):
            continue

        def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            if getattr(_LOCAL, "depth", 0) and x.dim() >= 2:
                rows = x.numel() // x.shape[-1]
                if rows == 1 and self._weight_t is not None:
                    return _transposed(x, self._weight_t, self.bias)
                if self._kernel_choice.rowmajor_for(rows):
                    return _rowmajor(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)

        lin._kernel_choice = choice  # type: ignore[attr-defined]
        # a plain attribute, not a buffer: state_dict, exports and .to() never see the copy
        lin._weight_t = lin.weight.detach().t().contiguous() if choice.use_transposed else None  # type: ignore[attr-defined]
        lin.forward = types.MethodType(forward, lin)  # type: ignore[method-assign]
        count += 1
    return count


def uninstall(model: torch.nn.Module) -> None:
    """Restore stock ``nn.Linear.forward`` on every patched layer."""
    for lin in model.modules():
        if isinstance(lin, torch.nn.Linear) and "forward" in lin.__dict__:
            del lin.forward
            lin.__dict__.pop("_kernel_choice", None)
            lin.__dict__.pop("_weight_t", None)


_MEASURED: dict[tuple[Any, ...], KernelChoice] = {}


def timing_sample(linears: list[torch.nn.Linear], budget_bytes: int = 256 << 20) -> list[torch.nn.Linear]:
    """The layers to time: one of every distinct shape, then more in model order up to
    ``budget_bytes`` of weights. Why a budget: the measurement makes ~64 passes, which over a
    7B model's weights would take minutes; why not one layer per shape: weights that fit in cache
    would time as if memory were free, while decoding streams every weight from RAM."""
    chosen: dict[int, torch.nn.Linear] = {}
    seen: set[tuple[int, int]] = set()
    for lin in linears:
        shape = (lin.out_features, lin.in_features)
        if shape not in seen:
            seen.add(shape)
            chosen[id(lin)] = lin
    total = sum(lin.weight.numel() * lin.weight.element_size() for lin in chosen.values())
    for lin in linears:
        if total >= budget_bytes:
            break
        if id(lin) not in chosen:
            chosen[id(lin)] = lin
            total += lin.weight.numel() * lin.weight.element_size()
    return [lin for lin in linears if id(lin) in chosen]


def tune(model: torch.nn.Module, transposed: bool = False) -> KernelChoice | None:
    """Measure (once per process per weight-shape set) and install; None where not applicable
    (non-CPU devices: their BLAS handles few rows well, and timing would need syncs).
    ``transposed``: allow a transposed copy of every weight for the one-row product."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears or linears[0].weight.device.type != "cpu":
        return None
    key = (linears[0].weight.dtype, torch.get_num_threads(), transposed,
           tuple(sorted((lin.out_features, lin.in_features) for lin in linears)))
    choice = _MEASURED.get(key)
    if choice is None:
        choice = _MEASURED[key] = measure(timing_sample(linears), transposed=transposed)
    install(model, choice)
    return choice
