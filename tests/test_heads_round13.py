"""Saved heads edited by hand are refused when they load, naming the directory and what is wrong:
a Medusa calibration of another JSON shape (it crashed later in the proposer without naming the
head), token ids stored as floats or repeated, weights stored as integers (all cast silently)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from helpers import save_random_heads
from safetensors.torch import load_file, save_file

from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.proposers.eagle import EagleProposer
from spec_plugins.proposers.medusa import MedusaProposer
from spec_plugins.proposers.parallel import ParallelProposer

PROPOSERS = {"eagle": EagleProposer, "medusa": MedusaProposer, "parallel": ParallelProposer}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    return save_random_heads(tiny_llama(seed=3), tmp_path_factory.mktemp("heads"))


def load(kind: str, directory: Path):
    cls = PROPOSERS[kind]
    return cls(cls.Config(heads=str(directory), tree_nodes=6, top_k=2), target=TorchRuntime(tiny_llama(seed=3)))


def copy(saved: dict[str, Path], kind: str, to: Path) -> Path:
    shutil.copytree(saved[kind], to)
    return to


@pytest.mark.parametrize("value", [[0.5, 0.2], {"head0": 0.5}, "0.5", {"head0": [0.5, None]},
                                   {"head0": [0.5, True]}, {"head1": [1.5]}, {"head0": "0.5"}])
def test_medusa_calibration_of_another_shape_refused_at_load(saved, tmp_path, value):
    """The proposer reads ``holdout_topk_accuracy["head{d}"]`` as head d's rank accuracies."""
    bad = copy(saved, "medusa", tmp_path / "medusa")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "holdout_topk_accuracy": value}))
    with pytest.raises(ValueError) as err:
        load("medusa", bad)
    msg = str(err.value)
    assert str(bad) in msg and "holdout_topk_accuracy" in msg, msg


def test_medusa_calibration_kept_as_measured(saved, tmp_path):
    good = copy(saved, "medusa", tmp_path / "medusa")
    cfg = json.loads((good / "config.json").read_text())
    calib = {"head0": [0.6, 0.3], "head1": [1, 0.0], "head2": []}
    (good / "config.json").write_text(json.dumps({**cfg, "holdout_topk_accuracy": calib}))
    assert load("medusa", good).heads.calibration == calib


def edit_tensors(directory: Path, edit) -> None:
    state = load_file(str(directory / "head.safetensors"))
    edit(state)
    save_file(state, str(directory / "head.safetensors"))


def float_ids(s):
    s["vocab_ids"] = s["vocab_ids"].float() - 0.3  # a cast truncates each id to the one below


def repeated_ids(s):
    s["vocab_ids"] = torch.full_like(s["vocab_ids"], 5)


def int8_weights(s):
    s.update({k: (v * 10).to(torch.int8) for k, v in s.items() if v.is_floating_point()})


@pytest.mark.parametrize("kind", sorted(PROPOSERS))
@pytest.mark.parametrize("edit,problem", [(float_ids, "integers"), (repeated_ids, "repeats"), (int8_weights, "int8")])
def test_head_tensors_of_the_wrong_dtype_refused_naming_directory_and_tensor(saved, tmp_path, kind, edit, problem):
    bad = copy(saved, kind, tmp_path / kind)
    edit_tensors(bad, edit)
    with pytest.raises(ValueError) as err:
        load(kind, bad)
    msg = str(err.value)
    name = "'vocab_ids'" if edit is not int8_weights else "tensor '"
    assert str(bad) in msg and name in msg and problem in msg, msg


@pytest.mark.parametrize("kind", sorted(PROPOSERS))
def test_head_tensors_in_other_accepted_dtypes_still_load(saved, tmp_path, kind):
    """int32 / uint16 ids and bfloat16 / float64 weights are the same head: they load, with the same draft vocabulary."""
    want = load(kind, saved[kind])
    for weights, ids in ((torch.bfloat16, torch.int32), (torch.float64, torch.uint16)):
        good = copy(saved, kind, tmp_path / f"{kind}-{weights}")
        edit_tensors(good, lambda s: s.update({k: v.to(ids) if k == "vocab_ids" else v.to(weights) for k, v in s.items()}))
        got = load(kind, good)
        module = got.heads if kind == "medusa" else got.drafter
        assert torch.equal(module.vocab_ids, (want.heads if kind == "medusa" else want.drafter).vocab_ids)
