"""The replay's callers, round 11: tune, ``scripts/gpu_prediction.py`` and ``scripts/suffix_sweep.py``
replay a recorded turn that ended on EOS before max_new_tokens with the limits it was decoded with
(they used its length, drafting fewer tokens in its last rounds than the engine did: priced against
a real engine decode here), and tune measures recycling and lookahead by a real run (they read
the target's logits, which the replay only stands in for)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import tiny_llama
from helpers import Built, stop_at_build
from test_bench import PROMPTS, WORDS, word_tokenizer
from test_bench_round11 import _engine_widths, _eos_decoder
from test_gpu_scripts import _script

import spec_plugins.tune as tune_module
from spec_plugins.tune import Budget, tune

MAX_NEW = 60
TURN = PROMPTS[0].turns[0]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> tuple[Path, str, list[int]]:
    """A saved tiny model whose greedy answer to ``TURN`` ends on its EOS word (first produced at
    position 13) well before ``MAX_NEW``: the directory, that word and the prompt's ids."""
    dec = _eos_decoder(3, "<eos>")
    ids = dec.encode([{"role": "user", "content": TURN}])
    out = dec.without_speculation().generate_batch([ids], max_new_tokens=MAX_NEW)[0].token_ids
    pos = next(i for i in range(13, len(out)) if out[i] not in out[:i])
    d = tmp_path_factory.mktemp("eos") / "tiny-model"
    tiny_llama(seed=10).save_pretrained(d)  # _eos_decoder's model
    tok = word_tokenizer()
    tok.eos_token = WORDS[out[pos]]
    tok.save_pretrained(d)
    return d, WORDS[out[pos]], ids


def _engine_seconds(eos_word: str, ids: list[int], k: int, cost, overhead: float = 0.0) -> tuple[list[int], float]:
    """A real n-gram (max_ngram 3) decode drafting ``k`` tokens a round: its tokens, and its prefill
    and every forward priced by ``cost`` plus ``overhead`` per round (the replay's clock)."""
    real, widths = _engine_widths(_eos_decoder(k, eos_word), ids, MAX_NEW)
    assert real[-1] == WORDS.index(eos_word) and len(real) < MAX_NEW  # the turn ended on EOS
    return real, cost(1, len(ids)) + sum(cost(1, n) + overhead for n in widths)


# ---- tune: the replay gets the limits the outputs were decoded with --------------------------------------
def test_tune_prices_a_turn_that_ended_on_eos_as_the_engine_decodes_it(eos_model, monkeypatch, tmp_path):
    """tune decodes plainly with max_new and the decoder's EOS ids; its n-gram replay must draft
    the last rounds with that room, so each fixed draft length is priced at the engine's forwards."""
    d, eos_word, ids = eos_model
    seen = []
    real_replay = tune_module._replay_counted

    def spy(*args, **kwargs):
        got = real_replay(*args, **kwargs)
        seen.append((args, kwargs, got[0]))
        return got

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tune_module, "_replay_counted", spy)
    tune(str(d), [TURN], ["torch"], ["ngram"], Budget(600), max_new=MAX_NEW, log=lambda m: None)
    [(args, kwargs, sim)] = seen
    cost, overhead = args[3], kwargs["overhead"]
    assert args[0] == [ids]
    for k in (3, 5, 8):
        real, seconds = _engine_seconds(eos_word, ids, k, cost, overhead)
        assert args[1] == [real]
        assert sim[str(k)] == pytest.approx(len(real) / seconds)


def test_tune_replay_prices_eos_turns_as_the_engine_did(eos_model):
    """``_replay_counted`` given the limits: every fixed draft length at the engine's forwards."""
    from spec_plugins.policy import ForwardCost
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.tune import _replay_counted

    _, eos_word, ids = eos_model
    dec = _eos_decoder(3, eos_word)
    cost = ForwardCost.from_curve([0.01 + 0.001 * i for i in range(40)])
    real, _ = _engine_seconds(eos_word, ids, 3, cost)
    sim, done = _replay_counted([ids], [real], lambda: NgramProposer(dec.config.proposer), cost, 1e-4, 32,
                                max_new=MAX_NEW, eos_ids=dec.eos_ids())
    assert done == 1
    for k in range(1, 9):
        _, seconds = _engine_seconds(eos_word, ids, k, cost, 1e-4)
        assert sim[str(k)] == pytest.approx(len(real) / seconds)


# ---- tune: recycling and lookahead are measured, not replayed -------------------------------------------
def _no_hidden_states(monkeypatch) -> None:
    """Every runtime tune builds returns no hidden states (llama.cpp's case)."""
    real = tune_module._decoder

    def build(model, rt, proposer, *args, **kwargs):
        dec = real(model, rt, proposer, *args, **kwargs)
        dec.target.capabilities = dataclasses.replace(dec.target.capabilities, hidden_states=False)
        return dec

    monkeypatch.setattr(tune_module, "_decoder", build)


@pytest.mark.parametrize("kind", ["recycling", "lookahead"])
def test_tune_measures_logit_drafters_by_a_real_run(kind, eos_model, monkeypatch, tmp_path):
    """They read the target's logits: a replay's point masses would draft other tokens (forward
    counts 29 vs 18 for recycling, 12 vs 18 for lookahead, measured), so tune runs them for real,
    and they need no hidden states, so a runtime without them still measures them."""
    from spec_plugins.bench import replay

    d, _, _ = eos_model
    replayed: list[str] = []
    real_turn = replay.replay_turn
    monkeypatch.setattr(replay, "replay_turn",
                        lambda p, o, prop, *a, **k: replayed.append(type(prop).__name__) or real_turn(p, o, prop, *a,
                                                                                                      **k))
    monkeypatch.setitem(tune_module.PROPOSERS, kind, {"type": kind})
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    _no_hidden_states(monkeypatch)
    logs: list[str] = []
    res = tune(str(d), [TURN], ["torch"], ["ngram", kind], Budget(600), max_new=16, log=logs.append)
    assert replayed and set(replayed) == {"NgramProposer"}  # n-gram replayed, the logit drafter never
    [m] = [m for m in res.measured if m.proposer == kind]
    assert m.label == f"torch+{kind}" and m.predicted > 0 and m.mean_accepted is not None  # a real run's
    assert any(line.startswith(f"[tune]   {kind} on torch: ") and line.endswith("tok/s measured briefly")
               for line in logs)
    assert not any("not measured" in n for n in res.notes)


# ---- the scripts: a bench report whose turn ended on EOS -------------------------------------------------
def _eos_report(tmp_path: Path, model: Path) -> tuple[Path, Path, dict]:
    """A CLI bench of ``model`` (plain and n-gram k2, max_new_tokens ``MAX_NEW``) on ``TURN``, with
    the drafter's measured cost set to zero (the engine reference prices no drafting): the report
    path, the prompts file and the report."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    cfg = tmp_path / "bench.yaml"
    cfg.write_text(f"target: {{backend: torch, model: {model}}}\nproposer: {{type: ngram, num_draft_tokens: auto}}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": "x", "category": "c", "turns": [TURN]}) + "\n")
    res = CliRunner().invoke(app, ["bench", "--config", str(cfg), "--prompts", str(prompts), "-n", str(MAX_NEW),
                                   "--gammas", "2", "--no-auto", "--baselines", "plain", "--no-progress", "--out",
                                   str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    path = tmp_path / "out" / "report.json"
    report = json.loads(path.read_text())
    report["cost_model"].update(draft_round_seconds=0.0, draft_step_seconds=0.0)
    path.write_text(json.dumps(report))
    return path, prompts, report


def _steep_curves(tmp_path: Path) -> Path:
    """Stored H200 curves (``../shared/gpu``'s format) whose cost rises steeply with width."""
    shared = tmp_path / "curves"
    shared.mkdir()
    rel = {"1": 1.0, "2": 1.5, "16": 6.0, "128": 40.0}
    (shared / "h200-verify-curve.jsonl").write_text(json.dumps(
        {"shape": "smollm2", "dtype": "bfloat16", "ctx": 512, "t1_ms": 9.0, "rel": rel}) + "\n")
    (shared / "h200-cuda-graphs.jsonl").write_text(json.dumps(
        {"shape": "smollm2", "dtype": "bfloat16", "ctx": 512, "graph_static": {"1": 2.5, "2": 2.8}}) + "\n")
    return shared


def test_gpu_prediction_prices_a_turn_that_ended_on_eos_as_the_engine_decodes_it(eos_model, monkeypatch, tmp_path):
    from spec_plugins.policy import ForwardCost

    gpu_prediction = _script("gpu_prediction")
    d, eos_word, ids = eos_model
    report, prompts, _ = _eos_report(tmp_path, d)
    shared, out = _steep_curves(tmp_path), tmp_path / "prediction.json"
    monkeypatch.setattr(sys, "argv", ["gpu_prediction.py", "--report", str(report), "--prompts", str(prompts),
                                      "--curves", str(shared), "--overhead-ms", "0", "--shapes", "smollm2",
                                      "--out", str(out)])
    assert gpu_prediction.main() == 0
    got = json.loads(out.read_text())["shapes"]["smollm2"]
    for name, secs in gpu_prediction.curves(shared, "smollm2").items():
        cost = ForwardCost.from_curve(secs)
        for k in (2, 4, 8):
            real, seconds = _engine_seconds(eos_word, ids, k, cost)
            assert got[name][f"ngram-k{k}"]["all"] == pytest.approx(len(real) / seconds), (name, k)


def test_gpu_prediction_refuses_a_sampling_report(eos_model, monkeypatch, tmp_path):
    gpu_prediction = _script("gpu_prediction")
    report, prompts, rep = _eos_report(tmp_path, eos_model[0])
    rep["meta"]["greedy"] = False
    report.write_text(json.dumps(rep))
    monkeypatch.setattr(sys, "argv", ["gpu_prediction.py", "--report", str(report), "--prompts", str(prompts),
                                      "--curves", str(_steep_curves(tmp_path))])
    with pytest.raises(ValueError, match=r"meta.greedy is False \(a sampling run\)"):
        gpu_prediction.main()


def _suffix_engine(model: Path, eos_word: str, section: dict):
    """A real decoder of the suffix ``section`` on ``_eos_decoder``'s model and EOS word."""
    from spec_plugins.backends.torch_runtime import TorchRuntime

    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder

    tok = word_tokenizer()
    tok.eos_token = eos_word
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": str(model)}, "proposer": section})
    return SpeculativeDecoder.from_config(cfg, target=TorchRuntime(tiny_llama(seed=10), tok))


def test_suffix_sweep_prices_a_turn_that_ended_on_eos_as_the_engine_decodes_it(eos_model, monkeypatch, tmp_path):
    """Settings with a fixed tree (the engine sizes an ``auto`` tree by its own measured costs, the
    replay by the report's) whose last rounds draft more than the turn's length left."""
    from spec_plugins.bench.replay import round_overhead
    from spec_plugins.policy import ForwardCost

    suffix_sweep = _script("suffix_sweep")
    d, eos_word, ids = eos_model
    report, prompts, rep = _eos_report(tmp_path, d)
    variants = {"nodes-8-factor-4": {"tree_nodes": 8, "max_spec_factor": 4.0},
                "nodes-4-factor-4": {"tree_nodes": 4, "max_spec_factor": 4.0}}
    monkeypatch.setattr(suffix_sweep, "VARIANTS", variants)
    suffix_sweep.main(["--report", str(report), "--prompts", str(prompts), "--out", str(tmp_path / "s.json")])
    got = json.loads((tmp_path / "s.json").read_text())["results"]
    cm = rep["cost_model"]
    cost, over = ForwardCost.from_curve(cm.get("raw_target_seconds") or cm["target_seconds"]), round_overhead(rep)
    for name, change in variants.items():
        real, widths = _engine_widths(_suffix_engine(d, eos_word, {**suffix_sweep.BASE, **change}), ids, MAX_NEW)
        assert real[-1] == WORDS.index(eos_word) and len(real) < MAX_NEW
        seconds = cost(1, len(ids)) + sum(cost(1, n) + over for n in widths)
        assert got[name]["all"]["tokens_per_s"] == pytest.approx(len(real) / seconds), name


@pytest.mark.parametrize(("change", "named"), [
    ("greedy", r"meta.greedy is False \(a sampling run\)"),
    ("recycling", r"proposer 'recycling': the replay reproduces only proposers whose drafts read the sequence"),
])
def test_suffix_sweep_refuses_a_run_it_cannot_replay(change, named, eos_model, capsys, tmp_path):
    suffix_sweep = _script("suffix_sweep")
    report, prompts, rep = _eos_report(tmp_path, eos_model[0])
    if change == "greedy":
        rep["meta"]["greedy"] = False
        report.write_text(json.dumps(rep))
    else:  # the report's config, its ngram-auto row's proposer
        Path(rep["meta"]["config"]).write_text(f"target: {{backend: torch, model: {eos_model[0]}}}\n"
                                               "proposer: {type: recycling}\n")
    with pytest.raises(SystemExit) as exc:
        suffix_sweep.main(["--report", str(report), "--prompts", str(prompts)])
    err = capsys.readouterr()
    assert exc.value.code == 2 and f"--report {report}" in err.err and "setting" not in err.out
    assert re.search(named, err.err), err.err


def test_suffix_sweep_reads_a_report_of_the_bench_default_config(eos_model, monkeypatch, tmp_path):
    """A bench run without --config records meta.config "built-in default": the sweep replays it
    with the default config (as replay and gpu_prediction do), not as a file of that name."""
    from spec_plugins.bench.cli import DEFAULT_CONFIG
    from spec_plugins.config import default_config
    from spec_plugins.decoder import SpeculativeDecoder

    suffix_sweep = _script("suffix_sweep")
    report, prompts, rep = _eos_report(tmp_path, eos_model[0])
    rep["meta"]["config"] = DEFAULT_CONFIG
    report.write_text(json.dumps(rep))
    seen = stop_at_build(monkeypatch, SpeculativeDecoder, "from_config", static=True)
    with pytest.raises(Built):
        suffix_sweep.main(["--report", str(report), "--prompts", str(prompts)])
    assert seen == [default_config()]
