"""Fixed-shape steps, compiled or captured, for the target's verify step and the drafters' steps.

Eager PyTorch on a GPU is launch-bound (``docs/design-notes.md`` has the H200's numbers), and a
drafter that runs eagerly beside a graphed verify costs more than the verify it feeds. ``FixedSteps`` runs one function three ways, chosen
once by whoever owns it (the static runtime, the EAGLE drafter over it):

- ``eager``: as it is;
- ``compile``: ``torch.compile(fullgraph=True, dynamic=False)``, one graph per input shape (a graph
  break raises); on CUDA in ``reduce-overhead`` mode (CUDA graphs under the compiler);
- ``graphs`` (CUDA only): the eager function captured with ``torch.cuda.graph`` once per input
  shape, no compiler (``CapturedStep``): milliseconds per shape instead of tens of seconds.

Callers keep the shapes few (rows, positions and cache capacities in buckets). ``clear`` drops
every compiled or captured step: a graph captured over buffers that were reallocated would write
into the old ones.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch

Mode = Literal["eager", "compile", "graphs"]


class FixedSteps:
    """One function run eagerly, compiled, or as CUDA graphs per input shape (module docstring)."""

    def __init__(self, fn: Callable[..., Any], mode: Mode = "eager", max_shapes: int = 256) -> None:
        if mode == "graphs" and not torch.cuda.is_available():
            raise ValueError("graphs: CUDA graphs need a CUDA device; none is available here")
        self.fn, self.mode, self.max_shapes = fn, mode, max_shapes
        self._compiled: Callable[..., Any] | None = None
        self._graphs: dict[tuple, CapturedStep] = {}
        self._pool: Any = None  # one CUDA graph memory pool for all of them (replayed one at a time)

    def __call__(self, *args: Any) -> Any:
        if self.mode == "eager":
            return self.fn(*args)
        if self.mode == "compile":
            if self._compiled is None:
                # one graph per shape: room for all of them, no silent fallback to eager
                cfg = torch._dynamo.config
                cfg.recompile_limit = max(cfg.recompile_limit, self.max_shapes)
                cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * self.max_shapes)
                cuda = any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)
                self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False,
                                               mode="reduce-overhead" if cuda else None)
            return self._compiled(*args)
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        g = self._graphs.get(key)
        if g is None:
            self._pool = self._pool if self._pool is not None else torch.cuda.graph_pool_handle()
            g = self._graphs[key] = CapturedStep(self.fn, args, self._pool)
        return g(*args)

    @property
    def used(self) -> bool:
        """Whether a compiled or captured step has run."""
        return self._compiled is not None or bool(self._graphs)

    def clear(self) -> None:
        self._compiled = None
        self._graphs.clear()


class CapturedStep:
    """One CUDA graph of a fixed-shape function: tensor inputs are copied into static buffers
    before each replay and tensor outputs cloned after it (the next replay overwrites them).
    Capturing runs the function twice on a side stream first (lazy kernel and workspace set-up),
    as CUDA graphs require; a function writing buffers (a KV cache) writes the same values then."""

    def __init__(self, fn: Callable[..., Any], args: tuple, pool: Any) -> None:
        self.args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*self.args)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*self.args)

    def __call__(self, *args: Any) -> Any:
        for buf, a in zip(self.args, args):
            if isinstance(buf, torch.Tensor):
                buf.copy_(a)
        self.graph.replay()
        return _clone(self.out)


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out
