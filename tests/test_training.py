"""Training smoke tests on a tiny model: features are the target's own greedy output and
hidden states, losses go down, checkpoints resume to the same weights, the CLI validates."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.heads import EagleDrafter, MedusaHeads
from spec_plugins.training.cli import train_head
from spec_plugins.training.data import build_features, target_features
from spec_plugins.training.trainer import TrainConfig


def prompts(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, sharpness=8.0)


def test_features_are_greedy_output_and_true_hidden(model):
    ps = prompts(5)
    fs = build_features(model, ps, 9, eos=(), batch_size=3)
    for i, p in enumerate(ps):
        toks, hid, plen = fs.seq(i)
        assert plen == len(p)
        ref = plain_greedy(model, p, 9)
        assert toks.tolist() == p + ref[:-1]  # the last token is never fed, so it has no feature
        torch.testing.assert_close(hid.float(), target_features(model, [toks.tolist()])[0], atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_train_loss_decreases_and_resume_roundtrips(kind, model, tmp_path):
    ps = prompts()
    feats = tmp_path / "features.safetensors"
    cfg = dict(epochs=100, max_steps=24, batch_size=32 if kind == "medusa" else 4, lr=3e-3, unroll=2, save_every=5)
    kw = dict(max_new_tokens=12, features=feats, draft_vocab=24, num_heads=2, progress=False)
    full = train_head(kind, model, ps, tmp_path / "full", "tiny", train_cfg=TrainConfig(**cfg), **kw)
    assert full["finished"] and full["features_cached"] is False
    first, last = full["first_losses"], full["last_losses"]
    assert sum(last) / len(last) < 0.9 * sum(first) / len(first), (first, last)
    # interrupted after 10 steps, then resumed: same final weights as the uninterrupted run
    part = train_head(kind, model, ps, tmp_path / "resumed", "tiny", train_cfg=TrainConfig(**cfg, stop_after=10), **kw)
    assert part == {"kind": kind, "finished": False, "steps_done": 10, "steps": 24,
                    "checkpoint": str(tmp_path / "resumed" / "checkpoint.pt")}
    assert not (tmp_path / "resumed" / "head.safetensors").exists()
    done = train_head(kind, model, ps, tmp_path / "resumed", "tiny", train_cfg=TrainConfig(**cfg), **kw)
    assert done["finished"] and done["resumed_from"] == 10 and done["features_cached"] is True
    cls = MedusaHeads if kind == "medusa" else EagleDrafter
    a = cls.from_pretrained(str(tmp_path / "full"), model).state_dict()
    b = cls.from_pretrained(str(tmp_path / "resumed"), model).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-3, rtol=1e-3)
    conf = json.loads((tmp_path / "full" / "config.json").read_text())
    assert conf["kind"] == kind and conf["steps"] == 24 and conf["draft_vocab_size"] <= 24
    report = json.loads((tmp_path / "full" / "train_report.json").read_text())
    assert report["response_tokens"] > 0 and report["head_bytes"] > 0


def test_cli_rejects_unknown_head(tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    res = CliRunner().invoke(app, ["train", "hydra", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "medusa, eagle" in res.output
