"""The measured few-row matmul choice: scoped to the runtime, numerically F.linear, exact decoding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conftest import tiny_llama
from spec_plugins.backends import torch_kernels
from spec_plugins.backends.torch_kernels import KernelChoice
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

ALL = KernelChoice((1, 16), (True, True), (1.0, 1.0), (0.5, 0.5))


def _spy(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch_kernels._rowmajor

    def spy(x, w, b):
        calls.append(x.numel() // x.shape[-1])
        return real(x, w, b)

    monkeypatch.setattr(torch_kernels, "_rowmajor", spy)
    return calls


def test_patch_is_scoped_and_matches_linear(monkeypatch):
    lin = torch.nn.Linear(24, 40)
    x = torch.randn(2, 3, 24)
    want = F.linear(x, lin.weight, lin.bias)
    torch_kernels.install(lin, ALL)
    calls = _spy(monkeypatch)
    assert torch.equal(lin(x), want)  # outside active(): stock F.linear, bit for bit
    assert calls == []
    with torch_kernels.active():
        got = lin(x)
        assert lin(torch.randn(17, 24)).shape == (17, 40)  # 17 rows: beyond the buckets -> F.linear
    assert calls == [6]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch_kernels.uninstall(lin)
    with torch_kernels.active():
        lin(x)
    assert calls == [6]


def test_scope_is_per_thread(monkeypatch):
    """A runtime forward in one thread must not switch kernels for another thread's call."""
    import threading

    lin = torch.nn.Linear(24, 40)
    torch_kernels.install(lin, ALL)
    calls = _spy(monkeypatch)
    inside, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def runtime_thread():
        with torch_kernels.active():
            inside.set()
            done.wait(10)

    t = threading.Thread(target=runtime_thread)
    t.start()
    assert inside.wait(10)
    seen["active_here"] = torch_kernels.is_active()
    lin(torch.randn(3, 24))  # this thread is outside active(): stock F.linear
    done.set()
    t.join(10)
    assert seen["active_here"] is False and calls == []
    with torch_kernels.active():
        assert torch_kernels.is_active()
        lin(torch.randn(3, 24))
    assert calls == [3] and not torch_kernels.is_active()
    torch_kernels.uninstall(lin)


def test_choice_lookup_uses_next_bucket():
    c = KernelChoice((1, 2, 4, 8), (False, True, True, False), (1, 1, 1, 1), (2, 0.5, 0.5, 2))
    assert [c.rowmajor_for(m) for m in (1, 2, 3, 4, 5, 8, 9, 100)] == [False, True, True, True, False, False,
                                                                          False, False]
    assert "[2, 4]" in c.describe()


def test_measure_times_every_bucket():
    model = tiny_llama(vocab=32, seed=1)
    choice = torch_kernels.measure([m for m in model.modules() if isinstance(m, torch.nn.Linear)], repeats=1)
    assert choice.rows == torch_kernels._ROW_BUCKETS
    assert all(t > 0 for t in choice.linear_s + choice.rowmajor_s)
    assert choice.use_rowmajor == tuple(r < 0.93 * a for a, r in zip(choice.linear_s, choice.rowmajor_s))


def test_runtime_option_and_exact_greedy_with_rowmajor(monkeypatch):
    model = tiny_llama(vocab=48, seed=4, sharpness=2.0)
    assert TorchRuntime(model, matmul="native").kernels is None
    torch_kernels.uninstall(model)
    plain = TorchRuntime(model, matmul="native")
    fast = TorchRuntime(model, matmul="native")
    torch_kernels.install(model, ALL)  # force the row-major kernel for every forward of `fast`
    fast.kernels = ALL
    calls = _spy(monkeypatch)
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6]]
    pipe = LogitsPipeline(SamplingConfig(temperature=0.0))

    def run(rt, k):
        out: list[int] = []
        prop = NgramProposer(NgramProposer.Config()) if k else None
        for step in decode(rt, prop, ExactVerifier(), pipe, prompt, 30, (), torch.Generator(), None, FixedLength(k)):
            out.extend(step.emitted.get(0, []))
        return out

    torch_kernels.uninstall(model)
    want = run(plain, 0)
    torch_kernels.install(model, ALL)
    got = run(fast, 4)
    assert calls and max(calls) > 1  # multi-row verify forwards took the patched path
    assert got == want


def test_transposed_copy_for_one_row(monkeypatch):
    lin = torch.nn.Linear(24, 40)
    choice = KernelChoice((1, 16), (False, False), (1.0, 1.0), (1.0, 1.0), 0.5, True)
    torch_kernels.install(lin, choice)
    assert lin._weight_t.shape == (24, 40) and "_weight_t" not in lin.state_dict()
    x1, x3 = torch.randn(1, 1, 24), torch.randn(3, 24)
    used: list[int] = []
    real = torch_kernels._transposed
    monkeypatch.setattr(torch_kernels, "_transposed", lambda x, w, b: used.append(x.shape[0]) or real(x, w, b))
    with torch_kernels.active():
        torch.testing.assert_close(lin(x1), F.linear(x1, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(lin(x3), F.linear(x3, lin.weight, lin.bias))  # 3 rows: stock path
    assert used == [1]
    torch_kernels.uninstall(lin)
    assert "_weight_t" not in lin.__dict__
    model = tiny_llama(vocab=32, seed=1)
    c = torch_kernels.measure([m for m in model.modules() if isinstance(m, torch.nn.Linear)], repeats=1,
                              transposed=True)
    assert c.transposed_s is not None and c.transposed_s > 0 and "transposed_1row_ms" in c.to_dict()


def test_timing_sample_keeps_every_shape_within_budget():
    lins = [torch.nn.Linear(64, 32) for _ in range(10)] + [torch.nn.Linear(32, 128), torch.nn.Linear(64, 32)]
    one = 64 * 32 * 4
    got = torch_kernels.timing_sample(lins, budget_bytes=3 * one)
    assert lins[10] in got and lins[0] in got  # every distinct shape, however small the budget
    assert sum(l.weight.numel() * 4 for l in got) < 3 * one + 128 * 32 * 4 + one
    assert [lins.index(l) for l in got] == sorted(lins.index(l) for l in got)  # model order kept
    assert torch_kernels.timing_sample(lins, budget_bytes=1 << 30) == lins
