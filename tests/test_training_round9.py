"""Round 9 of the training pipeline's edges: held-out features of the training split are refused
(token shards say their split); paths are recorded absolute and a resume compares the target as a
model; `--init` refuses a head of another kind and sizes it would override; `--samples` with greedy
temperatures only is refused; a block deeper than the window is refused and a depth never scored
reports None."""

from __future__ import annotations

import json
import os
import re

import pytest
from test_training_hardening import LAYERS, cli, examples, feature_dir, save_model

from conftest import tiny_llama
from spec_plugins.training.features import FeatureStore, check_heldout, extract, resume_state
from spec_plugins.training.tokens import write_token_shards
from spec_plugins.training.trainer import TrainConfig

HEAD = ["--draft-vocab", "24", "--window", "16", "--max-steps", "1", "--no-progress"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A model directory ``a``, its features, an EAGLE head (draft vocabulary 24) and Medusa heads."""
    from transformers import AutoModelForCausalLM

    from spec_plugins.training.eagle_train import train_eagle
    from spec_plugins.training.medusa_train import train_medusa

    r = tmp_path_factory.mktemp("r9")
    d = save_model(r / "a", seed=4)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    store = FeatureStore(feature_dir(model, r / "feat", d))
    cfg = TrainConfig(max_steps=1, batch_size=2, window=16, unroll=1)
    train_eagle(store, model, cfg, r / "eagle", True, vocab_size=24, progress=False)
    train_medusa(store, model, cfg, r / "medusa", 2, 24, progress=False)
    return r


def tokens(directory, target, **meta):
    write_token_shards(examples(), directory, {"target": target, **meta}, 32, 10**6, 128)
    return directory


def from_tokens(tok, target, out, *extra):
    return cli("train", "features", "--source", "tokens", "--tokens", tok, "--target", target, "--out", out,
               "--layers", "1,2", "--shard-tokens", "256", "--no-progress", *extra)


# ---- 1. held-out features of the training split ------------------------------------------------
def test_features_from_token_shards_record_the_shards_split_and_held_out_ones_of_train_are_refused(root, tmp_path):
    d = str(root / "a")
    for split in ("train", "heldout"):
        assert from_tokens(tokens(tmp_path / f"t-{split}", d, split=split), d, tmp_path / f"f-{split}").exit_code == 0
        assert FeatureStore(tmp_path / f"f-{split}").meta["split"] == split
    res = cli("train", "eagle", "--features", root / "feat", "--heldout", tmp_path / "f-train", "--out",
              tmp_path / "h", *HEAD)
    assert res.exit_code == 2 and "made from token shards of the training split" in res.output, res.output
    assert not (tmp_path / "h").exists()
    res = cli("train", "eagle", "--features", root / "feat", "--heldout", tmp_path / "f-heldout", "--out",
              tmp_path / "ok", *HEAD)
    assert res.exit_code == 0, res.output


def test_held_out_features_of_the_sharegpt_training_split_are_refused(tmp_path):
    model = tiny_llama(seed=0, sharpness=8.0)
    for name, split in (("train", "train"), ("held", "train"), ("good", "heldout")):
        extract(model, examples(), tmp_path / name, {"target": "tiny", "layers": list(LAYERS), "split": split},
                LAYERS, 10_000, shard_tokens=128, progress=False)
    with pytest.raises(ValueError, match="made from the training split.*--split heldout"):
        check_heldout(FeatureStore(tmp_path / "train"), FeatureStore(tmp_path / "held"))
    check_heldout(FeatureStore(tmp_path / "train"), FeatureStore(tmp_path / "good"))


# ---- 2. paths recorded absolute; the target compared as a model ----------------------------------
def test_features_made_with_relative_paths_train_from_another_working_directory(root, tmp_path, monkeypatch):
    tokens(tmp_path / "tok", str(root / "a"))
    monkeypatch.chdir(root)
    assert from_tokens(os.path.relpath(tmp_path / "tok"), "a", tmp_path / "f").exit_code == 0
    meta = FeatureStore(tmp_path / "f").meta
    assert meta["target"] == str((root / "a").resolve()) and meta["tokens"] == str((tmp_path / "tok").resolve())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    res = cli("train", "eagle", "--features", tmp_path / "f", "--out", tmp_path / "h", *HEAD)
    assert res.exit_code == 0, res.output


def test_a_features_resume_may_name_the_tokens_and_the_target_another_way(root, tmp_path, monkeypatch):
    tokens(tmp_path / "tok", str(root / "a"))
    monkeypatch.chdir(tmp_path)
    assert from_tokens("tok", str(root / "a"), tmp_path / "f", "--max-tokens", "100").exit_code == 0
    first = FeatureStore(tmp_path / "f").tokens
    res = from_tokens(tmp_path / "tok", os.path.relpath(root / "a"), tmp_path / "f", "--max-tokens", "10000")
    assert res.exit_code == 0, res.output
    assert FeatureStore(tmp_path / "f").tokens > first


def test_a_resume_of_features_that_recorded_a_relative_target_accepts_the_same_model(root, tmp_path, monkeypatch):
    """Features written before paths were recorded absolute: the resume compares the model."""
    monkeypatch.chdir(root)
    meta = {"target": "a", "layers": list(LAYERS)}
    extract(tiny_llama(seed=0, sharpness=8.0), examples(), tmp_path / "f", meta, LAYERS, 100, progress=False)
    assert resume_state(tmp_path / "f", {**meta, "target": str(root / "a")}) is not None
    with pytest.raises(ValueError, match="other settings"):
        resume_state(tmp_path / "f", {**meta, "target": "tiny"})


# ---- 3. options that would do nothing --------------------------------------------------------------
@pytest.mark.parametrize("flag,value,named", [("--draft-vocab", "16", "draft_vocab_size 24"),
                                              ("--intermediate", "8", "intermediate_size 64")])
def test_an_init_head_refuses_a_size_it_would_override(flag, value, named, root, tmp_path):
    base = ["train", "parallel", "--features", root / "feat", "--init", root / "eagle", "--window", "16",
            "--max-steps", "1", "--no-progress"]
    res = cli(*base, "--out", tmp_path / "bad", flag, value)
    assert res.exit_code == 2 and f"{flag} {value}" in res.output and named in res.output, res.output
    assert not (tmp_path / "bad").exists()
    assert cli(*base, "--out", tmp_path / "same", "--draft-vocab", "24", "--intermediate", "64").exit_code == 0
    assert cli(*base, "--out", tmp_path / "left").exit_code == 0
    assert json.loads((tmp_path / "left" / "config.json").read_text())["draft_vocab_size"] == 24


def test_samples_with_greedy_temperatures_only_are_refused_naming_both(tmp_path):
    from spec_plugins.training.self_distill import Variant, variants

    with pytest.raises(ValueError, match="--samples 5.*--temperatures 0"):
        variants([0.0], 5)
    assert variants([0.0, 0.5], 2) == [Variant(0.0), Variant(0.5, 0), Variant(0.5, 1)]
    res = cli("train", "self-distill", "--out", tmp_path / "s", "--temperatures", "0", "--samples", "5",
              "--backend", "nope")
    assert res.exit_code == 2 and "--samples 5" in res.output and "--temperatures 0" in res.output, res.output
    assert not (tmp_path / "s").exists()


# ---- 4. block depths past the window -------------------------------------------------------------
def test_a_block_deeper_than_the_window_is_refused(root, tmp_path):
    base = ["train", "parallel", "--features", root / "feat", "--window", "8", "--draft-vocab", "24",
            "--max-steps", "1", "--no-progress"]
    res = cli(*base, "--out", tmp_path / "deep", "--block-size", "9")
    assert res.exit_code == 2 and "--block-size 9" in res.output and "at most 8" in res.output, res.output
    assert not (tmp_path / "deep").exists()
    assert cli(*base, "--out", tmp_path / "fits", "--block-size", "8").exit_code == 0


def test_a_held_out_depth_no_position_scores_reports_none(tmp_path):
    """Held-out conversations of 7 tokens (answer from token 3): query j is scored where x_{j+2}
    is an answer token, so depth d is scored from anchor a only if a and a + d both are."""
    from spec_plugins.training.eagle_train import train_eagle

    model = tiny_llama(seed=0, sharpness=8.0)
    store = FeatureStore(feature_dir(model, tmp_path / "train", "tiny"))
    short = [([(s + 3 * i) % 32 for i in range(7)], [i >= 3 for i in range(7)]) for s in range(6)]
    extract(model, short, tmp_path / "held", {"target": "tiny", "layers": list(LAYERS)}, LAYERS, 10_000,
            progress=False)
    rep = train_eagle(store, model, TrainConfig(max_steps=1, batch_size=2, window=16), tmp_path / "p", True,
                      vocab_size=24, heldout=FeatureStore(tmp_path / "held"), progress=False, block_size=8, anchors=4)
    mark = short[0][1]
    ok = [mark[j + 2] for j in range(7 - 2)]  # one window of 5 queries
    seen = [any(ok[a] and a + d < len(ok) and ok[a + d] for a in range(len(ok))) for d in range(8)]
    top1 = rep["heldout"]["top1_by_step"]
    assert len(top1) == 8 and [t is not None for t in top1] == seen and seen[:4] == [True] * 4 and not any(seen[4:])


# ---- 5. --init with a head of another kind --------------------------------------------------------
@pytest.mark.parametrize("fused", ["--fused", "--no-fused"])
def test_an_init_head_of_another_kind_is_refused_by_kind(fused, root, tmp_path):
    res = cli("train", "parallel", "--features", root / "feat", "--init", root / "medusa", fused, "--out",
              tmp_path / "p", *HEAD)
    assert res.exit_code == 2 and re.search(r"holds a medusa head; --init starts from an eagle or parallel head",
                                            res.output), res.output
    assert not (tmp_path / "p").exists()
