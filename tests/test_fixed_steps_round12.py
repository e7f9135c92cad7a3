"""Round 12: the drafters' fixed steps run at the verify step's row buckets, and ``matmul:
auto_transposed`` is refused wherever the static cache (native kernels) is chosen.

The compiled paths are checked without compiling: ``torch.compile`` is replaced by a wrapper that
records the shapes the compiled function would be traced at and runs it eagerly (what the compiled
graph computes), so a test sees every graph a server's batch would need in seconds."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from helpers import every_proposer, plain_greedy, save_random_heads
from pydantic import ValidationError
from spec_plugins.backends.torch_runtime import TorchRuntime, selects_static
from spec_plugins.backends.torch_static import ROW_BUCKETS, StaticTorchRuntime
from test_batch import drive

from spec_plugins.fixed_steps import FixedSteps, bucket
from spec_plugins.loop import Batch
from spec_plugins.policy import FixedLength
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4], [7, 7, 8], [3, 1, 4, 1, 5]]
LIMITS = [30, 9, 22, 14, 9, 19, 25, 6, 18]
# joins before rounds 0, 2, 5, 9: 1, 3, 5, 7-9 rows at once, rows leaving as they finish
SCHEDULE = {0: [0], 2: [1, 2], 5: [3, 4], 9: [5, 6, 7, 8]}


def _record_compiles(monkeypatch) -> dict:
    """Replace ``torch.compile`` with an eager wrapper recording each call's tensor shapes, per
    compiled function: ``{fn: [shapes, ...]}`` (one distinct entry per graph a compile would trace)."""
    seen: dict = {}

    def fake_compile(fn, **_):
        def run(*args):
            seen.setdefault(fn, []).append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    return seen


def _check_padded_calls(monkeypatch) -> list[tuple[int, int]]:
    """Check every row-bucketed call (``FixedSteps._padded_call``) against the same function run
    eagerly on the unpadded rows, as it runs: padding must change no real row's outputs, which the
    greedy output alone cannot show (the exact verifier keeps it whatever the drafts are). Returns
    each call's (rows, bucket), so a test can see that padding happened."""
    calls: list[tuple[int, int]] = []
    padded_call = FixedSteps._padded_call

    def checked(self: FixedSteps, args: tuple) -> object:
        out = padded_call(self, args)
        rows = next(a for a in args if isinstance(a, torch.Tensor)).shape[0]
        calls.append((rows, bucket(rows, self.row_buckets)))
        got, ref = _as_tuple(out), _as_tuple(self.fn(*args))
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        assert len(got) == len(ref), (name, len(got), len(ref))
        for i, (a, b) in enumerate(zip(got, ref)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, i=i: f"{name} output {i}, {calls[-1]} (rows, bucket): {m}")
        return out

    monkeypatch.setattr(FixedSteps, "_padded_call", checked)
    return calls


def _as_tuple(out: object) -> tuple:
    """A step's outputs as a tuple (a single tensor is one output)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _serve(kind: str, tmp_path) -> tuple[dict, list[RowRequest], object]:
    """A static runtime in compile mode (the fixed-shape path ``compile: on`` sets) with ``kind``
    drafting over it, rows joining a running batch and leaving it: (outputs by key, requests, model)."""
    model = tiny_llama(seed=3, sharpness=2.0)
    heads = save_random_heads(model, tmp_path)
    rt = StaticTorchRuntime(model)
    rt.fixed_shapes, rt.step_mode = True, "compile"
    batch = Batch(rt, every_proposer(kind, rt, heads), ExactVerifier())
    reqs = [RowRequest(i, PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(LIMITS)]
    outs = drive(batch, FixedLength(4), {r: [reqs[i] for i in keys] for r, keys in SCHEDULE.items()})
    return outs, reqs, model


@pytest.mark.parametrize("kind", ["eagle-tree", "medusa-tree", "parallel-tree"])
def test_drafter_fixed_steps_see_only_the_verify_steps_row_buckets(kind, tmp_path, monkeypatch):
    """Every compiled function (the verify step and the drafter's steps) is traced at row counts in
    ``ROW_BUCKETS`` only, as rows join and leave: 3, 5, 6 or 7 rows are no new graphs."""
    seen = _record_compiles(monkeypatch)
    _serve(kind, tmp_path)
    assert len(seen) >= 2, f"expected the verify step and a drafter step compiled, got {len(seen)} functions"
    for fn, calls in seen.items():
        rows = sorted({shapes[0][0] for shapes in calls})
        assert set(rows) <= set(ROW_BUCKETS), f"{fn} traced at row counts {rows}"


@pytest.mark.parametrize("kind", ["eagle-tree", "medusa-tree", "parallel-tree"])
def test_padded_drafter_steps_equal_eager_steps_and_keep_greedy_output(kind, tmp_path, monkeypatch):
    """Padded to row buckets, every drafter step's outputs equal the same step run eagerly on the
    real rows (padded rows are copies of row 0, cut off: they change no real row's draft), and every
    row's output is plain greedy decoding's."""
    calls = _check_padded_calls(monkeypatch)
    seen = _record_compiles(monkeypatch)
    outs, reqs, model = _serve(kind, tmp_path)
    assert any(rows < padded for rows, padded in calls), f"no call was padded: {calls}"
    for r in reqs:
        assert outs[r.key] == plain_greedy(model, r.prompt, r.max_new_tokens), (kind, r.key)
    assert len(seen) >= 2  # the drafter's step ran through the (recorded) compiled path


def test_row_buckets_pad_compiled_calls_and_cut_outputs_back(monkeypatch):
    """``FixedSteps(row_buckets=...)`` on a row-independent function: a compiled call runs at the
    bucket, its outputs equal the function's own on the real rows; eager calls run unpadded. The
    buckets are the static runtime's own (one definition)."""
    from spec_plugins import fixed_steps

    assert fixed_steps.ROW_BUCKETS is ROW_BUCKETS
    seen = _record_compiles(monkeypatch)
    calls = []

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(x.shape[0])
        return x.softmax(-1) * w, x.sum(-1)

    x, w = torch.randn(3, 5), torch.randn(3, 5)
    out = FixedSteps(fn, "compile", row_buckets=ROW_BUCKETS)(x, w)
    ref = fn(x, w)
    assert [tuple(o.shape) for o in out] == [(3, 5), (3,)]
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert [s[0][0] for s in next(iter(seen.values()))] == [4]
    calls.clear()
    FixedSteps(fn, "eager", row_buckets=ROW_BUCKETS)(x, w)
    assert calls == [3]


def test_row_buckets_refuse_arguments_that_do_not_lead_with_the_rows(monkeypatch):
    """A tensor argument leading with another size cannot be padded as a row: refused by name."""
    _record_compiles(monkeypatch)
    step = FixedSteps(lambda x, y: x + y.sum(), "compile", row_buckets=ROW_BUCKETS)
    with pytest.raises(ValueError, match="lead with the same row count"):
        step(torch.zeros(3, 2), torch.zeros(5, 2))


# ---- matmul: auto_transposed where the static cache runs ----------------------------------------------
@pytest.mark.parametrize("settings, named", [
    ({"kv": "static"}, "kv: static"),
    ({"compile": "on"}, "compile: on"),
    ({"compile": "graphs"}, "compile: graphs"),
])
def test_auto_transposed_is_refused_where_the_config_selects_the_static_cache(settings, named):
    """``kv: static``, or ``kv: auto`` with ``compile: on``/``graphs``, selects the static cache,
    which runs native kernels: the transposed kernels would be dropped silently, so the config is
    refused, naming both settings."""
    with pytest.raises(ValidationError, match=f"matmul: auto_transposed needs kv: dynamic.*{named}"):
        TorchRuntime.Config(model="x", matmul="auto_transposed", **settings)
    TorchRuntime.Config(model="x", matmul="auto", **settings)  # the default kernels: accepted


def test_auto_transposed_with_kv_auto_is_accepted_on_either_host(monkeypatch):
    """``kv: auto`` picks the growing cache on a CPU (the transposed kernels run) and the static cache
    on CUDA, where the measured kernels are CPU kernels and never run (``torch_kernels.tune``):
    neither host refuses a CPU-tuned config."""
    cfg = TorchRuntime.Config(model="x", matmul="auto_transposed")
    assert cfg.kv == "auto" and selects_static(cfg) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert selects_static(cfg) is True
    assert selects_static(TorchRuntime.Config(model="x", kv="dynamic", matmul="auto_transposed")) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile: graphs captures CUDA graphs; no CUDA device here")
@pytest.mark.parametrize("kind", ["eagle-tree", "medusa-tree"])
def test_captured_drafter_steps_use_row_buckets_and_keep_greedy_output(kind, tmp_path, monkeypatch):
    """``compile: graphs`` with rows joining and leaving: the drafter's captured graphs are keyed by
    bucketed row counts only, each padded replay's outputs equal the step run eagerly on the real
    rows, and every row's output is plain greedy decoding's."""
    calls = _check_padded_calls(monkeypatch)
    model = tiny_llama(seed=3, sharpness=2.0)
    heads = save_random_heads(model, tmp_path)
    model = model.to("cuda")
    rt = StaticTorchRuntime(model, graphs=True)
    prop = every_proposer(kind, rt, heads)
    batch = Batch(rt, prop, ExactVerifier())
    reqs = [RowRequest(i, PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(LIMITS)]
    outs = drive(batch, FixedLength(4), {r: [reqs[i] for i in keys] for r, keys in SCHEDULE.items()})
    assert any(rows < padded for rows, padded in calls), f"no call was padded: {calls}"
    for r in reqs:
        assert outs[r.key] == plain_greedy(model, r.prompt, r.max_new_tokens), (kind, r.key)
    step = prop._draft_step if kind.startswith("eagle") else prop.run_heads
    assert step._graphs and {key[0][0][0] for key in step._graphs} <= set(ROW_BUCKETS)
