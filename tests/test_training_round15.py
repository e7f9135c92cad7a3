"""Round 15 of the training pipeline's edges: ``--init`` from a head trained for another target
of the same shapes is refused as loading it to draft refuses it (its recorded target
fingerprint), before anything is written; the head's own target, and a head that records no
fingerprint (as loading accepts), still start training."""

from __future__ import annotations

import json
import re

import pytest
from test_training_hardening import cli, feature_dir, save_model

from spec_plugins.heads.common import FINGERPRINT
from spec_plugins.heads.eagle import EagleDrafter
from spec_plugins.heads.parallel import ParallelDrafter
from spec_plugins.training.features import FeatureStore
from spec_plugins.training.trainer import TrainConfig

CFG = TrainConfig(epochs=1, max_steps=1, batch_size=2, window=16, unroll=1)
PAR = ["--window", "16", "--batch-size", "2", "--max-steps", "1", "--block-size", "3", "--no-progress",
       "--threads", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Model directories ``a`` and ``b`` (equal shapes, other seeds), features of each, and an
    EAGLE head trained on ``a``."""
    from transformers import AutoModelForCausalLM

    from spec_plugins.training.eagle_train import train_eagle

    r = tmp_path_factory.mktemp("r15")
    models = {}
    for name, seed in (("a", 4), ("b", 5)):
        d = save_model(r / name, seed=seed)
        models[name] = AutoModelForCausalLM.from_pretrained(d).eval()
        feature_dir(models[name], r / f"feat-{name}", d)
    train_eagle(FeatureStore(r / "feat-a"), models["a"], CFG, r / "head-a", True, vocab_size=24, progress=False)
    return r, models


def test_init_from_a_head_of_another_target_is_refused_naming_it(root, tmp_path):
    """Loading head-a to draft for b refuses it; training on b from it did not: it kept a's draft
    vocabulary and saved the result as trained for b."""
    from spec_plugins.training.eagle_train import train_eagle

    r, models = root
    trained_for = re.escape(f"it was trained for target {str(r / 'a')!r}")
    with pytest.raises(ValueError, match=trained_for):
        EagleDrafter.from_pretrained(str(r / "head-a"), models["b"])  # what the runtime says
    with pytest.raises(ValueError, match=re.escape(f"{r / 'head-a'} cannot start training on this target: ")
                       + trained_for + re.escape(f", not for target {str(r / 'b')!r}")):
        train_eagle(FeatureStore(r / "feat-b"), models["b"], CFG, tmp_path / "direct", True, progress=False,
                    block_size=3, init=r / "head-a")
    assert not (tmp_path / "direct").exists()
    res = cli("train", "parallel", "--features", r / "feat-b", "--init", r / "head-a", "--out", tmp_path / "cli", *PAR)
    assert res.exit_code == 2 and "error:" in res.output and "trained for target" in res.output, res.output
    assert str(r / "a") in res.output and not (tmp_path / "cli").exists()


def test_init_from_a_head_of_the_same_target_or_without_a_fingerprint_trains(root, tmp_path):
    """The head's own target trains from it; a head saved before heads recorded a fingerprint is
    checked on shapes only, at load time and here alike."""
    import shutil

    r, models = root
    res = cli("train", "parallel", "--features", r / "feat-a", "--init", r / "head-a", "--out", tmp_path / "same", *PAR)
    assert res.exit_code == 0, res.output
    assert ParallelDrafter.from_pretrained(str(tmp_path / "same"), models["a"]).config.draft_vocab_size == 24
    old = tmp_path / "old"
    shutil.copytree(r / "head-a", old)
    cfg = json.loads((old / "config.json").read_text())
    del cfg[FINGERPRINT]
    (old / "config.json").write_text(json.dumps(cfg))
    EagleDrafter.from_pretrained(str(old), models["b"])  # loading accepts it on b
    res = cli("train", "parallel", "--features", r / "feat-b", "--init", old, "--out", tmp_path / "b", *PAR)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "b" / "train_report.json").read_text())["train"]["init"] == str(old)
