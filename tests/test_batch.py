"""The one batch and round: rows joining a running batch decode exactly as they would alone, for
every proposer kind (hidden-state heads included), per-row sampling and seeds, cancellation, the
keyed load-aware policy inside the batch, and the contracts checked when a batch is built."""

from __future__ import annotations

import pytest
import torch
from helpers import plain_greedy
from test_heads import eagle_prop, medusa_prop

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import Batch, decode, run_round
from spec_plugins.policy import AutoDraftLength, DraftPolicy, FixedLength, ForwardCost, OnlineCost
from spec_plugins.proposers.base import Proposer, check_proposer_class
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 7], [9], [4] * 14 + [2], [7, 8, 9, 10, 7, 8]]
LIMITS = [20, 15, 25, 30, 9]


def drive(batch: Batch, policy, schedule: dict[int, list[RowRequest]], cancel: dict[int, list] | None = None):
    """Run rounds; ``schedule[r]`` joins before round r, ``cancel[r]`` leaves before round r."""
    policy = DraftPolicy.of(policy)
    outs: dict = {}
    r = 0
    while len(batch) or any(k >= r for k in schedule):
        if cancel and r in cancel:
            batch.remove(cancel[r])
        for em in batch.add(schedule.get(r, [])):
            outs.setdefault(em.key, []).extend(em.tokens)
        record = run_round(batch, policy)
        for em in record.emissions if record is not None else []:
            outs.setdefault(em.key, []).extend(em.tokens)
        r += 1
        assert r < 500
    return outs


def proposer(kind: str, target: TorchRuntime, model) -> Proposer:
    return {"ngram": lambda: NgramProposer(NgramProposer.Config()),
            "draft": lambda: DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4))),
            "medusa-tree": lambda: medusa_prop(model, "tree"),
            "eagle-tree": lambda: eagle_prop(model, "tree"),
            "eagle-chain": lambda: eagle_prop(model, "chain")}[kind]()


@pytest.mark.parametrize("kind", ["ngram", "draft", "medusa-tree", "eagle-tree", "eagle-chain"])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_rows_joining_running_batch_equal_solo_greedy(kind, k):
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = Batch(target, proposer(kind, target, model), ExactVerifier())
    reqs = [RowRequest(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    # row 0 alone, two join after 3 rounds (longer and shorter prompts), one after 4, one after 12
    outs = drive(batch, FixedLength(k), {0: [reqs[0]], 3: [reqs[1], reqs[2]], 4: [reqs[3]], 12: [reqs[4]]})
    for i, (p, n) in enumerate(zip(PROMPTS, LIMITS)):
        assert outs[i] == plain_greedy(model, p, n), (kind, k, i)
    assert len(batch) == 0 and target.lengths() == []
    if k:
        assert batch.stats.draft_tokens > 0


def test_cancelled_row_frees_slot_and_others_continue():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = Batch(target, proposer("draft", target, model), ExactVerifier())
    reqs = [RowRequest(i, p, 30) for i, p in enumerate(PROMPTS[:3])]
    outs = drive(batch, FixedLength(3), {0: reqs[:2], 2: [reqs[2]]}, cancel={4: [1]})
    assert len(outs[1]) < 30  # cut short
    assert outs[1] == plain_greedy(model, PROMPTS[1], 30)[: len(outs[1])]
    for i in (0, 2):
        assert outs[i] == plain_greedy(model, PROMPTS[i], 30)


def test_batch_empties_then_restarts_and_a_new_batch_resets_the_runtime():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = Batch(target, proposer("draft", target, model), ExactVerifier())
    first = drive(batch, FixedLength(2), {0: [RowRequest("a", PROMPTS[0], 5)]})
    second = drive(batch, FixedLength(2), {0: [RowRequest("b", PROMPTS[1], 12)], 1: [RowRequest("c", PROMPTS[2], 7)]})
    assert first["a"] == plain_greedy(model, PROMPTS[0], 5)
    assert second["b"] == plain_greedy(model, PROMPTS[1], 12)
    assert second["c"] == plain_greedy(model, PROMPTS[2], 7)
    batch.add([RowRequest("left", PROMPTS[3], 9)])  # an abandoned batch leaves a row behind ...
    fresh = Batch(target, NgramProposer(NgramProposer.Config()), ExactVerifier())  # ... a new one drops it
    assert target.lengths() == []
    assert drive(fresh, FixedLength(3), {0: [RowRequest(0, PROMPTS[4], 9)]})[0] == plain_greedy(model, PROMPTS[4], 9)


def test_eos_finishes_row_and_zero_token_rows_finish_at_once():
    model = tiny_llama(seed=3)
    ref = plain_greedy(model, PROMPTS[0], 30)
    eos = ref[6]
    target = TorchRuntime(model)
    batch = Batch(target, NgramProposer(NgramProposer.Config()), ExactVerifier(), [eos])
    outs = drive(batch, FixedLength(4), {0: [RowRequest(0, PROMPTS[0], 30)], 1: [RowRequest(1, PROMPTS[1], 10)]})
    assert outs[0] == ref[: ref.index(eos) + 1]
    ems = batch.add([RowRequest("none", PROMPTS[2], 0)])
    assert [(e.tokens, e.finish_reason) for e in ems] == [([], "length")] and len(batch) == 0
    assert target.lengths() == []


def test_per_row_sampling_seeded_reproducible_and_mixed_with_greedy():
    model = tiny_llama(seed=3, sharpness=2.0)
    hot = SamplingConfig(temperature=1.0, top_k=8)

    def run(with_neighbours: bool):
        target = TorchRuntime(model)
        batch = Batch(target, proposer("draft", target, model), ExactVerifier())
        sched = {0: [RowRequest("s", PROMPTS[0], 25, hot, seed=123)]}
        if with_neighbours:
            sched[0].append(RowRequest("g", PROMPTS[1], 25))
            sched[2] = [RowRequest("t", PROMPTS[2], 25, SamplingConfig(temperature=0.7), seed=5)]
        return drive(batch, FixedLength(3), sched)

    a, b, alone = run(True), run(True), run(False)
    assert a["s"] == b["s"] and a["t"] == b["t"]  # per-request seeds reproduce
    assert a["g"] == plain_greedy(model, PROMPTS[1], 25)  # greedy rows unaffected by sampled neighbours
    assert len(alone["s"]) == 25


def test_sampling_rows_follow_target_distribution():
    """Two-token joint law of a sampled row decoded next to a greedy row: chi-square vs exact."""
    from helpers import chi_square_pvalue, exact_joint

    from spec_plugins.sampling import LogitsPipeline

    model = tiny_llama(vocab=8, seed=5, sharpness=1.5)
    draft = tiny_llama(vocab=8, seed=6, sharpness=1.5)
    s = SamplingConfig(temperature=1.0)
    exact = exact_joint(model, [1, 2, 3], 2, LogitsPipeline(s))
    target = TorchRuntime(model)
    batch = Batch(target, DraftModelProposer(None, target=target, runtime=TorchRuntime(draft)), ExactVerifier(),
                  seed=7)
    samples = []
    for i in range(60):  # 25 sampled rows per batch (shared generator) next to a greedy row
        rows = [RowRequest("g", [4, 5], 2)] + [RowRequest(j, [1, 2, 3], 2, s) for j in range(25)]
        outs = drive(batch, FixedLength(2), {0: rows[:10], 1: rows[10:]})
        samples += [tuple(outs[j]) for j in range(25)]
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_keyed_load_aware_policy_in_the_batch_keeps_greedy_outputs_and_learns_online():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    grid = ForwardCost({(b, n): 1e-9 * b * n for b in (1, 8) for n in range(1, 6)})  # far too cheap
    policy = AutoDraftLength(OnlineCost(grid), max_k=4, min_gain=1.05)
    batch = Batch(target, proposer("ngram", target, model), ExactVerifier())
    reqs = [RowRequest(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    outs = drive(batch, policy, {0: [reqs[0]], 3: [reqs[1], reqs[2]], 4: [reqs[3]], 12: [reqs[4]]})
    for i, (p, n) in enumerate(zip(PROMPTS, LIMITS)):
        assert outs[i] == plain_greedy(model, p, n)
    assert policy.by_key  # the batch fed per-key evidence back
    online = policy.costs.forward  # the policy's costs learnt from the rounds (Costs.observe)
    seen = [n for n in range(1, 6) if online._cnt[n - 1] > 0]
    assert seen and all(online.ratio(n) > 10 for n in seen)  # real forwards took far longer


def test_stats_are_per_sequence_per_round_with_the_batch_figure_apart():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = Batch(target, NgramProposer(NgramProposer.Config()), ExactVerifier())
    drive(batch, FixedLength(4), {0: [RowRequest(i, PROMPTS[1], 20) for i in range(4)]})
    st = batch.stats
    assert st.row_rounds == 4 * st.target_forwards
    assert st.mean_accepted_tokens == pytest.approx(st.emitted_tokens / st.row_rounds)
    assert st.tokens_per_forward == pytest.approx(4 * st.mean_accepted_tokens)
    assert 1.0 <= st.mean_accepted_tokens <= 5.0  # one row can emit at most k + 1 per round


def test_contracts_are_checked_once_when_built():
    class Half(Proposer):  # admits rows but cannot drop them: would mix rows up in a batch
        def propose(self, ctx):
            return None

        def admit(self, prompts):
            pass

        def num_rows(self):
            return 0

    with pytest.raises(TypeError, match="RowAware partly"):
        check_proposer_class(Half)
    with pytest.raises(TypeError, match="RowAware partly"):
        Batch(TorchRuntime(tiny_llama()), Half(), ExactVerifier())

    class Tree(Proposer):
        tree = True

        def propose(self, ctx):
            return None

    class ChainOnly(TorchRuntime):
        pass

    rt = ChainOnly(tiny_llama())
    rt.capabilities = type(rt.capabilities)(tree_mask=False, hidden_states=False, name="chain-only")
    with pytest.raises(ValueError, match="cannot verify a tree mask"):
        Batch(rt, Tree(), ExactVerifier())
    with pytest.raises(ValueError, match="hidden states"):
        Batch(rt, medusa_prop(tiny_llama(), "chain"), ExactVerifier())


def test_registration_refuses_a_runtime_without_the_contract():
    from spec_plugins.registry import BACKENDS

    class NoCommit:
        def prefill(self, rows, want_hidden=False): ...

        @classmethod
        def from_config(cls, config): ...

    with pytest.raises(TypeError, match="missing add_rows, forward, commit"):
        BACKENDS.register("broken-test-runtime")(NoCommit)
    assert "broken-test-runtime" not in BACKENDS.names()


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


def test_a_proposers_observe_counts_in_the_rounds_total():
    # a ticking clock (no wall time): each reading advances one second, the proposer's observe a
    # hundred more; the round's total must hold its draft share, observe included
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    runtime = TorchRuntime(tiny_llama(seed=3))
    prop = NgramProposer(NgramProposer.Config())
    seen = prop.observe

    def slow(record) -> None:
        now[0] += 100.0
        seen(record)

    prop.observe = slow
    stats = DecodeStats()
    for _ in decode(runtime, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), [[1, 2, 3, 1, 2, 3]], 12,
                    stats=stats, draft_length=FixedLength(3), clock=clock):
        pass
    assert stats.target_forwards >= 2
    assert stats.time_draft >= 100.0 * stats.target_forwards
    assert stats.time_total > stats.time_draft
