"""The llama.cpp runtime's state around failures: a closed runtime refuses calls instead of handing
freed memory to llama.cpp, a forward llama.cpp cannot fit leaves the runtime as before the call,
and a GPU offload the build cannot do is refused.

llama.cpp's logits for a row depend slightly on where its cells sit in the cache (near-ties rank
differently per build), so these tests check lengths, errors and logits within a tolerance, never
exact tokens at near-ties."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from test_llamacpp import _cfg, _ids, _kl, _model_test

from spec_plugins.config import ConfigError, SpecConfig
from spec_plugins.tree import layout, with_root


def _build(**target):
    from spec_plugins.backends import build_runtime

    return build_runtime(SpecConfig.parse(_cfg(**target)).target)


@pytest.fixture(scope="module")
def pair():
    """Two runtimes of one small config: one is driven into failures, the other is the fresh reference.
    n_ctx=64 gives 256 cells and caps llama.cpp's batch at 64 tokens, so a forward can fail part way."""
    rts = (_build(n_ctx=64, max_sequences=4), _build(n_ctx=64, max_sequences=4))
    yield rts
    for r in rts:
        r.close()


@_model_test
def test_calls_after_close_raise_and_do_not_crash_the_process():
    """close() frees the llama.cpp context: every later call raises (run in a child process, so a
    regression that hands llama.cpp the freed memory shows as a crash, not a dead test session)."""
    script = textwrap.dedent(f"""
        import torch
        from spec_plugins.backends import build_runtime
        from spec_plugins.config import SpecConfig
        rt = build_runtime(SpecConfig.parse({_cfg(n_ctx=256, max_sequences=2)!r}).target)
        rt.prefill([[1, 2, 3]])
        rt.close()
        rt.close()  # a second close does nothing
        calls = {{"prefill": lambda: rt.prefill([[1, 2, 3]]), "add_rows": lambda: rt.add_rows([[4]]),
                 "forward": lambda: rt.forward(torch.tensor([[4]])), "commit": lambda: rt.commit([[0]]),
                 "rollback": lambda: rt.rollback([1]), "select_rows": lambda: rt.select_rows([0])}}
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as e:
                print(name, "raised", e, flush=True)
            else:
                print(name, "ran", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stdout[-2000:]}{run.stderr[-2000:]}"
    lines = run.stdout.splitlines()
    for name in ("prefill", "add_rows", "forward", "commit", "rollback", "select_rows"):
        assert f"{name} raised llama.cpp runtime is closed" in lines, run.stdout


def _cached_ends(rt, seqs: range) -> list[int]:
    """Last position llama.cpp's cache holds for each sequence id (-1: none): the cache itself, not
    the runtime's bookkeeping."""
    return [int(rt._L.llama_memory_seq_pos_max(rt._mem, s)) for s in seqs]


def _texts(rt, n: int) -> list[list[int]]:
    """Two real texts of n + 8 tokens (peaked next-token logits, not random ids): prompt and continuation."""
    return [(_ids(rt, s) * n)[:n + 8] for s in ("The quick brown fox jumps over the lazy dog. ",
                                            "One, two, three, four, five, six, seven. ")]


@_model_test
def test_a_chain_forward_that_does_not_fit_leaves_the_runtime_as_before(pair):
    """Two rows leave 72 free cells; a 2 x 40-token forward goes in llama.cpp batches of 64 and
    16 tokens: the first is written, the second finds no room. The runtime must then be as before
    the call (lengths, cache), so the next forward gives a fresh runtime's logits."""
    rt, fresh = pair
    assert rt._n_batch == 64 and rt.max_context == 256  # the sizes below are chosen for these
    texts = _texts(rt, 92)
    rows = [t[:92] for t in texts]
    rt.prefill(rows)
    before = rt.lengths()
    with pytest.raises(RuntimeError, match="KV cache is full"):
        rt.forward(torch.tensor([rows[0][:40], rows[1][:40]]))
    assert rt.lengths() == before and _cached_ends(rt, range(4)) == [91, 91, -1, -1]
    with pytest.raises(RuntimeError, match="without a preceding forward"):
        rt.commit([[0], [0]])  # nothing of the failed forward is pending
    nxt = torch.tensor([[t[92]] for t in texts])
    got = rt.forward(nxt).logits[:, -1]
    rt.commit([[0], [0]])
    assert rt.lengths() == [n + 1 for n in before]
    fresh.prefill(rows)
    want = fresh.forward(nxt).logits[:, -1]
    for b in range(2):
        assert _kl(got[b], want[b]) < 1e-2, b


@_model_test
def test_a_tree_forward_that_does_not_fit_drops_its_sequences_and_leaves_the_runtime_as_before(pair):
    """A 20-node, 2-leaf tree on a row that leaves 16 cells: refused by llama.cpp, then a small
    tree on the same row runs (its temporary sequence id is free again) as on a fresh runtime."""
    rt, fresh = pair
    text = _texts(rt, 240)[0]
    prompt = text[:240]
    rt.prefill([prompt])
    big = with_root(tuple([-1] + list(range(9)) + [-1] + list(range(10, 18))))  # root + branches of 10 and 9
    with pytest.raises(RuntimeError, match="KV cache is full"):
        rt.forward(torch.tensor([prompt[:len(big)]]), tree=layout(big))
    assert rt.lengths() == [240] and _cached_ends(rt, range(4)) == [239, -1, -1, -1]
    small, toks = layout(with_root((-1, -1))), torch.tensor([text[240:243]])
    got = rt.forward(toks, tree=small).logits[0]
    rt.commit([[0, 2]])
    assert rt.lengths() == [242]
    fresh.prefill([prompt])
    want = fresh.forward(toks, tree=small).logits[0]
    for node in range(3):
        assert _kl(got[node], want[node]) < 1e-2, node


@_model_test
def test_gpu_layers_on_a_build_without_gpu_offload_is_refused(monkeypatch):
    """A build with no GPU backend would run gpu_layers: -1 on the CPU without a word: refuse it,
    naming the cause. The default (0) is the CPU and still builds."""
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    for layers in (-1, 4):
        with pytest.raises(ValueError, match=rf"gpu_layers={layers} asks for GPU offload, but this llama.cpp "
                                             r"build has none"):
            _build(n_ctx=256, max_sequences=2, gpu_layers=layers)
    cpu = _build(n_ctx=256, max_sequences=2)
    try:
        assert cpu.config.gpu_layers == 0 and cpu.prefill([[1, 2, 3]]).logits.shape[0] == 1
    finally:
        cpu.close()
    with pytest.raises(ConfigError, match="gpu_layers"):
        SpecConfig.parse(_cfg(gpu_layers=-2))
