"""Medusa's static tree keeps each head's holdout rank accuracies: a top_k past the measured
ranks, or a head missing from the calibration, must not throw the other measurements away."""

from __future__ import annotations

import pytest
from conftest import tiny_llama
from test_heads import medusa

from spec_plugins.heads import MedusaHeads, save_head
from spec_plugins.proposers.medusa import MedusaProposer, default_accuracy
from spec_plugins.tree import best_static_tree

# what training writes (``holdout_topk_accuracy``: 8 ranks per head), values of the shipped SmolLM2 heads
CALIB = {
    "head0": [0.1458, 0.0876, 0.0591, 0.0454, 0.0336, 0.0249, 0.0216, 0.0222],
    "head1": [0.0641, 0.0495, 0.0402, 0.0316, 0.0275, 0.0232, 0.0186, 0.0174],
    "head2": [0.0442, 0.0389, 0.0347, 0.0282, 0.0235, 0.0217, 0.0188, 0.018],
}


def trained(tmp_path, calibration):
    """Random 3-head Medusa heads saved with ``calibration`` and loaded as a trained head is."""
    model = tiny_llama()
    m = medusa(model)
    save_head(m, {**m.config.to_dict(), "holdout_topk_accuracy": calibration}, tmp_path / "medusa")
    return MedusaHeads.from_pretrained(str(tmp_path / "medusa"), model)


def same_table(got, want):
    """Row by row (``pytest.approx`` takes flat sequences)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-12)


def extended(row, top_k):
    """The reference extension: measured ranks, then the last one times the ratio of the last two,
    at most the prior's 0.35."""
    ratio = min(row[-1] / row[-2], 0.35)
    return list(row) + [row[-1] * ratio ** i for i in range(1, top_k - len(row) + 1)]


def test_top_k_past_the_measured_ranks_keeps_the_measurements(tmp_path):
    heads = trained(tmp_path, CALIB)
    cfg = MedusaProposer.Config(heads="unused", top_k=9, tree_nodes=24)
    prop = MedusaProposer(cfg, heads=heads)
    want = [extended(CALIB[f"head{d}"], 9) for d in range(3)]
    assert prop._tree == best_static_tree(want, 24, max_depth=3)
    assert prop._tree != best_static_tree(default_accuracy(3, 9), 24, max_depth=3)  # the prior's shape differs
    from spec_plugins.proposers.medusa import rank_accuracy

    got = rank_accuracy(heads.calibration, 3, 9)
    same_table(got, want)
    for row in got:  # the extension never exceeds the last measured rank
        assert row[8] <= row[7]


def test_a_head_missing_from_the_calibration_keeps_the_others(tmp_path):
    calib = {k: v for k, v in CALIB.items() if k != "head1"}
    heads = trained(tmp_path, calib)
    prop = MedusaProposer(MedusaProposer.Config(heads="unused", top_k=8, tree_nodes=24), heads=heads)
    want = [CALIB["head0"], default_accuracy(3, 8)[1], CALIB["head2"]]
    assert prop._tree == best_static_tree(want, 24, max_depth=3)
    from spec_plugins.proposers.medusa import rank_accuracy

    same_table(rank_accuracy(heads.calibration, 3, 8), want)


def test_a_single_measured_rank_decays_at_the_prior_ratio_and_bad_values_are_refused():
    from spec_plugins.proposers.medusa import rank_accuracy

    same_table(rank_accuracy({"head0": [0.5]}, 1, 3), [[0.5, 0.5 * 0.35, 0.5 * 0.35 ** 2]])
    same_table(rank_accuracy({"head0": [0.4, 0.2, 0.0]}, 1, 5), [[0.4, 0.2, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="head0 .* must be in \\[0, 1\\]"):
        rank_accuracy({"head0": [0.5, 1.5]}, 1, 3)
