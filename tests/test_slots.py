"""The one KV slot layer (``spec_plugins/slots.py``) and the runtime base over it: positions, holes,
plans and masks, checked against what the model computes from a fresh prefill of each row."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from spec_plugins.slots import KVSlots, SlotPlan, keep_index
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.tree import layout, with_root


def fresh_logits(model, seq: list[int]) -> torch.Tensor:
    return TorchRuntime(model).prefill([seq]).logits[0, -1]


def test_positions_holes_and_plans_of_a_commit():
    s = KVSlots()
    assert s.prefill([3, 1]).tolist() == [[0, 1, 2], [-1, -1, 0]]
    assert s.holes and s.next == [3, 1]
    assert s.forward(torch.arange(3)).tolist() == [[3, 4, 5], [1, 2, 3]]
    assert s.pending_commit
    plan = s.commit([[0, 1, 2], [0, 1, 2]])  # all kept by every row: a no-op crop
    assert plan.gather is None and plan.slots == 6 and s.next == [6, 4]
    s.forward(torch.arange(3))
    plan = s.commit([[0], [0, 1, 2]])  # different counts: a tail gather, holes where a row kept less
    assert plan.start == 6 and plan.gather.tolist() == [[0, 0, 0], [0, 1, 2]]
    assert s.pos[:, 6:].tolist() == [[6, -1, -1], [4, 5, 6]] and s.next == [7, 7]
    tree = layout(with_root((-1, -1, 0)))  # root, two children of it, a grandchild under the first
    s.forward(tree.depth)
    plan = s.commit([[0, 2], [0, 1, 3]])
    assert s.pos[:, 9:].tolist() == [[7, 8, -1], [7, 8, 9]] and s.next == [9, 10]
    with pytest.raises(RuntimeError, match="without a preceding forward"):
        s.commit([[0]])


def test_rollback_select_append_compact():
    s = KVSlots()
    s.prefill([4, 2])
    s.forward(torch.arange(2))
    s.commit([[0, 1], [0]])
    assert s.rollback([3, 9]).slots == 5 and s.pos.tolist() == [[0, 1, 2, -1, -1], [-1, -1, 0, 1, 2]]
    assert s.next == [3, 3]
    idx, plan = s.select_rows([1])
    assert idx.tolist() == [1] and plan.slots == 5 and s.next == [3]
    other = KVSlots()
    other.prefill([7])
    pads = s.append_rows(other)
    assert pads == (2, 0) and s.slots == 7 and s.next == [3, 7]
    plan = s.compact()
    assert s.slots == 7 and s.pos[0].tolist() == [-1, -1, -1, -1, 0, 1, 2]
    empty = KVSlots.empty(2)
    assert empty.rows == 2 and empty.slots == 0 and not empty.mostly_holes()


def test_plans_apply_in_place_where_the_tail_fits():
    kv = torch.arange(2 * 1 * 5 * 1, dtype=torch.float32).reshape(2, 1, 5, 1)
    out = SlotPlan(4, 2, torch.tensor([[2, 0], [1, 2]])).apply(kv)
    assert out[:, 0, :, 0].tolist() == [[0, 1, 4, 2], [5, 6, 8, 9]]
    assert out.data_ptr() == kv.data_ptr()  # written into the same storage (O(tail), no copy)
    assert SlotPlan(3).apply(kv).shape[2] == 3
    idx, pos = keep_index([[0, 2], [1]], torch.tensor([[5, 6, 7], [5, 6, 7]]))
    assert idx.tolist() == [[0, 2], [1, 0]] and pos.tolist() == [[5, 7], [6, -1]]


def test_masks_hide_holes_and_non_ancestors():
    s = KVSlots()
    s.prefill([2, 1])
    tree = layout(with_root((-1, -1)))
    s.forward(tree.depth)
    m = s.forward_mask(tree.ancestors, torch.float32)
    assert m.shape == (2, 1, 3, 5)
    ok = m[:, 0] == 0
    assert ok[1, :, 0].tolist() == [False] * 3  # row 1's padding slot is never attended
    assert ok[0, 2, 2:].tolist() == [True, False, True]  # a node sees the root and itself, not its sibling
    pm = s.prefill_mask(0, 2, torch.float32) == 0
    assert pm[1, 0, 0].tolist() == [True, False]  # a padding query attends to itself only


@pytest.mark.parametrize("chunk", [None, 3])
def test_runtime_commits_rollback_select_and_compaction_keep_outputs_exact(chunk):
    """Through every plan (tree commits with holes, rollback, row selection, compaction, chunked
    prefill), each row's next logits equal a fresh prefill of its sequence."""
    model = tiny_llama(vocab=32, seed=5)
    rt = TorchRuntime(model)
    rt.prefill_chunk = chunk
    seqs = [[1, 2, 3, 4, 5, 6, 7], [7, 8]]
    rt.prefill(seqs)
    tree = layout(with_root((-1, -1, 0, 1, 1)))
    toks = [[9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20]]
    rt.forward(torch.tensor(toks), tree)
    keeps = [[0, 2, 5], [0]]
    rt.commit(keeps)
    seqs = [s + [toks[b][j] for j in k] for b, (s, k) in enumerate(zip(seqs, keeps))]
    assert rt.lengths() == [len(s) for s in seqs] and rt.slots.holes
    rt.forward(torch.tensor([[3, 4], [5, 6]]))
    rt.commit([[0], [0, 1]])
    seqs = [seqs[0] + [3], seqs[1] + [5, 6]]
    rt.rollback([len(seqs[0]) - 1, len(seqs[1])])
    seqs[0] = seqs[0][:-1]
    rt._apply(rt.slots.compact())
    rt.select_rows([1, 0])
    seqs = seqs[::-1]
    nxt = torch.tensor([[seqs[0][-1] % 32], [seqs[1][-1] % 32]])
    rt.rollback([len(s) - 1 for s in seqs])  # re-feed each row's last token
    got = rt.forward(nxt).logits[:, -1]
    for b, s in enumerate(seqs):
        torch.testing.assert_close(got[b], fresh_logits(model, s[:-1] + [int(nxt[b])]), atol=1e-4, rtol=1e-4)


def test_failed_add_rows_leaves_the_running_rows_as_they_were():
    model = tiny_llama(vocab=32, seed=5, max_pos=32)
    rt = TorchRuntime(model)
    rt.prefill([[1, 2, 3], [4, 5]])
    before_pos, before_kv = rt.slots.pos.clone(), [t.clone() for t in rt.kv]
    with pytest.raises(ValueError, match="exceeds the context"):
        rt.add_rows([list(range(40))])
    inner = rt._call

    def boom(ids, *a, **k):  # the engine fails on the new rows' prefill, after the runtime reset for it
        if ids.shape[0] == 1:
            raise RuntimeError("engine failed")
        return inner(ids, *a, **k)

    rt._call = boom
    with pytest.raises(RuntimeError, match="engine failed"):
        rt.add_rows([[9, 9, 9]])
    rt._call = inner
    assert torch.equal(rt.slots.pos, before_pos) and rt.lengths() == [3, 2]
    assert all(torch.equal(a, b) for a, b in zip(rt.kv, before_kv))
    got = rt.forward(torch.tensor([[6], [7]])).logits[:, -1]
    torch.testing.assert_close(got[1], fresh_logits(model, [4, 5, 7]), atol=1e-4, rtol=1e-4)


def test_runtimes_compact_holes_past_a_quarter_of_the_slot_axis():
    """Rows that accept different counts leave holes every forward attends over; the slot runtime
    squeezes them out once they pass ``compact_holes`` of the axis, outputs unchanged."""
    model = tiny_llama(vocab=32, seed=5)
    rt = TorchRuntime(model)
    seqs = [[1, 2, 3, 4], [4, 3, 2, 1]]
    rt.prefill(seqs)
    toks = [[7, 8, 9, 10, 11, 12]] * 2
    for i in range(8):
        keep = [[0], list(range(6))] if i % 2 else [list(range(6)), [0]]
        rt.forward(torch.tensor(toks))
        rt.commit(keep)
        seqs = [s + [toks[b][j] for j in k] for b, (s, k) in enumerate(zip(seqs, keep))]
        assert rt.slots.hole_share() <= rt.compact_holes
    got = rt.forward(torch.tensor([[5], [6]])).logits[:, -1]
    for b, s in enumerate(seqs):
        torch.testing.assert_close(got[b], fresh_logits(model, s + [5 + b]), atol=1e-4, rtol=1e-4)

