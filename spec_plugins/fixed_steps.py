"""Fixed-shape steps, compiled or captured, for the target's verify step and the drafters' steps.

Eager PyTorch on a GPU is launch-bound (``docs/design-notes.md`` has the H200's numbers), and a
drafter that runs eagerly beside a graphed verify costs more than the verify it feeds. ``FixedSteps`` runs one function three ways, chosen
once by whoever owns it (the static runtime, the EAGLE drafter over it):

- ``eager``: as it is;
- ``compile``: ``torch.compile(fullgraph=True, dynamic=False)``, one graph per input shape (a graph
  break raises); on CUDA in ``reduce-overhead`` mode (CUDA graphs under the compiler);
- ``graphs`` (CUDA only): the eager function captured with ``torch.cuda.graph`` once per input
  shape, no compiler (``CapturedStep``): milliseconds per shape instead of tens of seconds.

Callers keep the shapes few (rows, positions and cache capacities in buckets). A step given
``row_buckets`` keeps its row counts few itself: compiled or captured, its rows are padded up to
the bucket (``ROW_BUCKETS``, the static runtime's too) and its outputs cut back, so the drafters'
steps see the verify step's row counts as rows join and leave a batch. ``clear`` drops every
compiled or captured step: a graph captured over buffers that were reallocated would write into
the old ones.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Literal

import torch

Mode = Literal["eager", "compile", "graphs"]
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the row counts fixed-shape steps run at


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``n`` (beyond the last: ``n`` itself, an eager call)."""
    return next((b for b in buckets if b >= n), n)


class FixedSteps:
    """One function run eagerly, compiled, or as CUDA graphs per input shape (module docstring)."""

    def __init__(self, fn: Callable[..., Any], mode: Mode = "eager", max_shapes: int = 256,
                 row_buckets: tuple[int, ...] | None = None) -> None:
        """``row_buckets``: compiled or captured calls run at the smallest of these row counts holding
        the call's rows (``_padded_call``), so a batch whose size moves reuses a few graphs. Only for
        an ``fn`` whose tensor arguments and outputs all lead with the rows, whose rows do not mix and
        which writes no buffer in place (a padded row is a copy of row 0). Eager calls run as given."""
        if mode == "graphs" and not torch.cuda.is_available():
            raise ValueError("graphs: CUDA graphs need a CUDA device; none is available here")
        self.fn, self.mode, self.max_shapes, self.row_buckets = fn, mode, max_shapes, row_buckets
        self._compiled: Callable[..., Any] | None = None
        self._own: Callable[..., Any] | None = None  # what ``_compiled`` compiles: code of its own
        self._graphs: dict[tuple, CapturedStep] = {}
        self._pool: Any = None  # one CUDA graph memory pool for all of them (replayed one at a time)

    def __call__(self, *args: Any) -> Any:
        if self.mode == "eager":
            return self.fn(*args)
        if self.row_buckets is not None:
            return self._padded_call(args)
        return self._fixed(*args)

    def _padded_call(self, args: tuple) -> Any:
        """The fixed step at the row bucket of ``args``' rows: each tensor argument's rows padded
        with copies of its row 0 (a real row: finite, its own mask), each tensor output cut back."""
        rows = _leading_rows(args, "argument")
        padded = bucket(rows, self.row_buckets)
        if rows == 0 or padded == rows:
            return self._fixed(*args)
        out = self._fixed(*(_pad_rows(a, padded) for a in args))
        _leading_rows(out if isinstance(out, (tuple, list)) else (out,), "output", padded)
        return _take_rows(out, rows)

    def _fixed(self, *args: Any) -> Any:
        """``fn`` compiled or captured for the shapes of ``args``."""
        if self.mode == "compile":
            if self._compiled is None:
                # one graph per shape of this step (its own code, `_own_code`): room for all of them, no silent fallback
                cfg = torch._dynamo.config
                cfg.recompile_limit = max(cfg.recompile_limit, self.max_shapes)
                cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * self.max_shapes)
                cuda = any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)
                self._own = _own_code(self.fn)
                self._compiled = torch.compile(self._own, fullgraph=True, dynamic=False,
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
        """Drop every compiled or captured step; the next compile starts a count of its own. Dynamo
        keeps a code object it compiled alive (and its graphs in the code's cache), so the cache of
        this step's own code is emptied here: a step rebuilt at every reallocation holds no memory
        for the graphs it no longer runs."""
        if self._own is not None:
            torch._dynamo.eval_frame.remove_from_cache(self._own)
        self._compiled = self._own = None
        self._graphs.clear()


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``fn`` whose code object no other function has. Dynamo keeps its graphs
    and counts recompiles against ``fullgraph``'s hard limit per code object, so steps sharing one
    (every runtime's step is the same lambda, a step compiled again after ``clear``, two decoders
    in one process) would add their shapes up until a verify fails mid-round."""
    def call(*args: Any) -> Any:
        return fn(*args)
    code = call.__code__.replace()  # a new code object: a fresh cache and count
    return types.FunctionType(code, call.__globals__, call.__name__, call.__defaults__, call.__closure__)


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


def _leading_rows(values: Any, what: str, expected: int | None = None) -> int:
    """The row count every tensor in ``values`` leads with; a tensor that leads with another (or is
    a scalar) is refused: a row-bucketed step pads and cuts every tensor's dim 0."""
    sizes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]
    leads = {s[0] if s else None for s in sizes}
    if expected is not None:
        leads.add(expected)
    if len(leads) != 1 or None in leads:
        want = f" (expected {expected} rows)" if expected is not None else ""
        raise ValueError(f"a row-bucketed fixed step needs every tensor {what} to lead with the same row count, "
                         f"got shapes {sizes}{want}")
    return int(leads.pop())


def _pad_rows(a: Any, rows: int) -> Any:
    """``a`` with copies of its row 0 appended up to ``rows`` (non-tensors as they are)."""
    if not isinstance(a, torch.Tensor):
        return a
    return torch.cat([a, a[:1].expand(rows - a.shape[0], *a.shape[1:])])


def _take_rows(out: Any, rows: int) -> Any:
    """The first ``rows`` rows of every tensor in ``out`` (a tensor, or a tuple or list of them)."""
    if isinstance(out, torch.Tensor):
        return out[:rows]
    if isinstance(out, (tuple, list)):
        return type(out)(_take_rows(o, rows) for o in out)
    return out


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out
