"""Round 11 of the training pipeline's edges: layer outputs past fp16's range are stored finite
(bf16) on disk and live, non-finite target outputs are refused, a non-finite loss stops training
without a head; held-out features split with a larger --heldout-share are refused; an LM head with
a bias is refused; --reg-weight inf is refused; held-out features are compared on their layers
only where the head reads them."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama
from test_training_hardening import LAYERS, cli, examples, feature_dir, save_model

from spec_plugins.training.features import (
    FeatureStore,
    Shard,
    check_heldout,
    extract,
    target_outputs,
)
from spec_plugins.training.live import LiveFeatures
from spec_plugins.training.tokens import TokenStore, write_token_shards
from spec_plugins.training.trainer import TrainConfig

HEAD = ["--draft-vocab", "24", "--window", "16", "--max-steps", "1", "--no-progress"]
HUGE = 31  # the token whose embedding row is scaled past fp16's range
FP16_MAX = torch.finfo(torch.float16).max


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A model directory ``a`` and its training features (layers 1, 2)."""
    from transformers import AutoModelForCausalLM

    r = tmp_path_factory.mktemp("r11")
    d = save_model(r / "a", seed=4)
    feature_dir(AutoModelForCausalLM.from_pretrained(d).eval(), r / "feat", d)
    return r


def massive(scale: float = 1e6):
    """A tiny target whose decoder-layer outputs at token HUGE pass fp16's 65504 (as Gemma-3's
    massive activations do), while its final-normed hidden state stays small."""
    m = tiny_llama(seed=0, sharpness=8.0)
    with torch.no_grad():
        m.model.embed_tokens.weight[HUGE].mul_(scale)
    return m


def two_conversations():
    """One conversation without token HUGE (fits fp16), one with it (does not)."""
    small = list(range(24))
    big = [(5 + 3 * i) % 30 for i in range(20)] + [HUGE, 2, 4, 6]
    return [(ids, [i >= len(ids) // 2 for i in range(len(ids))]) for ids in (small, big)]


def check_against_target(shard: Shard, model, convs) -> None:
    """The stored features equal the target's float32 outputs within 16-bit rounding, and are finite."""
    assert shard.layers.isfinite().all() and shard.hidden.isfinite().all()
    for c, (ids, _) in enumerate(convs):
        ref = target_outputs(model, torch.tensor([ids]), LAYERS)
        s = shard.span(c)
        torch.testing.assert_close(shard.layers[s].float(), ref["layers"], rtol=1 / 128, atol=2e-2)
        torch.testing.assert_close(shard.hidden[s].float(), ref["hidden"], rtol=1 / 128, atol=2e-2)


# ---- 1. layer outputs past fp16's range; non-finite outputs and losses --------------------------
def test_layer_outputs_past_fp16_range_are_stored_finite_and_train_a_finite_head(tmp_path):
    from spec_plugins.training.eagle_train import train_eagle

    model, convs = massive(), two_conversations()
    assert float(target_outputs(model, torch.tensor([convs[1][0]]), LAYERS)["layers"].abs().max()) > FP16_MAX
    extract(model, convs, tmp_path / "one", {"target": "tiny", "layers": list(LAYERS)}, LAYERS, 10_000,
            progress=False)  # both conversations in one shard: one fp16 and one bf16 part
    shard = FeatureStore(tmp_path / "one").load(0)
    assert shard.layers.dtype == torch.bfloat16 and shard.hidden.dtype == torch.float16  # the hidden fits fp16
    check_against_target(shard, model, convs)
    extract(model, convs, tmp_path / "two", {"target": "tiny", "layers": list(LAYERS)}, LAYERS, 10_000,
            shard_tokens=16, progress=False)  # a shard each: the dtype is per shard
    store = FeatureStore(tmp_path / "two")
    assert [store.load(i).layers.dtype for i in range(2)] == [torch.float16, torch.bfloat16]
    cfg = TrainConfig(max_steps=4, batch_size=1, window=16, unroll=2, reg_weight=1.0)
    train_eagle(store, model, cfg, tmp_path / "h", True, vocab_size=24, progress=False)
    from safetensors.torch import load_file

    assert all(v.isfinite().all() for v in load_file(str(tmp_path / "h" / "head.safetensors")).values()
               if v.is_floating_point())


def test_live_features_past_fp16_range_are_finite(tmp_path):
    model, convs = massive(), two_conversations()
    write_token_shards(convs, tmp_path, {"target": "tiny"}, vocab=32, max_tokens=10_000, shard_tokens=1000)
    live = LiveFeatures(TokenStore(tmp_path), model, LAYERS, "tiny", prefill_tokens=30)  # one row per forward
    shard = live.load(0)
    assert shard.layers.dtype == torch.bfloat16
    check_against_target(shard, model, convs)


@pytest.mark.parametrize("first", [False, True], ids=["in-a-later-conversation", "in-the-probe"])
def test_non_finite_target_outputs_are_refused_and_nothing_is_written(first, tmp_path):
    model = tiny_llama(seed=0, sharpness=8.0)
    with torch.no_grad():
        model.model.embed_tokens.weight[HUGE] = math.inf  # the target's own outputs at HUGE are inf / NaN
    convs = two_conversations()[::-1] if first else two_conversations()
    with pytest.raises(ValueError, match="LlamaForCausalLM produced non-finite values .* running in float32"):
        extract(model, convs, tmp_path / "f", {"target": "tiny", "layers": list(LAYERS)}, LAYERS, 10_000,
                progress=False)
    assert not list((tmp_path / "f").iterdir())
    write_token_shards(convs, tmp_path / "tok", {"target": "tiny"}, vocab=32, max_tokens=10_000, shard_tokens=1000)
    with pytest.raises(ValueError, match="produced non-finite values"):
        LiveFeatures(TokenStore(tmp_path / "tok"), model, LAYERS, "tiny").load(0)


def _poison(store: FeatureStore) -> None:
    """Shard 0 as an earlier version wrote a massive-activation target's features: fp16 with inf."""
    shard = store.load(0)
    shard.layers[3, 0, 0] = math.inf
    shard.save(store.shards[0])


@pytest.mark.parametrize("how", ["inf-features", "inf-reg-weight"])
def test_a_non_finite_loss_stops_training_and_writes_no_head(how, root, tmp_path):
    from transformers import AutoModelForCausalLM

    from spec_plugins.training.eagle_train import train_eagle

    model = AutoModelForCausalLM.from_pretrained(root / "a").eval()
    store = FeatureStore(feature_dir(model, tmp_path / "feat", str(root / "a")))
    if how == "inf-features":
        _poison(store)
    cfg = TrainConfig(max_steps=3, batch_size=64, window=16, unroll=1, reg_weight=math.inf if how == "inf-reg-weight"
                      else 0.0)  # one batch holds a shard's windows: step 1 reads shard 0 or 1
    with pytest.raises(ValueError, match=r"the loss of step \d is (nan|inf) \(not finite\); training stopped"):
        train_eagle(store, model, cfg, tmp_path / "h", True, vocab_size=24, progress=False)
    assert not (tmp_path / "h" / "head.safetensors").exists() and not (tmp_path / "h" / "checkpoint.pt").exists()


def test_the_cli_turns_a_non_finite_loss_into_an_error(root, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "a").eval()
    _poison(FeatureStore(feature_dir(model, tmp_path / "feat", str(root / "a"))))
    res = cli("train", "eagle", "--features", tmp_path / "feat", "--out", tmp_path / "h", "--batch-size", "64", *HEAD)
    assert res.exit_code == 2 and "not finite" in res.output, res.output
    assert not (tmp_path / "h" / "head.safetensors").exists()


# ---- 2. held-out features split with a larger --heldout-share --------------------------------------
def _features(directory, **meta):
    extract(tiny_llama(seed=0, sharpness=8.0), examples(n=4), directory, {"target": "tiny", "layers": list(LAYERS),
            **meta}, LAYERS, 10_000, progress=False)
    return FeatureStore(directory)


def test_held_out_features_split_with_a_larger_share_are_refused_naming_both(tmp_path):
    train = _features(tmp_path / "train", source="sharegpt", split="train", heldout_share=0.02)
    bigger = _features(tmp_path / "big", source="sharegpt", split="heldout", heldout_share=0.1)
    with pytest.raises(ValueError, match="heldout_share 0.1, the training features .* heldout_share 0.02"):
        check_heldout(train, bigger)
    for share in (0.02, 0.01):  # the same or a smaller share: every held-out conversation is outside training
        check_heldout(train, _features(tmp_path / f"s{share}", source="sharegpt", split="heldout", heldout_share=share))
    # the prompts source splits no ShareGPT conversations: its recorded share means nothing
    check_heldout(train, _features(tmp_path / "p", source="prompts", split="heldout", heldout_share=0.3))


def test_held_out_features_of_token_shards_compare_the_shards_share(tmp_path):
    train = _features(tmp_path / "train", source="sharegpt", split="train", heldout_share=0.02)
    tok = {"source": "tokens", "split": "heldout", "heldout_share": 0.02}  # the CLI's default, not the shards'
    bad = _features(tmp_path / "bad", **tok, token_meta={"source": "sharegpt", "split": "heldout", "heldout_share": 0.1})
    with pytest.raises(ValueError, match="heldout_share 0.1, the training features .* heldout_share 0.02"):
        check_heldout(train, bad)
    check_heldout(train, _features(tmp_path / "ok", **tok,
                                   token_meta={"source": "sharegpt", "split": "heldout", "heldout_share": 0.02}))


# ---- 3. an LM head with a bias -------------------------------------------------------------------
def test_an_lm_head_with_a_bias_is_refused_naming_it(tmp_path):
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    m = PhiForCausalLM(PhiConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=256)).eval()
    assert m.lm_head.bias is not None
    with pytest.raises(ValueError, match="PhiForCausalLM's LM head has a bias"):
        extract(m, examples(n=2), tmp_path / "f", {"target": "phi", "layers": [1]}, (1,), 10_000, progress=False)
    assert not list((tmp_path / "f").iterdir())


# ---- 4. --reg-weight inf ---------------------------------------------------------------------------
def test_an_infinite_reg_weight_is_refused(root, tmp_path):
    res = cli("train", "eagle", "--features", root / "feat", "--out", tmp_path / "h", "--reg-weight", "inf", *HEAD)
    assert res.exit_code == 2 and "--reg-weight inf: give a finite number" in res.output, res.output
    assert not (tmp_path / "h").exists()


# ---- 5. held-out layers compared only where the head reads them -----------------------------------
def test_held_out_layers_are_compared_only_where_the_head_reads_them(root, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "a").eval()
    extract(model, examples(seed=1), tmp_path / "held", {"target": str(root / "a"), "layers": [], "split": "heldout"},
            (), 10_000, shard_tokens=128, progress=False)
    held = ["--features", root / "feat", "--heldout", tmp_path / "held"]
    res = cli("train", "medusa", *held, "--out", tmp_path / "m", "--num-heads", "2", *HEAD)
    assert res.exit_code == 0, res.output
    res = cli("train", "eagle", *held, "--no-fused", "--out", tmp_path / "e", *HEAD)
    assert res.exit_code == 0, res.output
    res = cli("train", "eagle", *held, "--out", tmp_path / "fused", *HEAD)  # the fused head reads them
    assert res.exit_code == 2 and "layers [] (training features: [1, 2])" in res.output, res.output
