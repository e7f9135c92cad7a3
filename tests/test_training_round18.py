"""Round 18 of the training pipeline: a failed step of the run scripts stops them; features record
their target's weights (a model re-saved at the same path, or with only its decoder layers
fine-tuned, is refused); a truncated token shard is `error: ...` (exit 2); the data-curve table
reads each head's kind and input from its config (or, for a kept row whose run is gone, its name)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from spec_plugins.training.target_check import FINGERPRINT, model_fingerprint
from spec_plugins.training.tokens import write_token_shards
from test_training_hardening import cli, examples, save_model, tokens_dir

ROOT = Path(__file__).resolve().parents[1]

# ---- the run scripts stop at a failed step -----------------------------------------------------
STUB = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
case " $* " in *"$STUB_FAIL"*) echo "error: cannot write: No space left on device" >&2; exit 2;; esac
out=""; prev=""; for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
mkdir -p "$out"; echo '{}' > "$out/train_report.json"
"""


@pytest.mark.parametrize("script,fails,done", [
    ("train_heads.sh", "features --responses self", "S/DONE"),  # the self-distilled features
    ("train_heads.sh", "--max-tokens 1500000", "F/DONE-1.5M"),  # the extraction extended to 1.5M tokens
    ("parallel_runs.sh", "--max-tokens 2000000", "F/DONE-2M"),  # the extraction extended to 2M tokens
])
def test_a_failed_feature_extraction_stops_the_run_script(script, fails, done, tmp_path):
    """`cmd && touch DONE` under `set -e` went on after a failed cmd: training on old features, exit 0."""
    stub = tmp_path / "bin" / "spec-plugins"
    stub.parent.mkdir()
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "STUB_LOG": str(log), "STUB_FAIL": fails,
           "FEATURES": "F", "HELDOUT": "H", "RUNS": "R", "SELF_FEATURES": "S", "SELF_TOKENS_DIR": "T"}
    res = subprocess.run(["bash", str(ROOT / "scripts" / script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    calls = log.read_text().splitlines()
    assert res.returncode == 2, res.stdout + res.stderr
    assert fails in f" {calls[-1]} ", calls[-3:]  # the failed extraction was the last step run
    assert not (tmp_path / done).exists()


# ---- features are tied to their target's weights ------------------------------------------------
@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """A model directory, features of it from two sets of token shards (training and held-out
    conversations), then the model re-saved at the same path with other weights of the same shapes."""
    root = tmp_path_factory.mktemp("swap")
    target = save_model(root / "m", seed=0, layers=2)
    tokens_dir(root / "t", target)
    write_token_shards(examples(seed=1), root / "t-held", {"target": target}, 32, 10**6, 128)
    for name, tokens in (("f", "t"), ("f-held", "t-held")):
        assert extract_features(root / tokens, target, root / name).exit_code == 0
    fresh = tmp_path_factory.mktemp("other")
    save_model(fresh, seed=1, layers=2)
    shutil.copy(fresh / "model.safetensors", root / "m" / "model.safetensors")
    return root, target


def extract_features(tokens, target, out, max_tokens=400):
    return cli("train", "features", "--source", "tokens", "--tokens", tokens, "--target", target, "--out", out,
               "--layers", "1", "--shard-tokens", "256", "--max-tokens", max_tokens, "--threads", "1", "--no-progress")


def train_eagle(features, out, *extra):
    return cli("train", "eagle", "--features", features, "--out", out, "--draft-vocab", "24", "--window", "16",
               "--max-steps", "2", "--batch-size", "2", "--threads", "1", "--no-progress", *extra)


def test_features_of_a_model_resaved_with_other_weights_are_refused(extracted, tmp_path):
    root, target = extracted
    res = train_eagle(root / "f", tmp_path / "h")
    assert res.exit_code == 2 and f"features {root / 'f'} were extracted from other weights" in res.output, res.output
    assert "target (fingerprint)" in res.output and not (tmp_path / "h").exists()
    res = extract_features(root / "t", target, root / "f", max_tokens=800)
    assert res.exit_code == 2 and "target (fingerprint)" in res.output, res.output  # nor extended with them
    assert json.loads((root / "f" / "progress.json").read_text())["tokens"] <= 400


def test_held_out_features_of_the_earlier_weights_are_refused(extracted, tmp_path):
    root, target = extracted
    fresh = tmp_path / "f"  # training features of the weights there now; held-out ones of the earlier
    res = extract_features(root / "t", target, fresh)
    assert res.exit_code == 0, res.output
    res = train_eagle(fresh, tmp_path / "h", "--heldout", root / "f-held")
    assert res.exit_code == 2 and f"features {root / 'f-held'} were extracted from other" in res.output, res.output


def test_features_of_a_model_with_only_its_decoder_layers_fine_tuned_are_refused(tmp_path):
    """A merged LoRA leaves embeddings and LM head as they were: a hash of those alone let it train."""
    from safetensors.torch import load_file, save_file

    from spec_plugins.backends.torch_runtime import load_hf

    target = save_model(tmp_path / "m", seed=0, layers=2)
    tokens_dir(tmp_path / "t", target)
    assert extract_features(tmp_path / "t", target, tmp_path / "f").exit_code == 0
    recorded = json.loads((tmp_path / "f" / "progress.json").read_text())["meta"][FINGERPRINT]
    assert model_fingerprint(load_hf(target, "float32", "cpu")[0]) == recorded  # the same weights loaded again
    path = tmp_path / "m" / "model.safetensors"
    weights = load_file(path)
    layers = [k for k in weights if ".layers." in k and "norm" not in k]
    assert layers and all(k.endswith("weight") for k in layers)
    generator = torch.Generator().manual_seed(1)
    for k in layers:
        weights[k] = weights[k] + 0.02 * torch.randn(weights[k].shape, generator=generator)
    save_file(weights, path, metadata={"format": "pt"})
    res = train_eagle(tmp_path / "f", tmp_path / "h")
    assert res.exit_code == 2 and f"features {tmp_path / 'f'} were extracted from other weights" in res.output
    assert not (tmp_path / "h").exists()


def test_features_without_a_recorded_fingerprint_still_train(extracted, tmp_path):
    root, _ = extracted
    old = tmp_path / "old"
    shutil.copytree(root / "f", old)
    state = json.loads((old / "progress.json").read_text())
    del state["meta"]["target (fingerprint)"]  # written before the fingerprint was recorded
    (old / "progress.json").write_text(json.dumps(state))
    res = train_eagle(old, tmp_path / "h")
    assert res.exit_code == 0 and (tmp_path / "h" / "head.safetensors").is_file(), res.output


# ---- a truncated token shard ----------------------------------------------------------------------
def test_a_truncated_token_shard_is_an_error_naming_it(tmp_path):
    target = save_model(tmp_path / "m", layers=2)
    tokens_dir(tmp_path / "t", target)
    shard = sorted((tmp_path / "t").glob("shard-*.npz"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # an interrupted copy
    res = cli("train", "features", "--source", "tokens", "--tokens", tmp_path / "t", "--target", target, "--out",
              tmp_path / "f", "--layers", "1", "--no-progress")
    assert res.exit_code == 2, res.output
    assert f"token shard {shard} cannot be read" in res.output and "write the token shards again" in res.output


def load_curve():
    spec = importlib.util.spec_from_file_location("data_curve", ROOT / "scripts" / "data_curve.py")
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    return curve


def test_the_data_curve_table_reads_kind_and_input_from_the_head_config(tmp_path):
    curve = load_curve()
    heads = {"par-blocks": {"kind": "parallel", "feature_layers": [1, 2]},
             "eagle-plain": {"kind": "eagle", "feature_layers": []},  # not fused, though its name does not say
             "med": {"kind": "medusa"}}
    rows = {}
    for name, cfg in heads.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        rows[name] = {**curve.head_facts(tmp_path / name), "train_tokens": 100, "steps": 2, "train_seconds": 60,
                      "train": {"loss": "soft", "unroll": 3, "batch_size": 1, "epochs": 1}, "features": "fixed",
                      "heldout": None, "machine": "m", "accepted_tree": 1.0, "accepted_chain": 1.0}
    doc = tmp_path / "bench.md"
    curve.write_markdown(rows, Namespace(new_tokens=8), doc)
    text = doc.read_text()
    assert "| par-blocks | soft / fused, parallel block / – |" in text
    assert "| eagle-plain | soft / last hidden / 3 |" in text and "| med | soft / medusa heads / – |" in text
    with pytest.raises(SystemExit, match="no head config"):
        curve.head_facts(tmp_path / "missing")


def test_a_kept_row_without_its_run_takes_kind_and_input_from_its_name(tmp_path, capsys):
    """`--merge` of rows written before they recorded `fused`, their runs gone: it aborted the merge."""
    curve = load_curve()
    row = {"kind": "eagle", "train_tokens": 1}
    assert curve.kept_row("abl-no-fused", row, tmp_path / "gone") == {**row, "kind": "eagle", "fused": False}
    assert curve.kept_row("medusa-x", {}, tmp_path / "gone") == {"kind": "medusa", "fused": False}
    assert "warning: abl-no-fused: its row in --out records no head kind or input" in capsys.readouterr().out
    (tmp_path / "plain").mkdir()  # where the run is there, its config says (not its name)
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"kind": "parallel", "feature_layers": [1, 2]}))
    assert curve.kept_row("plain", row, tmp_path / "plain")["kind"] == "parallel"
    assert curve.kept_row("x", {"kind": "eagle", "fused": True}, tmp_path / "gone")["fused"] is True


def test_the_shipped_drafters_rows_record_kind_and_input_as_their_table_shows(tmp_path):
    curve = load_curve()
    rows = json.loads((ROOT / "docs" / "reports" / "drafters.json").read_text())
    assert all("kind" in r and "fused" in r for r in rows.values())
    doc = tmp_path / "bench.md"
    shipped = (ROOT / "docs" / "benchmarks.md").read_text()
    doc.write_text(shipped)
    curve.write_markdown(rows, Namespace(new_tokens=64), doc)
    assert doc.read_text() == shipped
