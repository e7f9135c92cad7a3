"""The training pipeline refuses what would silently spoil a run: a resume under other settings or
data, a head finalized with no training, held-out features of another model, token shards of
another tokenizer; it trains every batch of an epoch, keeps held-out conversations out of the
training split, leaves token shards readable when a rerun is interrupted, and turns bad input
into `error: ...` (exit 2) instead of a traceback."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_llama
from spec_plugins.cli import app
from spec_plugins.training.batches import epoch_batches, plan_windows
from spec_plugins.training.features import FeatureStore, extract
from spec_plugins.training.tokens import TokenStore, write_token_shards
from spec_plugins.training.trainer import TrainConfig

LAYERS = (1, 2)


def examples(n=24, seed=0, vocab=32):
    """Sequences whose second half is 'the assistant's' and follows a simple rule (learnable)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(12, 30, (1,), generator=g))
        start = int(torch.randint(0, vocab, (1,), generator=g))
        ids = [(start + 3 * i) % vocab for i in range(L)]
        out.append((ids, [i >= L // 2 for i in range(L)]))
    return out


def save_model(directory, vocab=32, **kw):
    """A tiny llama with a word-level tokenizer, as a transformers directory the CLI loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token=f"w{vocab - 1}").save_pretrained(directory)
    tiny_llama(vocab=vocab, sharpness=4.0, **kw).save_pretrained(directory)
    return str(directory)


def feature_dir(model, directory, target, seed=0):
    extract(model, examples(seed=seed), directory, {"target": target, "layers": list(LAYERS)}, LAYERS, 10_000,
            shard_tokens=128, progress=False)
    return directory


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, sharpness=8.0)


@pytest.fixture(scope="module")
def features(model, tmp_path_factory):
    return FeatureStore(feature_dir(model, tmp_path_factory.mktemp("feat"), "tiny"))


@pytest.fixture(scope="module")
def other_features(model, tmp_path_factory):
    """Same target and shapes, other conversations."""
    return FeatureStore(feature_dir(model, tmp_path_factory.mktemp("feat2"), "tiny", seed=1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Model directories: a, b (same shapes, other weights), wide (hidden 48); features of each."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    dirs = {"a": save_model(root / "a", seed=4), "b": save_model(root / "b", seed=5),
            "wide": save_model(root / "wide", seed=6, hidden=48, layers=3)}
    feats = {k: str(feature_dir(AutoModelForCausalLM.from_pretrained(d).eval(), root / f"feat-{k}", d))
             for k, d in dirs.items()}
    return dirs, feats


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def eagle(store, model, out, **cfg):
    from spec_plugins.training.eagle_train import train_eagle

    base = dict(epochs=4, batch_size=2, window=16, lr=1e-3, unroll=2)
    return train_eagle(store, model, TrainConfig(**(base | cfg)), out, True, vocab_size=24, progress=False)


# ---- resume ----------------------------------------------------------------------------------
@pytest.mark.parametrize("change,named", [({"lr": 0.1}, "lr 0.001 (now 0.1)"), ({"loss": "top1"}, "loss 'soft' (now 'top1')"),
                                          ({"seed": 1}, "seed 0 (now 1)"), ({"unroll": 3}, "unroll 2 (now 3)"),
                                          ({"window": 24}, "window 16 (now 24)")])
def test_a_resume_under_other_settings_is_refused_by_name(change, named, model, features, tmp_path):
    eagle(features, model, tmp_path, stop_after=1)
    with pytest.raises(ValueError, match=re.escape(named) + ".*use a new --out"):
        eagle(features, model, tmp_path, **change)


def test_a_resume_on_other_data_is_refused_and_one_on_the_same_data_finishes(model, features, other_features,
                                                                           tmp_path):
    total = eagle(features, model, tmp_path, stop_after=1)["steps"]
    with pytest.raises(ValueError, match=r"training data \(fingerprint\)"):
        eagle(other_features, model, tmp_path)
    # what may change: when to stop, finalize, and an --epochs / --max-steps giving the same steps
    assert eagle(features, model, tmp_path, stop_after=1)["steps_done"] == 2
    done = eagle(features, model, tmp_path, epochs=9, max_steps=total, finalize=True)
    assert done["finished"] and done["resumed_from"] == 2 and done["steps"] == 2


def test_a_medusa_resume_on_other_data_is_refused(model, features, other_features, tmp_path):
    from spec_plugins.training.medusa_train import train_medusa

    cfg = dict(epochs=2, batch_size=2, window=16)
    train_medusa(features, model, TrainConfig(**cfg, stop_after=1), tmp_path, 2, 24, progress=False)
    with pytest.raises(ValueError, match=r"training data \(fingerprint\)"):
        train_medusa(other_features, model, TrainConfig(**cfg), tmp_path, 2, 24, progress=False)


def test_a_medusa_calibration_says_which_features_it_was_measured_on(model, features, other_features, tmp_path):
    """Without held-out features the rank accuracies come from the training ones (optimistic)."""
    from spec_plugins.training.medusa_train import train_medusa

    cfg = TrainConfig(epochs=1, batch_size=2, window=16)
    train_medusa(features, model, cfg, tmp_path / "t", 2, 24, progress=False)
    train_medusa(features, model, cfg, tmp_path / "h", 2, 24, heldout=other_features, progress=False)
    for name, source in (("t", "train"), ("h", "heldout")):
        saved = json.loads((tmp_path / name / "config.json").read_text())
        report = json.loads((tmp_path / name / "train_report.json").read_text())
        assert saved["calibration_source"] == report["calibration_source"] == source


def test_the_cli_refuses_a_resume_with_another_lr(saved, tmp_path):
    _, feats = saved
    head = ["train", "eagle", "--features", feats["a"], "--out", tmp_path / "h", "--draft-vocab", "24", "--window", "16",
            "--no-progress"]
    assert cli(*head, "--stop-after", "1").exit_code == 0
    res = cli(*head, "--lr", "0.1")
    assert res.exit_code == 2 and "lr 0.001 (now 0.1)" in res.output, res.output


def test_finalize_without_a_checkpoint_is_refused(model, features, tmp_path):
    with pytest.raises(ValueError, match="nothing to finalize"):
        eagle(features, model, tmp_path / "h", finalize=True)
    assert not (tmp_path / "h").exists()


# ---- epochs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_one_epoch_trains_every_window_of_every_shard(kind, model, features, tmp_path):
    from spec_plugins.training.medusa_train import train_medusa

    windows = plan_windows(features, 8)
    batches = len(epoch_batches(windows, 4, seed=0, epoch=0))
    assert batches > math.ceil(len(windows) / 4)  # shards end in partial batches: an epoch has more
    seen: list[int] = []

    def hook(module, step, seconds, positions):
        seen.append(positions)
        return False

    cfg = TrainConfig(epochs=1, batch_size=4, window=8, unroll=1)
    if kind == "eagle":
        from spec_plugins.training.eagle_train import train_eagle

        rep = train_eagle(features, model, cfg, tmp_path, True, vocab_size=24, progress=False, hook=hook)
    else:
        rep = train_medusa(features, model, cfg, tmp_path, 2, 24, progress=False, hook=hook)
    assert rep["steps"] == batches and sum(seen) == rep["train_tokens"] == sum(w.length for w in windows)


# ---- held-out split --------------------------------------------------------------------------
def test_the_held_out_split_shares_no_first_turn_with_the_training_split(tmp_path):
    from spec_plugins.training.sharegpt import DataFilter, conversation_key, conversations, is_heldout

    ids = [f"c{i}_0" for i in range(200)]
    held = [i for i in ids if is_heldout(i, 0.3)][:3]
    train = [i for i in ids if not is_heldout(i, 0.3)][:3]
    answer = "a fine and complete answer"

    def rec(rid, question):
        return {"id": rid, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}

    records = [rec(train[0], "Tell me about the sea"), rec(held[0], "tell me   about the SEA"),  # train first
               rec(held[1], "Tell me about the moon"), rec(train[1], "Tell me about the moon"),  # held-out first
               rec(train[2], "Tell me about rivers"), rec(held[2], "Tell me about mountains")]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    split = {s: {rid: conversation_key(m) for rid, m in conversations(path, DataFilter(), s, 0.3)}
             for s in ("train", "heldout", "all")}
    assert not set(split["train"].values()) & set(split["heldout"].values())
    assert split["train"] | split["heldout"] == split["all"]  # the first occurrence wins, in either split
    assert set(split["heldout"]) == {held[1], held[2]} and set(split["train"]) == {train[0], train[2]}


# ---- held-out features -----------------------------------------------------------------------
@pytest.mark.parametrize("held,named", [("b", "target"), ("wide", "hidden width 48 (training features: 32)")])
def test_held_out_features_of_another_model_are_refused_before_training(held, named, saved, tmp_path):
    _, feats = saved
    res = cli("train", "eagle", "--features", feats["a"], "--heldout", feats[held], "--out", tmp_path / "h",
              "--draft-vocab", "24", "--window", "16", "--max-steps", "2", "--no-progress")
    assert res.exit_code == 2 and "do not match the training features" in res.output and named in res.output, res.output
    assert not (tmp_path / "h").exists()


# ---- features from token shards --------------------------------------------------------------
def tokens_dir(directory, target, vocab=32):
    write_token_shards(examples(vocab=vocab), directory, {"target": target}, vocab, 10**6, 128)
    return directory


def features_from_tokens(tokens, target, out, *extra):
    return cli("train", "features", "--source", "tokens", "--tokens", tokens, "--target", target, "--out", out,
               "--layers", "1", "--shard-tokens", "256", "--no-progress", *extra)


def test_token_shards_are_checked_against_the_target(saved, tmp_path):
    dirs, _ = saved
    res = features_from_tokens(tokens_dir(tmp_path / "t64", dirs["a"], vocab=64), dirs["a"], tmp_path / "f64")
    assert res.exit_code == 2 and "64-token vocabulary" in res.output, res.output
    res = features_from_tokens(tokens_dir(tmp_path / "ta", dirs["a"]), dirs["b"], tmp_path / "fb")
    assert res.exit_code == 2 and "holds tokens made for" in res.output, res.output
    assert not (tmp_path / "f64").exists() and not (tmp_path / "fb").exists()
    res = features_from_tokens(tmp_path / "ta", dirs["a"], tmp_path / "fs", "--responses", "self")
    assert res.exit_code == 2 and "drop --responses self" in res.output, res.output
    relative = os.path.relpath(dirs["a"])  # another spelling of the same model is the same model
    assert features_from_tokens(tmp_path / "ta", relative, tmp_path / "fa").exit_code == 0


def test_features_from_token_shards_are_cut_at_max_seq(saved, tmp_path):
    dirs, _ = saved
    res = features_from_tokens(tokens_dir(tmp_path / "t", dirs["a"]), dirs["a"], tmp_path / "f", "--max-seq", "16")
    assert res.exit_code == 0, res.output
    st = FeatureStore(tmp_path / "f")
    lengths = [int(b - a) for i in range(len(st.shards)) for o in [st.read(i, ["offsets"])["offsets"]]
               for a, b in zip(o[:-1], o[1:])]
    assert max(lengths) == 16 and len(lengths) == 24 and st.meta["max_seq"] == 16


def test_an_interrupted_token_rerun_leaves_the_earlier_shards_readable(tmp_path):
    def conv(tag):
        return [tag, 1, 2, 3] * 4, [False] * 8 + [True] * 8

    write_token_shards([conv(10)] * 24, tmp_path, {"run": 1}, 32, 10**6, shard_tokens=128)
    first = [c for i in range(len(TokenStore(tmp_path).shards)) for c in TokenStore(tmp_path).conversations(i)]

    def interrupted():
        for n in range(100):
            if n == 32:  # after four shards of the second run
                raise KeyboardInterrupt
            yield conv(20)

    with pytest.raises(KeyboardInterrupt):
        write_token_shards(interrupted(), tmp_path, {"run": 2}, 32, 10**6, shard_tokens=128)
    st = TokenStore(tmp_path)
    assert st.meta == {"run": 1} and [c for i in range(len(st.shards)) for c in st.conversations(i)] == first
    write_token_shards([conv(30)] * 4, tmp_path, {"run": 3}, 32, 10**6, shard_tokens=128)  # fewer shards than run 1
    st = TokenStore(tmp_path)
    assert st.meta == {"run": 3} and len(st.shards) == 1 and st.conversations(0) == [conv(30)] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "shard-00000.npz"]


# ---- errors, not tracebacks ------------------------------------------------------------------
def test_a_features_out_made_with_other_settings_is_an_error(saved, tmp_path):
    dirs, _ = saved
    tokens_dir(tmp_path / "t", dirs["a"])
    assert features_from_tokens(tmp_path / "t", dirs["a"], tmp_path / "f").exit_code == 0
    res = features_from_tokens(tmp_path / "t", dirs["a"], tmp_path / "f", "--max-seq", "20")
    assert res.exit_code == 2 and "other settings" in res.output and "max_seq 256 (now 20)" in res.output, res.output  # unset: the context


def test_an_unknown_gen_backend_is_an_error_before_any_output(saved, tmp_path):
    dirs, _ = saved
    (tmp_path / "p.jsonl").write_text('{"prompt": "w1 w2 w3"}\n')
    res = cli("train", "features", "--source", "prompts", "--prompts", tmp_path / "p.jsonl", "--responses", "self",
              "--gen-backend", "nope", "--target", dirs["a"], "--out", tmp_path / "f", "--no-progress")
    assert res.exit_code == 2 and "nope" in res.output, res.output
    assert not (tmp_path / "f").exists()


def test_epochs_must_be_positive(saved, tmp_path):
    res = cli("train", "eagle", "--features", saved[1]["a"], "--out", tmp_path / "h", "--epochs", "0")
    assert res.exit_code == 2 and "epochs must be a positive number" in res.output, res.output


def test_self_distill_refuses_a_temperature_that_is_not_a_number(tmp_path):
    from spec_plugins.training.self_distill import variants

    with pytest.raises(ValueError, match="finite"):
        variants([0.0, float("nan")], 1)
    res = cli("train", "self-distill", "--out", tmp_path / "s", "--temperatures", "0,inf", "--backend", "nope")
    assert res.exit_code == 2 and "finite" in res.output, res.output


def test_an_init_head_of_another_shape_is_refused_by_tensor(model, features, saved, tmp_path):
    from transformers import AutoModelForCausalLM

    from spec_plugins.training.eagle_train import train_eagle

    cfg = TrainConfig(epochs=1, max_steps=1, batch_size=2, window=16, unroll=1)
    train_eagle(features, model, cfg, tmp_path / "eagle", True, vocab_size=20, progress=False)
    train_eagle(features, model, cfg, tmp_path / "b3", True, progress=False, block_size=3, init=tmp_path / "eagle")
    with pytest.raises(ValueError, match=re.escape("block_inputs [2, 32] (this drafter: [3, 32])")):
        train_eagle(features, model, cfg, tmp_path / "b4", True, progress=False, block_size=4, init=tmp_path / "b3")
    dirs, feats = saved
    wide = AutoModelForCausalLM.from_pretrained(dirs["wide"]).eval()
    with pytest.raises(ValueError, match=re.escape("fc.weight [32, 64] (this drafter: [48, 96])")):
        train_eagle(FeatureStore(feats["wide"]), wide, cfg, tmp_path / "w", True, progress=False, block_size=3,
                    init=tmp_path / "eagle")
    assert not (tmp_path / "b4").exists() and not (tmp_path / "w").exists()


def test_max_seq_past_the_targets_context_is_refused_and_unset_fits_it(saved, tmp_path):
    """The tiny target serves 256 positions: features of positions past them were written."""
    dirs, _ = saved
    long = [((5 + 3 * i) % 32 for i in range(600))]
    write_token_shards([(list(ids), [i >= 20 for i in range(600)]) for ids in long], tmp_path / "t", {"target": dirs["a"]},
                       32, 10_000)
    res = features_from_tokens(tmp_path / "t", dirs["a"], tmp_path / "over", "--max-seq", "1024")
    assert res.exit_code == 2 and "--max-seq 1024 exceeds the target's context of 256" in res.output, res.output
    assert not (tmp_path / "over").exists()
    assert features_from_tokens(tmp_path / "t", dirs["a"], tmp_path / "fit").exit_code == 0
    st = FeatureStore(tmp_path / "fit")
    assert st.meta["max_seq"] == 256 and int(st.read(0, ["offsets"])["offsets"][-1]) == 256


def test_held_out_chains_count_depths_past_a_short_window_as_misses():
    """A held-out window of 3 queries evaluated at 5 depths (it crashed after training, so no head
    was written): depth s of the draft from query i is query i + s, right only inside the window."""
    from spec_plugins.training.eagle_train import chain_lengths

    g = torch.Generator().manual_seed(0)
    right = [torch.rand(2, 3, generator=g) < 0.8 for _ in range(5)]
    start = torch.tensor([[True, True, False], [True, True, True]])
    want = [sum(all(i + t < 3 and bool(right[t][b, i + t]) for t in range(s + 1))
                for b in range(2) for i in range(3) if start[b, i]) for s in range(5)]
    assert chain_lengths(right, start) == want and want[3:] == [0, 0]


def test_self_answers_get_the_room_the_context_leaves(saved, tmp_path):
    """--max-new-tokens 256 (the default) on a 256-position target: each answer is cut at the
    context's room (it asked past the context, which the decoder refuses)."""
    from transformers import AutoTokenizer

    dirs, _ = saved
    tok = AutoTokenizer.from_pretrained(dirs["a"])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(tmp_path / "m")
    for f in ("config.json", "model.safetensors"):
        (tmp_path / "m" / f).write_bytes((Path(dirs["a"]) / f).read_bytes())
    (tmp_path / "p.jsonl").write_text('{"prompt": "w1 w2 w3"}\n')
    res = cli("train", "features", "--source", "prompts", "--prompts", tmp_path / "p.jsonl", "--responses", "self",
              "--gen-backend", "torch", "--target", tmp_path / "m", "--layers", "1", "--out", tmp_path / "f",
              "--max-tokens", "10", "--no-progress")
    assert res.exit_code == 0, res.output
