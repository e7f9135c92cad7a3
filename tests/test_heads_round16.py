"""Head parity, round 16: ``check_head`` (``export check``, and the runtime's check of an export's
head graph) gave every batched row the same positions and the same mask, so a graph that reads
row 0's positions or mask for every row passed while drafting wrong on rows at other positions.
Each row now has its own position offset and its own holes in the mask."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from test_heads import eagle  # noqa: E402
from test_parallel import drafter  # noqa: E402

from spec_plugins.exporters.onnx_heads import check_head, export_head, head_inputs  # noqa: E402
from spec_plugins.heads import EagleDrafter  # noqa: E402
from spec_plugins.heads.parallel import BlockRefiner  # noqa: E402

torch.set_num_threads(1)


def row0(t: torch.Tensor, on: bool) -> torch.Tensor:
    """Row 0 of ``t`` for every row (``on``), else ``t``."""
    return t[:1].expand_as(t) if on else t


class MixingEagle(EagleDrafter):
    """An EAGLE layer that reads row 0's positions and/or mask for every row."""

    mix: tuple[bool, bool] = (True, True)

    def forward(self, features, tokens, positions, past_k, past_v, mask):
        return super().forward(features, tokens, row0(positions, self.mix[0]), past_k, past_v, row0(mask, self.mix[1]))


class MixingRefiner(BlockRefiner):
    """Block layers with context that read row 0's positions and/or mask for every row."""

    mix: tuple[bool, bool] = (True, True)

    def forward(self, x, positions=None, past_k=None, past_v=None, mask=None):
        return super().forward(x, row0(positions, self.mix[0]), past_k, past_v, row0(mask, self.mix[1]))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=32, seed=2)


def heads(model, kind: str):
    """(the head, its row-mixing class): the EAGLE layer, or a parallel drafter's block layers
    that see the context."""
    if kind == "eagle":
        return eagle(model), MixingEagle
    return drafter(model, layers=(), block_layers=2, context=True).refiner, MixingRefiner


def parity(tmp_path, module, graph_module) -> list:
    """``check_head`` of ``module`` against the graph exported from ``graph_module``."""
    entry = export_head(graph_module, tmp_path / "head.onnx", "head", "tiny", None)
    return check_head(tmp_path, entry, None, 1e-4, module=module)


@pytest.mark.parametrize("kind", ["eagle", "block"])
@pytest.mark.parametrize("mix", [(True, True), (True, False), (False, True)], ids=["both", "positions", "mask"])
def test_a_graph_that_mixes_batch_rows_fails_head_parity(tmp_path, model, kind, mix):
    module, mixing = heads(model, kind)
    bad = copy.deepcopy(module)
    bad.__class__ = mixing
    bad.mix = mix
    cases = parity(tmp_path, module, bad)
    assert any(c.ok for c in cases), cases  # one row (B=1) cannot mix
    assert not all(c.ok for c in cases), f"a graph reading row 0's {mix} for every row passed: {cases}"


@pytest.mark.parametrize("kind", ["eagle", "block"])
def test_the_right_graph_passes_on_rows_of_their_own(tmp_path, model, kind):
    module, _ = heads(model, kind)
    cases = parity(tmp_path, module, module)
    assert cases and all(c.ok for c in cases), cases
    # the inputs stay where the runtime feeds: every query sees itself (its own new slot)
    kind_name = "eagle_layer" if kind == "eagle" else "block_refiner"
    *_, positions, _, _, mask = head_inputs(kind_name, module, 3, 6, 9, seed=18)
    assert positions.unique(dim=0).shape[0] == 3 and mask.unique(dim=0).shape[0] == 3
    assert (mask[:, 0, :, 9:].diagonal(dim1=-2, dim2=-1) == 0).all()
