"""The generation lock belongs to the runtime: decoders built over one runtime (``from_config(...,
target=rt)``, ``without_speculation()``) used from two threads interleaved their prefills and
commits on its one KV cache (tensor size mismatches, a commit without its forward, wrong tokens).
A second thread is now refused at once; used in turn, every decoder stays exact."""

from __future__ import annotations

import gc
import re
import threading

import pytest
from conftest import tiny_llama
from helpers import hf_generate
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.decoder_lock import BUSY, runtime_lock
from spec_plugins.proposers.draft_model import DraftModelProposer
from support import in_thread

P1 = [2, 3, 4, 2, 3, 4, 2]
P2 = [9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9]
TARGET = {"backend": "torch", "model": "unused: the runtime is given"}


def _refused(fn) -> None:
    """``fn`` run in another thread is refused with the lock's own message."""
    err = in_thread(fn).get("error")
    assert isinstance(err, RuntimeError) and re.fullmatch(re.escape(BUSY), str(err)), err


def test_decoders_over_one_runtime_refuse_a_second_thread_and_stay_exact_in_turn():
    model = tiny_llama(vocab=32, seed=5, sharpness=6.0)
    rt = TorchRuntime(model)
    spec = SpeculativeDecoder.from_config({"target": TARGET, "proposer": {"type": "ngram", "num_draft_tokens": 4}},
                                          target=rt)
    plain = SpeculativeDecoder.from_config({"target": TARGET, "proposer": None}, target=rt)
    want1, want2 = hf_generate(model, [P1], 16, pad=0)[0], hf_generate(model, [P2], 12, pad=0)[0]

    stream = spec.stream(P1, 16)  # held open in this thread: the runtime holds its row
    first = next(stream)
    assert first.finish_reason is None
    _refused(lambda: plain.generate(P2, 12))
    _refused(lambda: plain.without_speculation().generate(P2, 12))
    _refused(lambda: spec.without_speculation().generate(P2, 12))
    rest = [t for ev in stream for t in ev.token_ids]
    assert first.token_ids + rest == want1  # the refused calls left the open stream's rows alone

    stream = plain.stream(P2, 12)  # and the other way round
    first = next(stream)
    _refused(lambda: spec.generate(P1, 16))
    stream.close()
    assert in_thread(lambda: spec.generate(P1, 16).token_ids) == {"value": want1}  # closed: free again
    for dec in (spec, plain, spec.without_speculation(), plain):  # in turn, over the one cache
        assert dec.generate(P2, 12).token_ids == want2
        assert dec.generate(P1, 16).token_ids == want1


def _two_targets_one_draft(n: int = 12):
    """Decoders over two targets sharing one draft model's runtime, that runtime, and each target's
    transformers greedy output (P1 on the first, P2 on the second, ``n`` tokens)."""
    model_a, model_b = tiny_llama(vocab=32, seed=5, sharpness=6.0), tiny_llama(vocab=32, seed=6, sharpness=6.0)
    draft = TorchRuntime(tiny_llama(vocab=32, seed=7, sharpness=6.0))
    rt_a, rt_b = TorchRuntime(model_a), TorchRuntime(model_b)
    dec_a = SpeculativeDecoder(rt_a, DraftModelProposer(None, target=rt_a, runtime=draft))
    dec_b = SpeculativeDecoder(rt_b, DraftModelProposer(None, target=rt_b, runtime=draft))
    return dec_a, dec_b, draft, hf_generate(model_a, [P1], n, pad=0)[0], hf_generate(model_b, [P2], n, pad=0)[0]


def test_a_draft_runtime_shared_by_two_targets_decoders_refuses_a_second_thread():
    """Two targets, one draft model's runtime: its cache holds one batch's rows too."""
    dec_a, dec_b, draft, want_a, want_b = _two_targets_one_draft()

    stream = dec_a.stream(P1, 12)
    first = next(stream)
    _refused(lambda: dec_b.generate(P2, 12))
    # dec_b's own target is free: the refusal took nothing with it
    assert in_thread(lambda: dec_b.without_speculation().generate(P2, 12).token_ids) == {"value": want_b}
    assert first.token_ids + [t for ev in stream for t in ev.token_ids] == want_a
    assert not dec_a.generation_lock.held and not dec_b.generation_lock.held
    assert in_thread(lambda: dec_b.generate(P2, 12).token_ids) == {"value": want_b}
    assert dec_a.generate(P1, 12).token_ids == want_a


def test_a_runtime_lock_is_keyed_by_identity_and_ends_with_its_runtime():
    """Keyed by identity: runtimes that compare equal (or are unhashable) each have their own lock,
    and a runtime that died holding its lock leaves it to nobody: a later runtime reusing its id
    used to find that lock held and be refused. A runtime that cannot be weakly referenced is
    refused by name (its lock could not end with it)."""
    class Slotted:
        __slots__ = ("x",)

    with pytest.raises(TypeError, match=r"runtime .*Slotted cannot be weakly referenced.*__weakref__"):
        runtime_lock(Slotted())

    class Same:  # equal to every other, so unhashable
        def __eq__(self, other: object) -> bool:
            return True

    a, b = Same(), Same()
    assert runtime_lock(a) is runtime_lock(a) and runtime_lock(a) is not runtime_lock(b)
    left_held, old = runtime_lock(b), id(b)
    with runtime_lock(a).holding():
        _refused(lambda: runtime_lock(a).acquire())
        assert in_thread(left_held.acquire) == {"value": True}  # held by a thread that ended
    del b
    gc.collect()
    made = [Same()]
    while id(made[-1]) != old and len(made) < 100_000:  # until CPython hands the freed memory out again
        made.append(Same())
    if id(made[-1]) != old:
        pytest.skip(f"CPython did not hand the freed id out again in {len(made)} objects")
    assert not runtime_lock(made[-1]).held
    left_held.release()


def test_a_joint_waiter_holds_no_runtime_while_it_waits():
    """The server waits for its decoder's lock (target + a draft model's runtime) while a stream of
    another decoder holds the shared draft runtime: it used to take the target's lock and keep it
    while blocking on the draft's, refusing every generation on the idle target meanwhile."""
    served, other, draft, want_a, want_b = _two_targets_one_draft()
    joint, draft_lock = served.generation_lock, runtime_lock(draft)
    waiting = threading.Event()

    class Signals(threading.Condition):  # says when the waiter blocks on the draft runtime's lock
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    draft_lock._free = Signals(draft_lock._guard)
    for first in (runtime_lock(served.target), draft_lock):  # whichever the joint lock tries first
        joint.locks.sort(key=lambda lock: lock is not first)
        waiting.clear()
        stream = other.stream(P2, 12)
        head = next(stream)  # holds the draft runtime (and rt_b) in this thread
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(joint.acquire(wait=True, timeout=120)))
        waiter.start()
        assert waiting.wait(120)
        plain = in_thread(lambda: served.without_speculation().generate(P1, 12).token_ids)
        assert plain == {"value": want_a}, plain  # the idle target serves meanwhile
        assert head.token_ids + [t for ev in stream for t in ev.token_ids] == want_b
        waiter.join(120)
        assert got == [True] and joint.held
        joint.release()
        assert not joint.held


def test_streams_interleaved_over_a_shared_draft_runtime_are_caught():
    """Two decoders sharing a draft model's runtime, their streams interleaved in one thread: the
    second's batch takes the draft runtime over (its cache now holds that batch's rows), so the
    first refuses to go on instead of drafting over the other's cache."""
    dec_a, dec_b, draft, want_a, want_b = _two_targets_one_draft(16)

    sa, sb = dec_a.stream(P1, 16), dec_b.stream(P2, 16)
    first_a, first_b = next(sa), next(sb)
    assert first_a.finish_reason is None
    with pytest.raises(RuntimeError, match="another generation on this decoder started before this one finished"):
        next(sa)
    assert first_b.token_ids + [t for ev in sb for t in ev.token_ids] == want_b  # b's rows were left alone
    assert dec_a.generate(P1, 16).token_ids == want_a
    assert not dec_a.generation_lock.held and not dec_b.generation_lock.held
