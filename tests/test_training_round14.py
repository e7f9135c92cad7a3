"""Round 14: held-out features that are the training features' own conversations (the same
directory, the same prompts file or token shards, both of ShareGPT's held-out split) are refused;
a write that fails (a full disk) is `error: cannot write DIR` with no truncated ``.tmp`` left; a
corrupt feature shard is named; ``--seed`` is bounded before the target loads; and an extraction
that keeps nothing fails instead of writing an empty store."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_training_hardening import LAYERS, cli, examples, feature_dir, features_from_tokens, save_model, tokens_dir

from conftest import tiny_llama
from spec_plugins.training.features import FeatureStore, check_heldout, extract
from spec_plugins.training.trainer import TrainConfig

HEAD = ["--draft-vocab", "24", "--window", "16", "--batch-size", "2", "--max-steps", "2", "--no-progress",
        "--threads", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A model directory ``a``, its training features (layers 1, 2) and token shards for it."""
    from transformers import AutoModelForCausalLM

    r = tmp_path_factory.mktemp("r14")
    d = save_model(r / "a", seed=4)
    feature_dir(AutoModelForCausalLM.from_pretrained(d).eval(), r / "feat", d)
    tokens_dir(r / "tok", d)
    return r


def _features(directory: Path, target: str = "tiny", **meta) -> FeatureStore:
    extract(tiny_llama(seed=0, sharpness=8.0), examples(n=4), directory, {"target": target, "layers": list(LAYERS),
            **meta}, LAYERS, 10_000, progress=False)
    return FeatureStore(directory)


# ---- 1. held-out features holding the training conversations -------------------------------------
def test_the_training_features_given_as_their_own_held_out_set_are_refused(root, tmp_path):
    """Features of the held-out split trained on and scored on themselves: Medusa's calibration said
    ``calibration_source: heldout`` measured on training data."""
    d = str(root / "a")
    heldout = {"source": "sharegpt", "split": "heldout", "heldout_share": 0.02}
    _features(tmp_path / "fh", d, **heldout)
    res = cli("train", "medusa", "--features", tmp_path / "fh", "--heldout", tmp_path / "fh", "--out", tmp_path / "m",
              "--num-heads", "2", *HEAD)
    assert res.exit_code == 2 and "the training features themselves (the same directory)" in res.output, res.output
    assert "measured on training data" in res.output and not (tmp_path / "m").exists()
    os.symlink(tmp_path / "fh", tmp_path / "link")  # another name for the same directory
    with pytest.raises(ValueError, match="the same directory"):
        check_heldout(FeatureStore(tmp_path / "fh"), FeatureStore(tmp_path / "link"))
    # another extraction of the held-out split, with the same or another share: the same conversations
    for share in (0.02, 0.01):
        other = _features(tmp_path / f"h{share}", d, **(heldout | {"heldout_share": share}))
        with pytest.raises(ValueError, match="ShareGPT's held-out split, which the training features were made"):
            check_heldout(FeatureStore(tmp_path / "fh"), other)
    check_heldout(_features(tmp_path / "train", d, **(heldout | {"split": "train"})), other)  # train vs held-out: fine


def test_held_out_features_of_the_training_prompts_file_or_token_shards_are_refused(tmp_path):
    """A user's prompts file records no split (taken as the user says), but the same file on both
    sides is the same conversations; so are the same token shards."""
    mine = {"source": "prompts", "split": None, "prompts (fingerprint)": "abc"}
    train = _features(tmp_path / "train", **mine)
    with pytest.raises(ValueError, match="the same prompts .fingerprint abc."):
        check_heldout(train, _features(tmp_path / "held", **mine))
    check_heldout(train, _features(tmp_path / "other", **(mine | {"prompts (fingerprint)": "def"})))
    tok = {"source": "tokens", "split": None, "token shards (fingerprint)": "t1"}
    with pytest.raises(ValueError, match="the same token shards .fingerprint t1."):
        check_heldout(_features(tmp_path / "tt", **tok), _features(tmp_path / "th", **tok))


# ---- 2. a full disk ----------------------------------------------------------------------------------
def _full_disk(after: int):
    """A writer that writes part of its file, then fails as a full disk does, from call ``after`` on."""
    calls = []

    def write(tmp) -> None:
        calls.append(tmp)
        if len(calls) > after:
            Path(tmp).write_bytes(b"\0" * 100)  # what a full disk leaves: a truncated file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def test_train_features_onto_a_full_disk_says_so_and_resumes(root, tmp_path, monkeypatch):
    import safetensors.torch

    import spec_plugins.training.features as features

    real, fail = safetensors.torch.save_file, _full_disk(after=1)

    def save_file(tensors, filename, metadata=None):
        fail(filename)
        real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(features, "save_file", save_file, raising=False)
    out = tmp_path / "f"
    res = features_from_tokens(root / "tok", str(root / "a"), out, "--threads", "1")
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"error: cannot write {out}: {out / 'shard-00001.safetensors'}" in res.output, res.output
    assert "No space left on device" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["progress.json", "shard-00000.safetensors"]  # no .tmp
    assert json.loads((out / "progress.json").read_text())["shards"] == ["shard-00000.safetensors"]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    monkeypatch.setattr(features, "save_file", real, raising=False)
    assert features_from_tokens(root / "tok", str(root / "a"), out, "--threads", "1").exit_code == 0  # resumes
    assert features_from_tokens(root / "tok", str(root / "a"), tmp_path / "clean", "--threads", "1").exit_code == 0
    assert FeatureStore(out).state["shards"] == FeatureStore(tmp_path / "clean").state["shards"]


def test_train_eagle_onto_a_full_disk_says_so_and_leaves_no_truncated_checkpoint(root, tmp_path, monkeypatch):
    """torch.save on a full disk raises a RuntimeError (``unexpected pos``) that names no file."""
    real, fail = torch.save, _full_disk(after=0)

    def save(obj, f, *a, **k):
        try:
            fail(f)
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 36672 vs 36560") from None
        real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "h"
    res = cli("train", "eagle", "--features", root / "feat", "--out", out, *HEAD)
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"error: cannot write {out}: {out / 'checkpoint.pt'}: RuntimeError" in res.output, res.output
    assert sorted(p.name for p in out.iterdir()) == []


# ---- 3. a corrupt feature shard -------------------------------------------------------------------
def test_a_truncated_feature_shard_is_named(root, tmp_path):
    d = tmp_path / "feat"
    shutil.copytree(root / "feat", d)
    shard = d / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # an interrupted copy
    for kind in ("eagle", "medusa"):
        res = cli("train", kind, "--features", d, "--out", tmp_path / kind, *HEAD)
        assert res.exit_code == 2, (res.output, res.exception)
        assert f"error: feature shard {shard} cannot be read (SafetensorError" in res.output, res.output
        assert "extract the features again" in res.output
    store = FeatureStore(d)
    for read in (lambda: store.load(1), lambda: store.read(1, ["offsets"])):
        with pytest.raises(ValueError, match="shard-00001.safetensors cannot be read"):
            read()
    (d / "shard-00000.safetensors").write_bytes(b"\x08")  # the header the width is read from
    with pytest.raises(ValueError, match="shard-00000.safetensors cannot be read"):
        FeatureStore(d).hidden_size


# ---- 4. --seed ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle", "medusa", "parallel"])
def test_a_seed_past_the_int64_products_is_refused_by_name_before_the_target_loads(kind, root, tmp_path, monkeypatch):
    import spec_plugins.backends.torch_runtime as rt

    monkeypatch.setattr(rt, "load_hf", lambda *a, **k: pytest.fail("the target loaded"))
    for seed in ("10000000000000000", str(2**32), "-3"):
        res = cli("train", kind, "--features", root / "feat", "--out", tmp_path / "h", "--seed", seed, *HEAD)
        assert res.exit_code == 2 and "--seed" in res.output, (seed, res.output, res.exception)
    assert not (tmp_path / "h").exists()
    with pytest.raises(ValueError, match="seed must be in 0..4294967295, got -1"):
        TrainConfig(seed=-1)


def test_the_largest_seed_trains(root, tmp_path):
    """EAGLE's per-step seed is the largest product of the seed (seed * 7919 + step)."""
    res = cli("train", "eagle", "--features", root / "feat", "--out", tmp_path / "h", "--seed", str(2**32 - 1), *HEAD)
    assert res.exit_code == 0, (res.output, res.exception)


# ---- 5. an extraction that keeps nothing ------------------------------------------------------------
def test_train_features_that_keeps_nothing_fails_and_writes_nothing(root, tmp_path):
    out = tmp_path / "new" / "f"
    res = features_from_tokens(root / "tok", str(root / "a"), out, "--max-tokens", "1", "--threads", "1")
    assert res.exit_code == 2 and "error: no conversation to write: none holding an answer" in res.output, (res.output, res.exception)
    assert "within the budget of 1 tokens" in res.output and not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(ValueError, match="no conversation to write"):  # one row without an answer
        extract(tiny_llama(), [([1, 2, 3], [False] * 3)], tmp_path / "kept", {"target": "t"}, (1,), 10_000,
                progress=False)
    assert list((tmp_path / "kept").iterdir()) == []  # the directory it was given stays, empty


@pytest.mark.parametrize("exc, says", [
    (IsADirectoryError(21, "Is a directory", "prompts-dir"), "error: [Errno 21] Is a directory: 'prompts-dir'"),
    (PermissionError(13, "Permission denied", "tokens"), "error: [Errno 13] Permission denied: 'tokens'"),
])
def test_an_input_that_cannot_be_read_is_not_called_a_failed_write(exc, says, capsys):
    """Only a failed write (``files.WriteError``) is reported as "cannot write --out"."""
    import typer

    from spec_plugins.files import WriteError
    from spec_plugins.training.cli import _fail

    with pytest.raises(typer.Exit):
        _fail(exc, Path("out"))
    assert says in capsys.readouterr().err
    with pytest.raises(typer.Exit):
        _fail(WriteError("out/checkpoint.pt: OSError: No space left on device"), Path("out"))
    assert "error: cannot write out: out/checkpoint.pt" in capsys.readouterr().err
