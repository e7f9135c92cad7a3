"""Continuous batching: rows joining a running batch decode exactly as they would alone."""

from __future__ import annotations

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.batching import ContinuousBatch, ForwardCost, LoadAwareDraftLength, RowRequest
from spec_plugins.config import SamplingConfig
from spec_plugins.proposers.base import Proposer
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.stats import DecodeStats
from spec_plugins.verifiers import ExactVerifier

PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 7], [9], [4] * 14 + [2], [7, 8, 9, 10, 7, 8]]


def _drive(batch: ContinuousBatch, schedule: dict[int, list[RowRequest]], cancel: dict[int, list] | None = None):
    """Run rounds; ``schedule[r]`` joins before round r, ``cancel[r]`` leaves before round r."""
    outs: dict = {}
    r = 0
    while len(batch) or any(k >= r for k in schedule):
        if cancel and r in cancel:
            batch.remove(cancel[r])
        for em in batch.add(schedule.get(r, [])):
            outs.setdefault(em.key, []).extend(em.tokens)
        for em in batch.step():
            outs.setdefault(em.key, []).extend(em.tokens)
        r += 1
        assert r < 500
    return outs


def _proposer(kind: str, target: TorchRuntime) -> Proposer:
    if kind == "ngram":
        return NgramProposer(NgramProposer.Config())
    return DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4)))


@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_rows_joining_running_batch_equal_solo_greedy(kind, k):
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = ContinuousBatch(target, _proposer(kind, target), ExactVerifier(), draft_length=lambda b: k)
    limits = [20, 15, 25, 30, 9]
    reqs = [RowRequest(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, limits))]
    # row 0 alone, two join after 3 rounds (longer and shorter prompts), one after 4, one after 12
    outs = _drive(batch, {0: [reqs[0]], 3: [reqs[1], reqs[2]], 4: [reqs[3]], 12: [reqs[4]]})
    for i, (p, n) in enumerate(zip(PROMPTS, limits)):
        assert outs[i] == plain_greedy(model, p, n), (kind, k, i)
    assert len(batch) == 0 and target.lengths() == []


def test_cancelled_row_frees_slot_and_others_continue():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = ContinuousBatch(target, _proposer("draft", target), ExactVerifier(), draft_length=lambda b: 3)
    reqs = [RowRequest(i, p, 30) for i, p in enumerate(PROMPTS[:3])]
    outs = _drive(batch, {0: reqs[:2], 2: [reqs[2]]}, cancel={4: [1]})
    assert len(outs[1]) < 30  # cut short
    assert outs[1] == plain_greedy(model, PROMPTS[1], 30)[: len(outs[1])]
    for i in (0, 2):
        assert outs[i] == plain_greedy(model, PROMPTS[i], 30)


def test_batch_empties_then_restarts():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = ContinuousBatch(target, _proposer("draft", target), ExactVerifier(), draft_length=lambda b: 2)
    first = _drive(batch, {0: [RowRequest("a", PROMPTS[0], 5)]})
    second = _drive(batch, {0: [RowRequest("b", PROMPTS[1], 12)], 1: [RowRequest("c", PROMPTS[2], 7)]})
    assert first["a"] == plain_greedy(model, PROMPTS[0], 5)
    assert second["b"] == plain_greedy(model, PROMPTS[1], 12)
    assert second["c"] == plain_greedy(model, PROMPTS[2], 7)


def test_eos_finishes_row():
    model = tiny_llama(seed=3)
    ref = plain_greedy(model, PROMPTS[0], 30)
    eos = ref[6]
    batch = ContinuousBatch(TorchRuntime(model), NgramProposer(NgramProposer.Config()), ExactVerifier(), [eos],
                            draft_length=lambda b: 4)
    outs = _drive(batch, {0: [RowRequest(0, PROMPTS[0], 30)], 1: [RowRequest(1, PROMPTS[1], 10)]})
    assert outs[0] == ref[: ref.index(eos) + 1]


def test_per_row_sampling_seeded_reproducible_and_mixed_with_greedy():
    model = tiny_llama(seed=3, sharpness=2.0)
    hot = SamplingConfig(temperature=1.0, top_k=8)

    def run(with_neighbours: bool):
        target = TorchRuntime(model)
        batch = ContinuousBatch(target, _proposer("draft", target), ExactVerifier(), draft_length=lambda b: 3)
        sched = {0: [RowRequest("s", PROMPTS[0], 25, hot, seed=123)]}
        if with_neighbours:
            sched[0].append(RowRequest("g", PROMPTS[1], 25))
            sched[2] = [RowRequest("t", PROMPTS[2], 25, SamplingConfig(temperature=0.7), seed=5)]
        return _drive(batch, sched)

    a, b, alone = run(True), run(True), run(False)
    assert a["s"] == b["s"] and a["t"] == b["t"]  # per-request seeds reproduce
    assert a["g"] == plain_greedy(model, PROMPTS[1], 25)  # greedy rows unaffected by sampled neighbours
    assert len(alone["s"]) == 25
    other = run(True)
    assert other["s"] == a["s"]


def test_sampling_rows_follow_target_distribution():
    """Two-token joint law of a sampled row decoded next to a greedy row: chi-square vs exact."""
    from helpers import chi_square_pvalue, exact_joint

    from spec_plugins.sampling import LogitsPipeline

    model = tiny_llama(vocab=8, seed=5, sharpness=1.5)
    draft = tiny_llama(vocab=8, seed=6, sharpness=1.5)
    s = SamplingConfig(temperature=1.0)
    exact = exact_joint(model, [1, 2, 3], 2, LogitsPipeline(s))
    target = TorchRuntime(model)
    batch = ContinuousBatch(target, DraftModelProposer(None, target=target, runtime=TorchRuntime(draft)),
                            ExactVerifier(), draft_length=lambda b: 2, seed=7)
    samples = []
    for i in range(60):  # 25 sampled rows per batch (shared generator) next to a greedy row
        rows = [RowRequest("g", [4, 5], 2)] + [RowRequest(j, [1, 2, 3], 2, s) for j in range(25)]
        outs = _drive(batch, {0: rows[:10], 1: rows[10:]})
        samples += [tuple(outs[j]) for j in range(25)]
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_load_aware_policy_shrinks_with_cost():
    stats = DecodeStats(accepted_by_position=[80, 60, 40], drafted_by_position=[100, 100, 100])
    # batch 1: verifying 4 tokens costs as much as 1 -> draft the most; batch 16: cost linear in tokens -> none
    table = {(1, n): 1.0 for n in range(1, 5)} | {(16, n): float(n) for n in range(1, 5)}
    policy = LoadAwareDraftLength(ForwardCost(table), 3, stats)
    assert policy(1) == 3 and policy.last["draft_length"] == 3
    assert policy(16) == 0
    assert 0 <= policy(8) <= 3
    # with nothing accepted, drafting never pays even when verification is free
    bad = LoadAwareDraftLength(ForwardCost({(1, n): 1.0 + 0.01 * n for n in range(1, 5)}), 3,
                               DecodeStats(accepted_by_position=[0] * 3, drafted_by_position=[10000] * 3))
    assert bad(1) == 0


def test_load_aware_policy_per_key():
    """Rows keyed by the n-gram match length: strong keys carry a padded draft at small batches,
    a batch of rows whose key never gets accepted stops drafting, and unmatched rows add nothing."""
    table = {(b, n): b * (1.0 + 0.7 * (n > 1) + 0.02 * n) for b in (1, 16) for n in range(1, 6)}
    policy = LoadAwareDraftLength(ForwardCost(table), 4, DecodeStats())
    for _ in range(50):
        policy.observe_rows([3, 1, 0], [4, 4, 4], [4, 4, 0], [4, 0, 0])
    assert policy(1, [3]) == 4 and policy.last["draft_length"] == 4
    assert policy(1, [1]) == 0 and policy(1, [0]) == 0
    assert policy(16, [1] * 16) == 0 and policy(16, [0] * 16) == 0
    assert policy(16, [3] * 16) == 4


def test_keyed_policy_in_the_batch_keeps_greedy_outputs():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    table = {(b, n): 1.0 + 0.1 * b * n for b in (1, 8) for n in range(1, 6)}
    policy = LoadAwareDraftLength(ForwardCost(table), 4, DecodeStats())
    batch = ContinuousBatch(target, _proposer("ngram", target), ExactVerifier(), draft_length=policy)
    limits = [20, 15, 25, 30, 9]
    reqs = [RowRequest(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, limits))]
    outs = _drive(batch, {0: [reqs[0]], 3: [reqs[1], reqs[2]], 4: [reqs[3]], 12: [reqs[4]]})
    for i, (p, n) in enumerate(zip(PROMPTS, limits)):
        assert outs[i] == plain_greedy(model, p, n)
    assert policy._by_key  # the batch fed per-key evidence back


def test_online_forward_cost_shrinks_drafts_when_served_forwards_cost_more():
    """A startup grid that says verifying is free, then forwards that cost n x one token: the
    policy learns it from the batch's own forwards and stops drafting long."""
    from spec_plugins.batching import OnlineForwardCost

    stats = DecodeStats(accepted_by_position=[60, 40, 25, 15], drafted_by_position=[100] * 4)
    grid = ForwardCost({(b, n): 0.01 * b for b in (1, 8) for n in range(1, 6)})
    cost = OnlineForwardCost(grid, 5)
    policy = LoadAwareDraftLength(cost, 4, stats)
    assert policy(1) == 4  # as measured at startup: free verification, draft the most
    for _ in range(30):
        for n in (1, 2, 5):
            policy.observe_forward(1, n, 0.01 * n)  # real forwards: linear in tokens per row
    assert cost.ratio(1) == pytest.approx(1.0, abs=0.05) and cost.ratio(5) > 4.5
    assert 2.5 < cost.ratio(3) < 3.5  # unseen width: between its seen neighbours
    assert cost(8, 5) > 4 * grid(8, 5)  # one ratio per width, for every batch size
    assert policy(1) <= 1
    with pytest.raises(ValueError, match="max_tokens"):
        OnlineForwardCost(grid, 0)


def test_batch_feeds_its_forwards_to_an_online_cost():
    from spec_plugins.batching import OnlineForwardCost

    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    grid = ForwardCost({(b, n): 1e-9 * b * n for b in (1, 4) for n in range(1, 6)})  # far too cheap
    cost = OnlineForwardCost(grid, 5)
    policy = LoadAwareDraftLength(cost, 4, DecodeStats())
    batch = ContinuousBatch(target, _proposer("ngram", target), ExactVerifier(), draft_length=policy)
    outs = _drive(batch, {0: [RowRequest(0, PROMPTS[0], 12)]})
    assert outs[0] == plain_greedy(model, PROMPTS[0], 12)
    seen = [n for n in range(1, 6) if cost.online._cnt[n - 1] > 0]
    assert seen and all(cost.ratio(n) > 10 for n in seen)  # real forwards took far longer than the grid


def test_measured_forward_cost_grid_is_complete_and_monotone():
    from spec_plugins.batching import measure_forward_cost

    target = TorchRuntime(tiny_llama(seed=3))
    cost = measure_forward_cost(target, [1, 3], [1, 2, 4], context=8, repeats=3)
    assert set(cost.table) == {(b, n) for b in (1, 3) for n in (1, 2, 4)}
    for b in (1, 3):
        ts = [cost.table[(b, n)] for n in (1, 2, 4)]
        assert all(t > 0 for t in ts) and ts == sorted(ts)
    assert target.lengths() == []  # calibration leaves no rows behind


def test_refuses_proposer_without_admit():
    class Fixed(Proposer):
        def propose(self, ctx):
            return None

    with pytest.raises(ValueError, match="no admit"):
        ContinuousBatch(TorchRuntime(tiny_llama()), Fixed(), ExactVerifier())


def test_add_rows_cache_equals_fresh_prefill():
    model = tiny_llama(seed=2)
    rt = TorchRuntime(model)
    rt.prefill([[1, 2, 3]])
    rt.forward(torch.tensor([[4, 5]]))
    rt.commit([[0, 1]])
    out = rt.add_rows([[6, 7, 8, 9, 10, 11, 12], [13]])
    solo = TorchRuntime(model)
    torch.testing.assert_close(out.logits[:, -1], torch.stack([TorchRuntime(model).prefill([r]).logits[0, -1]
                                                                for r in ([6, 7, 8, 9, 10, 11, 12], [13])]),
                               atol=1e-4, rtol=1e-4)
    assert rt.lengths() == [5, 7, 1]
    step = rt.forward(torch.tensor([[20], [21], [22]])).logits[:, -1]
    for b, seq in enumerate([[1, 2, 3, 4, 5, 20], [6, 7, 8, 9, 10, 11, 12, 21], [13, 22]]):
        torch.testing.assert_close(step[b], solo.prefill([seq]).logits[0, -1], atol=1e-4, rtol=1e-4)
