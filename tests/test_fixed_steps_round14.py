"""Round 14: every compiled fixed step counts its own shapes against dynamo's recompile limit.

Dynamo keeps graphs and counts recompiles per code object, and ``fullgraph=True`` turns the limit
into a hard failure. Every static runtime's verify step is the same lambda, so the shapes of a
step rebuilt after a reallocation, or of a second runtime in the process, used to add up until a
verify raised ``FailOnRecompileLimitHit`` mid-round. Dynamo runs for real here, with its
``eager`` backend (tracing, guards and the limit, no code generation)."""

from __future__ import annotations

import pytest
import torch

from spec_plugins.fixed_steps import FixedSteps

LIMIT = 8


@pytest.fixture
def eager_dynamo(monkeypatch):
    """``torch.compile`` with the ``eager`` backend, dynamo's default limits, a clean cache."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", LIMIT)
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 4 * LIMIT)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Owner:
    """What the static runtime does: a step built from one lambda line, dropped on reallocation."""

    def __init__(self) -> None:
        self.steps: dict[str, FixedSteps] = {}

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if "s" not in self.steps:
            self.steps["s"] = FixedSteps(lambda a: self._eager(a), "compile", max_shapes=LIMIT)
        return self.steps["s"](x)

    def _eager(self, a: torch.Tensor) -> torch.Tensor:
        return a * 2 + 1


def test_rebuilt_and_second_steps_each_have_room_for_their_shapes(eager_dynamo):
    shapes = LIMIT - 2  # each step's own shapes stay within the limit; together they pass it
    first = Owner()
    for n in range(1, shapes + 1):
        assert torch.equal(first.run(torch.ones(n)), torch.full((n,), 3.0))
    first.steps.clear()  # a reallocation: the runtime builds its step again
    for n in range(shapes + 1, 2 * shapes + 1):
        assert torch.equal(first.run(torch.ones(n)), torch.full((n,), 3.0))
    second = Owner()  # another runtime in the same process
    for n in range(1, 2 * shapes + 1, 2):
        assert torch.equal(second.run(torch.ones(n)), torch.full((n,), 3.0))


def test_clear_gives_a_step_a_fresh_count(eager_dynamo):
    step = FixedSteps(lambda a: a - 1, "compile", max_shapes=LIMIT)
    for n in range(1, 2 * LIMIT):
        if n % (LIMIT - 1) == 0:
            step.clear()
        assert torch.equal(step(torch.zeros(n)), torch.full((n,), -1.0))


def test_a_step_past_its_own_limit_still_fails_loudly(eager_dynamo):
    """The limit is not lifted: one step tracing more shapes than it has room for raises."""
    step = FixedSteps(lambda a: a + 1, "compile", max_shapes=LIMIT)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for n in range(1, LIMIT + 3):
            step(torch.zeros(n))


def test_clear_frees_the_graphs_a_step_no_longer_runs(monkeypatch):
    """Dynamo keeps every code object it compiled alive, with its graphs in the code's cache: a
    step rebuilt at each reallocation would keep every graph it had. ``clear`` empties its cache."""
    import gc
    import weakref

    compiled: list[weakref.ref] = []

    class Graph:
        def __init__(self, gm):
            self.gm = gm

        def __call__(self, *args):
            return self.gm.forward(*args)

    def backend(gm, example_inputs):
        g = Graph(gm)
        compiled.append(weakref.ref(g))
        return g

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": backend}))
    torch._dynamo.reset()
    try:
        for _ in range(3):
            step = FixedSteps(lambda a: a * 2, "compile", max_shapes=LIMIT)
            for n in range(1, 4):
                assert torch.equal(step(torch.ones(n)), torch.full((n,), 2.0))
            step.clear()
        gc.collect()
        assert len(compiled) == 9 and sum(r() is not None for r in compiled) == 0
    finally:
        torch._dynamo.reset()
