"""The measured cost model: monotone fit, interpolation, measurement through the Runtime contract."""

from __future__ import annotations

import pytest
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.costmodel import CostModel, cost_model_for, forget, isotonic, measure_draft, measure_target
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline


@pytest.mark.parametrize("raw, fit", [
    ([1, 2, 3], [1, 2, 3]),
    ([1, 3, 2, 4], [1, 2.5, 2.5, 4]),
    ([5, 1], [3, 3]),
    ([2, 2, 1, 1], [1.5, 1.5, 1.5, 1.5]),
    ([1.0], [1.0]),
])
def test_isotonic_table(raw, fit):
    assert isotonic(raw) == pytest.approx(fit)


def test_cost_model_interpolates_and_extrapolates():
    cm = CostModel((1.0, 1.5, 2.0, 3.0))
    assert cm.target(1) == 1.0 and cm.target(4) == 3.0
    assert cm.target(2.5) == pytest.approx(1.75)
    assert cm.target(6) == pytest.approx(3.0 + 2 * (2.0 / 3))  # linear beyond the measured range
    assert cm.relative() == [1.0, 1.5, 2.0, 3.0]
    cm2 = CostModel((0.01, 0.012), draft_round_seconds=0.001, draft_step_seconds=0.002)
    assert cm2.round_seconds(1.0, True) == pytest.approx(0.012 + 0.001 + 0.002)
    assert cm2.round_seconds(0.0, False) == pytest.approx(0.01)
    assert cm2.draft_cost_ratio == pytest.approx(0.2)


@pytest.mark.parametrize("bad", [(), (0.0, 1.0), (-1.0,)])
def test_cost_model_rejects_bad_timings(bad):
    with pytest.raises(ValueError, match="target timing"):
        CostModel(bad)


def test_cost_model_rejects_fractional_forward_below_one():
    with pytest.raises(ValueError, match="at least 1 position"):
        CostModel((1.0, 2.0)).target(0.5)


def test_measure_target_through_runtime_contract_leaves_runtime_usable():
    model = tiny_llama(seed=3)
    rt = TorchRuntime(model)
    cm = measure_target(rt, max_positions=6, context=16, repeats=2)
    assert cm.max_positions == 6 and len(cm.raw_target_seconds) == 6
    assert all(t > 0 for t in cm.target_seconds)
    assert list(cm.target_seconds) == sorted(cm.target_seconds)  # monotone fit
    assert cm.context == 16 and cm.runtime == "torch"
    # the runtime decodes correctly afterwards (the synthetic cache was replaced by prefill)
    dec = SpeculativeDecoder(rt, NgramProposer(NgramProposer.Config()))
    prompt = [1, 2, 3, 1, 2, 3, 1]
    assert dec.generate(prompt, max_new_tokens=12).token_ids == plain_greedy(model, prompt, 12)


def test_measure_target_bad_arguments_are_named():
    rt = TorchRuntime(tiny_llama(seed=3, max_pos=64))
    with pytest.raises(ValueError, match="exceeds the runtime's 64"):
        measure_target(rt, max_positions=32, context=40)
    with pytest.raises(ValueError, match="must be >= 1"):
        measure_target(rt, max_positions=0)


def test_cost_model_is_cached_per_runtime_and_remeasured_when_too_short():
    rt = TorchRuntime(tiny_llama(seed=3))
    a = cost_model_for(rt, max_positions=4, context=8, repeats=1)
    b = cost_model_for(rt, max_positions=3, context=8, repeats=1)
    assert a is b  # cached: a longer curve serves a shorter request
    c = cost_model_for(rt, max_positions=6, context=8, repeats=1)
    assert c is not a and c.max_positions == 6
    forget(rt)
    assert cost_model_for(rt, max_positions=2, context=8, repeats=1) is not c


def test_draft_cost_separates_model_drafter_from_model_free():
    pipe = LogitsPipeline(SamplingConfig())
    target = TorchRuntime(tiny_llama(seed=3))
    ngram_fixed, ngram_step = measure_draft(NgramProposer(NgramProposer.Config()), pipe, 32, context=32)
    draft = DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4, layers=4)))
    dm_fixed, dm_step = measure_draft(draft, pipe, 32, context=32, k=6)
    assert ngram_fixed >= 0 and ngram_step >= 0
    assert dm_step > ngram_step  # every extra drafted token is a draft-model forward
    cm = cost_model_for(target, draft, pipe, max_positions=3, context=8, repeats=1)
    assert cm.draft_step_seconds > 0 and cm.draft_cost_ratio > 0
    with pytest.raises(ValueError, match="k must be >= 2"):
        measure_draft(draft, pipe, 32, k=1)


def test_unsmoothed_keeps_cheaper_wider_forwards():
    cm = CostModel((1.0, 1.6, 1.6, 2.0), raw_target_seconds=(1.0, 1.5, 1.7, 1.6))
    assert cm.unsmoothed().target_seconds == (1.0, 1.5, 1.7, 1.6)
    assert CostModel((1.0, 2.0)).unsmoothed().target_seconds == (1.0, 2.0)  # no minima kept: as is


def test_online_cost_learns_per_width_and_interpolates_unseen_widths():
    from spec_plugins.costmodel import OnlineCost

    oc = OnlineCost(CostModel((1.0, 2.0, 3.0, 4.0, 5.0)), prior_weight=1.0, decay=1.0)
    assert [oc.target(n) for n in (1, 2, 3, 4, 5)] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])  # the curve
    for _ in range(50):
        oc.observe(4, 2.0)  # width 4 costs half what the curve says
    assert oc.target(4) == pytest.approx(2.0, rel=0.03)
    assert oc.ratio(5) == pytest.approx(0.5)  # seen on one side only: that side's observed mean
    for _ in range(50):
        oc.observe(1, 1.0)  # width 1 as the curve says
    assert oc.ratio(2) == pytest.approx(1.0 - 0.5 / 3)  # between widths 1 (ratio 1) and 4 (0.5): interpolated
    assert oc.target(3.5) == pytest.approx(0.5 * (oc.target(3) + oc.target(4)))
    before = oc.ratio(1)
    oc.observe(9, 1.0)  # beyond the curve, and
    oc.observe(1, 0.0)  # a clock glitch: ignored
    assert oc.ratio(1) == before
    with pytest.raises(ValueError, match="prior_weight"):
        OnlineCost(CostModel((1.0,)), prior_weight=0.0)


def test_auto_shortens_drafts_when_the_loop_measures_expensive_forwards():
    """A flat load-time curve says drafting is free; the forwards the loop times say each extra
    position costs 0.9x a single one. Online, auto must come down to short drafts; offline it
    keeps drafting the maximum. (Rounds where the proposer finds nothing time width 1.)"""
    import random

    from spec_plugins.adaptive import AutoDraftLength
    from spec_plugins.stats import DecodeStats

    flat = CostModel(tuple([0.010] * 9))

    def run(online: bool) -> list[int]:
        pol, stats, rng, ks = AutoDraftLength(flat, max_k=8, online=online), DecodeStats(), random.Random(0), []
        for i in range(120):
            k = pol(stats)
            ks.append(k)
            d = k if i % 3 else 0  # every third round the proposer finds nothing: a 1-position forward
            acc = 0
            while acc < d and rng.random() < 0.6:
                acc += 1
            stats.observe_round([1] * d, acc, acc + 1)
            t = 0.010 * (1 + 0.9 * d)
            stats.target_forwards += 1
            stats.verify_positions += 1 + d
            stats.time_target_forward += t
            stats.time_total += t
        return ks

    assert min(run(False)[-40:]) >= 7
    late = run(True)[-60:]
    assert max(late) <= 1, late
