"""Drafter training on a tiny model: feature shards hold the target's true outputs and resume
where they stopped, heads train (losses fall) and resume to the same weights, the held-out
report is computed, self-distillation is the target's own greedy output, the CLI validates."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.heads import EagleDrafter, MedusaHeads
from spec_plugins.heads.parallel import ParallelDrafter
from spec_plugins.training.features import FeatureStore, Shard, extract, target_outputs
from spec_plugins.training.trainer import TrainConfig

LAYERS = (1, 2)


def examples(n=24, seed=0):
    """Sequences whose second half is 'the assistant's' and follows a simple rule (learnable)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(12, 30, (1,), generator=g))
        start = int(torch.randint(0, 32, (1,), generator=g))
        ids = [(start + 3 * i) % 32 for i in range(L)]
        out.append((ids, [i >= L // 2 for i in range(L)]))
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, sharpness=8.0)


@pytest.fixture(scope="module")
def features(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("feat")
    extract(model, examples(), out, {"target": "tiny", "layers": list(LAYERS)}, LAYERS, 10_000, shard_tokens=128,
            progress=False)
    return FeatureStore(out)


def test_shards_hold_the_targets_true_outputs(model, features):
    shard = Shard.concat([features.load(i) for i in range(len(features.shards))])
    assert len(features.shards) > 2 and len(shard) == 24
    for i, (ids, trained) in enumerate(examples()):
        s = shard.span(i)
        assert shard.tokens[s].tolist() == ids and shard.trained[s].tolist() == trained
        ref = target_outputs(model, torch.tensor([ids]), LAYERS)
        torch.testing.assert_close(shard.hidden[s].float(), ref["hidden"], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(shard.layers[s].float(), ref["layers"], atol=2e-2, rtol=1e-2)
        logits = model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(shard.lse[s], torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-4)
        assert shard.top1[s].tolist() == logits.argmax(-1).tolist()


def test_extraction_resumes_where_it_stopped(model, features, tmp_path):
    meta = {"target": "tiny", "layers": list(LAYERS)}
    first = extract(model, examples(), tmp_path, meta, LAYERS, 200, shard_tokens=128, progress=False)
    assert first["tokens"] == 200 and not first["exhausted"]
    done = extract(model, examples(), tmp_path, meta, LAYERS, 10_000, shard_tokens=128, progress=False)
    assert done["exhausted"] and done["conversations"] == 24
    a = Shard.concat([FeatureStore(tmp_path).load(i) for i in range(len(done["shards"]))])
    b = Shard.concat([features.load(i) for i in range(len(features.shards))])
    # the first run's budget cut one conversation at token 200; the second went on after it
    end = int(b.offsets[b.offsets > 200][0])
    keep = torch.cat([torch.arange(200), torch.arange(end, b.num_tokens)])
    assert a.tokens.tolist() == b.tokens[keep].tolist()
    torch.testing.assert_close(a.hidden, b.hidden[keep])
    with pytest.raises(ValueError, match="other settings"):
        extract(model, examples(), tmp_path, {"target": "other"}, LAYERS, 10_000, progress=False)


def test_an_interrupted_extraction_checkpoint_holds_its_time(model, tmp_path):
    """Each shard's checkpoint carries the time spent so far, so a killed run still reports it."""
    def dies_after_two_shards():
        for n, ex in enumerate(examples()):
            if n == 12:
                raise KeyboardInterrupt
            yield ex
    with pytest.raises(KeyboardInterrupt):
        extract(model, dies_after_two_shards(), tmp_path, {"target": "tiny", "layers": list(LAYERS)}, LAYERS, 10_000,
                shard_tokens=128, progress=False)
    state = json.loads((tmp_path / "progress.json").read_text())
    assert state["shards"] and state["seconds"] > 0


@pytest.mark.parametrize("kind,fused", [("eagle", True), ("eagle", False), ("parallel", True), ("medusa", False)])
def test_train_loss_falls_and_resume_roundtrips(kind, fused, model, features, tmp_path):
    from spec_plugins.training.eagle_train import train_eagle
    from spec_plugins.training.medusa_train import train_medusa

    cfg = dict(epochs=100, max_steps=60, batch_size=4, window=16, lr=1e-2, unroll=2, save_every=5)

    def train(out, **extra):
        c = TrainConfig(**cfg, **extra)
        if kind != "medusa":
            return train_eagle(features, model, c, out, fused, vocab_size=24, heldout=features, progress=False,
                               block_size=4 if kind == "parallel" else None, anchors=4)
        return train_medusa(features, model, c, out, num_heads=2, vocab_size=24, heldout=features, progress=False)

    full = train(tmp_path / "full")
    first, last = full["first_losses"], full["last_losses"]
    assert full["finished"] and sum(last) < 0.9 * sum(first), (first, last)  # soft CE: the floor is H(p)
    part = train(tmp_path / "resumed", stop_after=10)
    assert part == {"kind": kind, "finished": False, "steps_done": 10, "steps": 60,
                    "checkpoint": str(tmp_path / "resumed" / "checkpoint.pt")}
    assert not (tmp_path / "resumed" / "head.safetensors").exists()
    done = train(tmp_path / "resumed")
    assert done["finished"] and done["resumed_from"] == 10
    cls = {"medusa": MedusaHeads, "eagle": EagleDrafter, "parallel": ParallelDrafter}[kind]
    a = cls.from_pretrained(str(tmp_path / "full"), model).state_dict()
    b = cls.from_pretrained(str(tmp_path / "resumed"), model).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-3, rtol=1e-3)
    conf = json.loads((tmp_path / "full" / "config.json").read_text())
    assert conf["kind"] == kind and conf["steps"] == 60 and conf["draft_vocab_size"] == 24
    held = full["heldout"]
    if kind != "medusa":
        assert conf["feature_layers"] == (list(LAYERS) if fused else [])
        top1 = held["top1_by_step"]
        assert len(top1) == (5 if kind == "eagle" else 4) and top1[0] > 0.35, held  # learnt (random: ~1/24)
        assert 1.0 <= held["accepted_along_text"] <= 6.0
        if kind == "parallel":  # the block learns the rule too: depths 1..3 from one forward (random: ~1/24)
            assert min(top1[1:]) > 0.2, held
    else:
        assert held["top1_by_head"][0] > 0.35, held


def test_eagle_chain_estimate_counts_consecutive_right_steps():
    """accepted_along_text: a draft from i is right at depth s when step s at query i+s is."""
    from spec_plugins.training.eagle_train import chain_lengths

    right = [torch.tensor([[True, True, False, True]]), torch.tensor([[False, True, True, False]])]
    start = torch.tensor([[True, True, True, True]])
    # i=0: s0 ok, s1 at q1 ok -> 2; i=1: s0 ok, s1 at q2 ok -> 2; i=2: s0 wrong -> 0; i=3: s0 ok, q4 n/a -> 1
    assert chain_lengths(right, start) == [3, 2]


def test_self_distillation_is_the_targets_greedy_output(model):
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.training.sources import self_distilled

    dec = SpeculativeDecoder(TorchRuntime(model))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    got = list(self_distilled(dec, prompts, 6, batch=2, progress=False))
    for p, (ids, trained) in zip(prompts, got):
        assert ids == p + plain_greedy(model, p, 6) and trained == [False] * len(p) + [True] * 6


def test_cli_validates_before_loading(tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    r = CliRunner()
    res = r.invoke(app, ["train", "features", "--source", "prompts", "--responses", "fixed", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--responses self" in res.output
    res = r.invoke(app, ["train", "eagle", "--features", str(tmp_path), "--out", str(tmp_path / "h"), "--loss", "mse"])
    assert res.exit_code == 2 and "soft, top1, data" in res.output
    res = r.invoke(app, ["train", "eagle", "--features", str(tmp_path / "none"), "--out", str(tmp_path / "h")])
    assert res.exit_code == 2 and "no features" in res.output


def test_a_parallel_drafter_starts_from_a_trained_eagle_head(model, features, tmp_path):
    """``init``: the parallel drafter starts from the EAGLE head's layer and draft vocabulary (the
    block inputs fresh), a deeper one from a parallel head (the block layers fresh); a head that
    reads other feature layers is refused by name."""
    from spec_plugins.training.eagle_train import train_eagle

    cfg = TrainConfig(epochs=1, max_steps=2, batch_size=2, window=16, lr=1e-12, unroll=1)
    train_eagle(features, model, cfg, tmp_path / "eagle", True, vocab_size=20, progress=False)
    rep = train_eagle(features, model, cfg, tmp_path / "par", True, vocab_size=24, progress=False, block_size=3,
                      init=tmp_path / "eagle", heldout=features)
    e = EagleDrafter.from_pretrained(str(tmp_path / "eagle"), model).state_dict()
    p = ParallelDrafter.from_pretrained(str(tmp_path / "par"), model).state_dict()
    assert rep["draft_vocab"] == 20 and set(p) - set(e) == {"block_inputs"}
    for name in e:
        torch.testing.assert_close(p[name], e[name], atol=1e-3, rtol=1e-3)
    deep = train_eagle(features, model, cfg, tmp_path / "deep", True, progress=False, block_size=3, block_layers=2,
                       init=tmp_path / "par", heldout=features)
    assert deep["heldout"] == rep["heldout"]  # block layers start as the identity (lr 1e-12: unchanged)
    d = ParallelDrafter.from_pretrained(str(tmp_path / "deep"), model)
    assert d.config.block_layers == 2 and deep["train"]["block_layers"] == 2
    assert {k.split(".")[0] for k in set(d.state_dict()) - set(p)} == {"refiner"}
    ctx = train_eagle(features, model, cfg, tmp_path / "ctx", True, progress=False, block_size=3, block_layers=2,
                      block_context=True, init=tmp_path / "par", heldout=features)
    assert ctx["heldout"] == rep["heldout"]  # context layers start as the identity too
    assert ParallelDrafter.from_pretrained(str(tmp_path / "ctx"), model).config.block_context
    train_eagle(features, model, cfg, tmp_path / "last", False, vocab_size=20, progress=False)
    with pytest.raises(ValueError, match=r"reads feature layers \[\], these features hold \[1, 2\]"):
        train_eagle(features, model, cfg, tmp_path / "bad", True, progress=False, block_size=3, init=tmp_path / "last")
