"""``spec-plugins tune`` on a tiny model: it measures, predicts by replay, confirms, and writes a
config that loads; bad input fails with the problem named, before any model loads."""

from __future__ import annotations

import pytest
import yaml

from conftest import tiny_llama
from spec_plugins.config import SpecConfig
from spec_plugins.tune import Budget, TuneError, check_choices, parse_budget, tune
from spec_plugins.tune_yaml import render_yaml


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("tune") / "tiny-model"
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w31").save_pretrained(str(d))
    tiny_llama(vocab=32, seed=4, sharpness=4.0).save_pretrained(str(d))
    return d


def test_tune_writes_a_config_that_loads(tiny_dir, tmp_path):
    prompts = ["w1 w2 w3 w4 w1 w2 w3 w4 w1 w2", "w5 w6 w7 w5 w6 w7 w5", "w9 w8 w9 w8 w9 w8 w9"]
    logs = []
    res = tune(str(tiny_dir), prompts, ["torch"], ["ngram", "suffix"], Budget(600), max_new=16, log=logs.append)
    assert {m.proposer for m in res.measured} == {"ngram", "suffix"}
    assert all(m.predicted and m.predicted > 0 for m in res.measured)
    assert res.plain.tokens_per_s > 0 and res.runtimes["torch"]["plain_tokens_per_s"] > 0
    confirmed = [m for m in res.measured if m.tokens_per_s]
    assert confirmed  # the top candidates ran against plain
    cfg = SpecConfig.parse(res.config)
    assert cfg.target.backend == "torch" and cfg.verifier.type == "exact"
    if res.chosen is res.plain:
        assert cfg.proposer is None and any("beat plain" in n for n in res.notes)
    else:
        assert res.chosen.tokens_per_s > res.plain.tokens_per_s and cfg.proposer.type == res.chosen.proposer
    text = render_yaml(res, "spec-plugins tune --model tiny")
    assert text.startswith("# written by: spec-plugins tune --model tiny") and "# chosen:" in text
    assert yaml.safe_load(text) == res.config


def test_bad_input_is_named():
    with pytest.raises(TuneError, match="unknown runtime 'tpu'"):
        check_choices(["tpu"], ["ngram"])
    with pytest.raises(TuneError, match="unknown proposer 'magic'"):
        check_choices(["torch"], ["magic"])
    with pytest.raises(TuneError, match="at least one"):
        check_choices([], ["ngram"])
    assert parse_budget("5m") == 300 and parse_budget("90s") == 90 and parse_budget("2") == 2
    with pytest.raises(TuneError, match="--budget"):
        parse_budget("soon")


def test_cli_errors_before_loading(tmp_path, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from spec_plugins.cli import app

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = CliRunner().invoke(app, ["tune", "--prompts", str(empty), "--runtimes", "torch", "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and "prompt" in r.output
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    r = CliRunner().invoke(app, ["tune", "--runtimes", "llamacpp", "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and "not installed" in r.output and "[llamacpp]" in r.output


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"question_id": "a", "category": "x", "turns": ["w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"]}\n'
                 '{"question_id": "b", "category": "x", "turns": ["w5 w6 w7 w5 w6 w7 w5"]}\n')
    return p


def test_gguf_runtimes_are_refused_for_a_transformers_dir_before_loading(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["tune", "--model", str(tiny_dir), "--prompts", str(_prompts(tmp_path)),
                                 "--runtimes", "torch,onnxruntime-int4", "--proposers", "ngram",
                                 "--max-new-tokens", "8", "--out", str(tmp_path / "t.yaml")])
    assert r.exit_code == 2 and "runtime 'onnxruntime-int4' needs a GGUF model" in r.output
    assert "[tune] torch" not in r.output  # refused before anything was measured


def test_tune_default_runtimes_complete_on_a_transformers_dir(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app
    from spec_plugins.config import SpecConfig

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "t.yaml"
    r = CliRunner().invoke(app, ["tune", "--model", str(tiny_dir), "--prompts", str(_prompts(tmp_path)),
                                 "--proposers", "ngram", "--max-new-tokens", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "runtime onnxruntime-int4 left out: it needs a GGUF model" in r.output
    text = out.read_text()
    assert "# note: runtime onnxruntime-int4 left out" in text and "onnxruntime-int4:" not in text
    SpecConfig.parse(yaml.safe_load(text))


def test_a_relative_model_path_is_written_absolute(tiny_dir, tmp_path, monkeypatch):
    """``--model ./tiny-model`` was written as typed, so the config failed to load from any other
    directory: an existing local path is written absolute; a built-in name stays a name."""
    from spec_plugins.models import resolve_model

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tiny_dir.parent)
    res = tune("./tiny-model", ["w1 w2 w3 w1 w2 w3"], ["torch"], ["ngram"], Budget(600), max_new=8,
               log=lambda _: None)
    assert res.config["target"]["model"] == str(tiny_dir.resolve())
    monkeypatch.chdir(tmp_path)  # elsewhere, the written config still finds the model
    assert resolve_model(SpecConfig.parse(res.config).target.model).directory == tiny_dir.resolve()
    from spec_plugins.tune import model_reference

    (tmp_path / "smollm2-135m-instruct").mkdir()
    assert model_reference("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_a_feature_drafter_left_out_by_the_budget_is_noted(tiny_dir, tmp_path, monkeypatch):
    """With the budget spent after the first runtime, EAGLE was dropped without a word: it is noted
    in the written YAML and logged, as a runtime the budget leaves out is."""
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    logs: list[str] = []
    res = tune(str(tiny_dir), ["w1 w2 w3 w1 w2 w3"], ["torch"], ["ngram", "eagle"], Budget(1e-9), max_new=8,
               log=logs.append)
    assert "eagle on torch skipped: budget spent" in res.notes
    assert "[tune] eagle on torch skipped: budget spent" in logs
    assert "# note: eagle on torch skipped: budget spent" in render_yaml(res, "spec-plugins tune")
    assert {m.proposer for m in res.measured} == {"ngram"}


def test_a_default_runtime_that_cannot_load_the_model_is_left_out_and_a_named_one_refused(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    """A runtime that passes the up-front checks but refuses the model when built (a GGUF whose LM
    head the int4 grid cannot carry) ended the whole tune: chosen by default it is left out with
    its reason; named by the user it is a TuneError naming it."""
    import spec_plugins.tune as tune_module

    real = tune_module._decoder

    def decoder(model, rt, proposer, *args, **kwargs):
        if rt == "onnxruntime":
            raise ValueError("holds output.weight as Q6_K")
        return real(model, rt, proposer, *args, **kwargs)

    monkeypatch.setattr(tune_module, "_decoder", decoder)
    monkeypatch.setattr(tune_module, "default_runtimes", lambda model: (["onnxruntime", "torch"], {}))
    logs: list[str] = []
    res = tune(str(tiny_dir), ["w1 w2 w3 w1 w2 w3"], None, ["ngram"], Budget(600), max_new=8, log=logs.append)
    assert "runtime onnxruntime left out: holds output.weight as Q6_K" in res.notes
    assert set(res.runtimes) == {"torch"}
    with pytest.raises(TuneError, match="runtime onnxruntime cannot run .*Q6_K"):
        tune(str(tiny_dir), ["w1 w2 w3"], ["onnxruntime"], ["ngram"], Budget(600), max_new=8, log=logs.append)


def test_the_replayed_auto_is_the_policy_the_decoder_builds():
    """tune predicts ``auto`` by replay (``bench.replay.auto``): its length policy must be the one
    ``build_policy`` gives the decoder for tune's n-gram section (its depth and its margin over no
    draft), not one with the constructor's defaults. (Before: min_gain 1.0 against 1.05.) tune
    measures no drafter cost: the replay charges none and the policy prices none, alike."""
    from spec_plugins.bench.replay import auto
    from spec_plugins.policy import Costs, DraftCost, ForwardCost, build_policy
    from spec_plugins.registry import PROPOSERS as REGISTRY
    from spec_plugins.tune import PROPOSERS

    cost = ForwardCost.from_curve([0.01 * (1 + 0.1 * n) for n in range(17)])
    section = SpecConfig.parse({"target": {"backend": "torch", "model": "x"}, "proposer": PROPOSERS["ngram"]}).proposer
    proposer = REGISTRY.get(section.type)(section)
    costs = Costs(cost)
    costs.set_drafter(proposer, DraftCost())
    built, replayed = build_policy(section, proposer, costs).length, auto(cost)().length

    def shape(p):
        return type(p), p.max_k, p.min_gain, p.draft

    assert shape(replayed) == shape(built)


def test_a_spent_budget_cuts_every_pass_to_one_prompt_and_notes_it(tiny_dir, tmp_path, monkeypatch):
    """``--budget 1s`` took 16 s: only the stages between runtimes and feature drafters checked it.
    With the budget spent, plain decoding, each replay and the confirmation stop after their first
    prompt, the confirmation builds only the best prediction (counted, not timed), and the notes
    say what was cut."""
    from spec_plugins.bench import baselines, replay

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    replayed, decoded = [], []
    real_turn, real_time = replay.replay_turn, baselines.time_decoder
    monkeypatch.setattr(replay, "replay_turn", lambda p, *a, **k: replayed.append(p) or real_turn(p, *a, **k))
    monkeypatch.setattr(baselines, "time_decoder", lambda d, p, *a, **k: decoded.append(p) or real_time(d, p, *a, **k))
    prompts = ["w1 w2 w3 w4 w1 w2 w3 w4 w1 w2", "w5 w6 w7 w5 w6 w7 w5", "w9 w8 w9 w8 w9 w8 w9"]
    logs: list[str] = []
    res = tune(str(tiny_dir), prompts, ["torch"], ["ngram", "suffix"], Budget(1e-9), max_new=8, log=logs.append)
    assert len(set(map(tuple, replayed))) == 1 and len(replayed) == 2 * 10  # 2 proposers x 10 policies, 1 prompt
    assert res.runtimes["torch"]["prompts"] == 1
    assert len(decoded) == 1 + 1 + 2  # warm-up, 1 plain prompt, 1 confirmation run of plain and the best
    assert [m.label for m in res.measured if m.tokens_per_s] == [res.measured[0].label]
    assert "confirmation cut to 1 of 2 best predictions: budget spent" in res.notes
    assert "plain decoding on torch cut to 1 of 3 prompts: budget spent" in res.notes
    assert "confirmation cut to 1 of 6 interleaved prompt runs: budget spent" in res.notes
    assert "[tune] plain decoding on torch cut to 1 of 3 prompts: budget spent" in logs
    assert "# note: confirmation cut to 1 of 6" in render_yaml(res, "spec-plugins tune")
    from spec_plugins.policy import ForwardCost
    from spec_plugins.registry import PROPOSERS as REGISTRY
    from spec_plugins.tune import _replay_counted

    cls, cost = REGISTRY.get("ngram"), ForwardCost.from_curve([0.01] * 17)
    args = ([[3, 4, 5]] * 3, [[6, 7, 8]] * 3, lambda: cls(cls.Config()), cost, 0.0, 32)
    assert _replay_counted(*args)[1] == 3 and _replay_counted(*args, budget=Budget(1e-9))[1] == 1


def test_a_feature_drafter_on_a_runtime_without_hidden_states_is_noted(tiny_dir, tmp_path, monkeypatch):
    """EAGLE on llama.cpp (no hidden states) was skipped without a word, and the YAML said no
    configuration beat plain though none was measured."""
    import dataclasses

    import spec_plugins.tune as tune_module

    real = tune_module._decoder

    def no_hidden(model, rt, proposer, *args, **kwargs):
        dec = real(model, rt, proposer, *args, **kwargs)
        dec.target.capabilities = dataclasses.replace(dec.target.capabilities, hidden_states=False)
        return dec

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tune_module, "_decoder", no_hidden)
    logs: list[str] = []
    res = tune(str(tiny_dir), ["w1 w2 w3 w1 w2 w3"], ["torch"], ["eagle"], Budget(600), max_new=8, log=logs.append)
    assert "eagle on torch not measured: the runtime returns no hidden states" in res.notes
    assert "[tune] eagle on torch not measured: the runtime returns no hidden states" in logs
    assert res.measured == [] and res.chosen is res.plain
    text = render_yaml(res, "spec-plugins tune")
    assert "# chosen: plain decoding (no speculative configuration was measured)" in text
    assert "beat plain" not in text


def test_a_model_dir_without_weights_is_a_named_error(tiny_dir, tmp_path, monkeypatch):
    """A directory with config and tokenizer but no weights: transformers' OSError came out as a raw
    traceback (exit 1); it is a ValueError naming the directory, and tune exits 2 with error:."""
    import shutil

    import torch
    from typer.testing import CliRunner

    from spec_plugins.backends.torch_runtime import load_weights
    from spec_plugins.cli import app

    bare = tmp_path / "noweights"
    bare.mkdir()
    for f in tiny_dir.glob("*.json"):
        shutil.copy(f, bare)
    with pytest.raises(ValueError, match=f"cannot load the model weights from {bare}") as err:
        load_weights(str(bare), torch.float32, torch.device("cpu"))
    assert isinstance(err.value.__cause__, OSError)
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["tune", "--model", str(bare), "--prompts", str(_prompts(tmp_path)), "--runtimes",
                                 "torch", "--proposers", "ngram", "--max-new-tokens", "8", "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and "error:" in r.output and str(bare) in r.output
    assert not (tmp_path / "t").exists()


def test_the_chosen_configs_predicted_speedup_is_its_own_replays():
    """The comment divided pass 1's predicted tok/s by the confirmation run's plain tok/s (another
    time, fewer prompts): 254.1 tok/s = 2.07x plain (predicted 0.88x) while the log said 3.2x. The
    prediction's ratio is over the same runtime's plain speed in the same pass."""
    from spec_plugins.tune import Measured, TuneResult

    chosen = Measured("torch+ngram", "torch", "ngram", "auto", 254.1, predicted=320.0)
    plain = Measured("plain@torch", "torch", None, None, 122.75)
    runtimes = {"torch": {"plain_tokens_per_s": 100.0, "t1_ms": 1.0, "cost_relative": [1.0]}}
    res = TuneResult(chosen, plain, [chosen], runtimes, {"target": {}}, 1.0)
    text = render_yaml(res, "spec-plugins tune")
    assert "# chosen: torch+ngram, measured 254.1 tok/s = 2.07x plain (predicted 3.20x plain on torch)" in text
