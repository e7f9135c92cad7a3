"""Edges of the training pipeline: a features resume over token shards or prompts that now hold
other data is refused by name; a target whose logits are not its LM head's product is refused
before any shard; a resumed `--responses self` extraction answers only the prompts it has not
consumed; the draft vocabulary counts only the trained windows; options that do nothing for the
chosen source are refused; a rerun of a finished run keeps its report's losses."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from test_training_hardening import cli, examples, features_from_tokens, save_model, tokens_dir

from conftest import tiny_llama
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.training.batches import plan_windows, token_counts
from spec_plugins.training.features import FeatureStore, extract
from spec_plugins.training.tokens import write_token_shards
from spec_plugins.training.trainer import TrainConfig

F, T = False, True
CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the word-level tokenizer's words, as they are


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny llama directory whose word-level tokenizer has a chat template (prompts as text)."""
    from transformers import AutoTokenizer

    d = save_model(tmp_path_factory.mktemp("model") / "m", seed=4)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = CHAT
    tok.save_pretrained(d)
    return d


# ---- resume identity -------------------------------------------------------------------------
def test_a_features_resume_over_token_shards_written_again_with_other_data_is_refused(target, tmp_path):
    tokens_dir(tmp_path / "t", target)
    assert features_from_tokens(tmp_path / "t", target, tmp_path / "f", "--max-tokens", "200").exit_code == 0
    write_token_shards(examples(), tmp_path / "t", {"target": target}, 32, 10**6, 128)  # the same data again
    res = features_from_tokens(tmp_path / "t", target, tmp_path / "f", "--max-tokens", "300")
    assert res.exit_code == 0, res.output
    before = json.loads((tmp_path / "f" / "progress.json").read_text())
    write_token_shards(examples(seed=1), tmp_path / "t", {"target": target}, 32, 10**6, 128)  # same meta, other data
    res = features_from_tokens(tmp_path / "t", target, tmp_path / "f")
    assert res.exit_code == 2 and "token shards (fingerprint)" in res.output, res.output
    assert json.loads((tmp_path / "f" / "progress.json").read_text()) == before  # nothing mixed in


def test_a_features_resume_over_another_prompts_file_content_is_refused(target, tmp_path):
    prompts = tmp_path / "p.jsonl"

    def run():
        return cli("train", "features", "--source", "prompts", "--prompts", prompts, "--responses", "self",
                   "--gen-backend", "torch", "--max-new-tokens", "4", "--target", target, "--layers", "1",
                   "--out", tmp_path / "f", "--max-tokens", "10", "--no-progress")

    prompts.write_text('{"prompt": "w1 w2 w3"}\n{"prompt": "w4 w5"}\n')
    assert run().exit_code == 0
    prompts.write_text('{"prompt": "w7 w8 w9"}\n{"prompt": "w4 w5"}\n')
    res = run()
    assert res.exit_code == 2 and "prompts (fingerprint)" in res.output, res.output


def test_self_distill_records_the_language_and_held_out_share(target, tmp_path, monkeypatch):
    import spec_plugins.training.sources as sources

    monkeypatch.setattr(sources, "sharegpt_examples", lambda *a, **k: iter(examples(n=2)))
    res = cli("train", "self-distill", "--out", tmp_path / "s", "--target", target, "--backend", "torch",
              "--max-tokens", "40", "--max-new-tokens", "4", "--temperatures", "0", "--language", "any",
              "--heldout-share", "0.3")
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())["meta"]
    assert meta["language"] == "any" and meta["heldout_share"] == 0.3


# ---- logits that are not the LM head's product ------------------------------------------------
def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    return GraniteForCausalLM(GraniteConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0,
                                            tie_word_embeddings=False)).eval()


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    return CohereForCausalLM(CohereConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, logit_scale=0.0625)).eval()


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    m = Gemma2ForCausalLM(Gemma2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       final_logit_softcapping=2.0)).eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(20.0)  # logits well past the cap
    return m


@pytest.mark.parametrize("build", [_granite, _cohere, _gemma2])
def test_a_target_whose_logits_are_not_its_lm_heads_product_is_refused_before_any_shard(build, tmp_path):
    model = build()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    head = torch.nn.functional.linear(model.get_decoder()(input_ids=ids).last_hidden_state,
                                      model.get_output_embeddings().weight)
    assert not torch.allclose(model(ids).logits, head, atol=1e-3)  # the model's distribution is not the head's
    with pytest.raises(ValueError, match="not its LM head's product"):
        extract(model, examples(n=2), tmp_path / "f", {"target": "t", "layers": [1]}, (1,), 10_000, progress=False)
    assert not (tmp_path / "f" / "progress.json").exists()
    from spec_plugins.training.features import check_plain_head

    check_plain_head(tiny_llama(seed=1), ids)  # a plain head passes


def test_the_cli_refuses_a_scaled_logits_target_with_an_error(tmp_path):
    d = save_model(tmp_path / "g")
    _granite().save_pretrained(d)  # the word-level tokenizer stays beside it
    tokens_dir(tmp_path / "t", d)
    res = features_from_tokens(tmp_path / "t", d, tmp_path / "f")
    assert res.exit_code == 2 and "not its LM head's product" in res.output, res.output
    assert not (tmp_path / "f" / "progress.json").exists()


# ---- resuming self-distilled features ---------------------------------------------------------
def test_a_resumed_self_extraction_answers_only_the_prompts_it_has_not_consumed(target, tmp_path, monkeypatch):
    answered: list[int] = []
    generate = SpeculativeDecoder.generate_batch

    def counted(self, prompts, *a, **k):
        answered.append(len(prompts))
        return generate(self, prompts, *a, **k)

    monkeypatch.setattr(SpeculativeDecoder, "generate_batch", counted)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(1, 7)))

    def run(out, budget):
        answered.clear()
        res = cli("train", "features", "--source", "prompts", "--prompts", prompts, "--responses", "self",
                  "--gen-backend", "torch", "--max-new-tokens", "4", "--gen-batch", "2", "--target", target,
                  "--layers", "1", "--out", out, "--max-tokens", budget, "--no-progress")
        assert res.exit_code == 0, res.output
        return json.loads((out / "progress.json").read_text())

    first = run(tmp_path / "f", "15")
    assert 0 < first["consumed"] < 6
    done = run(tmp_path / "f", "100000")
    assert sum(answered) == 6 - first["consumed"] and done["consumed"] == 6
    run(tmp_path / "whole", "100000")  # the same extraction in one go
    feats = [FeatureStore(tmp_path / d) for d in ("f", "whole")]
    a, b = ([s.load(i).tokens.tolist() for i in range(len(s.shards))] for s in feats)
    assert sum(a, []) == sum(b, [])


def test_examples_that_skip_a_different_count_than_the_resume_point_are_refused(tmp_path):
    with pytest.raises(ValueError, match="start after 3 examples"):
        extract(tiny_llama(), examples(n=4), tmp_path, {"target": "t"}, (1,), 10_000, progress=False, skipped=3)


# ---- draft vocabulary counts --------------------------------------------------------------------
def test_token_counts_cover_only_the_trained_windows_labels(tmp_path):
    from spec_plugins.training.eagle_train import draft_vocab

    ex = [([30, 31, 1, 2, 3, 4, 1, 2, 3, 4], [F, F] + [T] * 8), ([30, 31, 20, 21, 22, 23, 20, 21, 22, 23], [F, F] + [T] * 8),
          ([29, 5, 6, 7, 5, 6], [F, T, T, T, T, T])]
    extract(tiny_llama(), ex, tmp_path, {"target": "t", "layers": [1]}, (1,), 10_000, shard_tokens=1_000, progress=False)
    store = FeatureStore(tmp_path)

    def labels(convs):  # an independent count: the answer tokens x_{j+2}, from position 2 of each conversation
        return Counter(t for ids, tr in convs for t, m in list(zip(ids, tr))[2:] if m)

    for window in (3, 16):
        first = plan_windows(store, window, max_tokens=10)  # the first conversation only
        c = token_counts(store, 32, first)
        assert {i: int(n) for i, n in enumerate(c.tolist()) if n} == labels(ex[:1])
        c = token_counts(store, 32, plan_windows(store, window))
        assert {i: int(n) for i, n in enumerate(c.tolist()) if n} == labels(ex)
    ids, coverage = draft_vocab(store, plan_windows(store, 16, max_tokens=10), 4, 32)
    assert ids.tolist() == [1, 2, 3, 4] and coverage == 1.0


# ---- options that do nothing ----------------------------------------------------------------
@pytest.mark.parametrize("extra,named", [
    (["--source", "sharegpt", "--prompts", "p.jsonl"], "--prompts goes with --source prompts"),
    (["--source", "tokens", "--tokens", "t", "--prompts", "p.jsonl"], "--prompts goes with --source prompts"),
    (["--max-new-tokens", "8"], "--max-new-tokens goes with --responses self"),
    (["--gen-backend", "torch"], "--gen-backend goes with --responses self"),
    (["--gen-batch", "4"], "--gen-batch goes with --responses self"),
    (["--source", "tokens", "--tokens", "t", "--split", "heldout"], "--split picks ShareGPT conversations"),
    (["--source", "prompts", "--responses", "self", "--language", "any"], "--language picks ShareGPT"),
    (["--source", "tokens", "--tokens", "t", "--heldout-share", "0.1"], "--heldout-share picks ShareGPT"),
])
def test_features_options_that_do_nothing_for_the_source_are_refused(extra, named, tmp_path):
    res = cli("train", "features", "--target", tmp_path / "no-model", "--out", tmp_path / "f", *extra)
    assert res.exit_code == 2 and named in res.output, res.output
    assert not (tmp_path / "f").exists()


# ---- reports ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_rerun_of_a_finished_run_keeps_the_reports_losses(kind, tmp_path):
    from spec_plugins.training.eagle_train import train_eagle
    from spec_plugins.training.medusa_train import train_medusa

    model = tiny_llama(seed=0, sharpness=8.0)
    extract(model, examples(n=8), tmp_path / "f", {"target": "t", "layers": [1, 2]}, (1, 2), 10_000, progress=False)
    cfg = TrainConfig(epochs=1, max_steps=3, batch_size=2, window=16, unroll=1)
    def train():
        if kind == "medusa":
            return train_medusa(FeatureStore(tmp_path / "f"), model, cfg, tmp_path / "h", num_heads=2, vocab_size=20,
                                progress=False)
        return train_eagle(FeatureStore(tmp_path / "f"), model, cfg, tmp_path / "h", True, vocab_size=20, progress=False)

    first, again = train(), train()
    assert first["first_losses"] and again["first_losses"] == first["first_losses"]
    assert again["last_losses"] == first["last_losses"]
    assert json.loads((tmp_path / "h" / "train_report.json").read_text())["first_losses"] == first["first_losses"]
