"""Lossy modes say so: a bench run under a lossy verifier records it (meta, stats, a warning in
summary.md), a compare config with another verifier is refused, plain decoding under a lossy
config is the target's own law (the exact verifier), and ``generate`` names a lossy verifier."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench.methods import check_compare_sampling
from spec_plugins.cli import app
from spec_plugins.config import SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from test_bench import word_tokenizer

TYPICAL = "verifier: {type: typical}\nsampling: {temperature: 1.0, seed: 0}\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lossy15") / "tiny"
    tiny_llama(seed=3).save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    return d


def _config(tmp_path, model_dir, verifier: str, name: str = "c.yaml"):
    cfg = tmp_path / name
    cfg.write_text(f"target: {{backend: torch, model: {model_dir}}}\nproposer: {{type: ngram, num_draft_tokens: 2}}\n"
                   + verifier)
    return cfg


def _bench(tmp_path, cfg, new_tokens: int):
    """``spec-plugins bench`` of one copy prompt under ``cfg``, plain and k=2; its output folder."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": "x", "category": "c", "turns": ["w1 w2 w1 w2 w1"]}\n')
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "--config", str(cfg), "--prompts", str(prompts), "-n", str(new_tokens),
                                   "--gammas", "2", "--no-auto", "--baselines", "", "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_bench_under_a_typical_verifier_says_lossy(tmp_path, tiny_dir):
    cfg = _config(tmp_path, tiny_dir, TYPICAL)
    out = _bench(tmp_path, cfg, 6)
    rep = json.loads((out / "report.json").read_text())
    assert rep["meta"]["verifier"]["type"] == "typical"
    lossy = {m["name"]: rep["summary"][m["name"]]["all"]["stats"]["lossy"] for m in rep["methods"]}
    assert lossy == {"plain": False, "ours_k2": True}  # plain decoding is exact under a lossy config
    assert rep["prompts"][0]["methods"]["ours_k2"]["stats"]["lossy"] is True
    md = (out / "summary.md").read_text()
    warning = next(line for line in md.splitlines() if "LOSSY" in line)
    assert "typical" in warning and "`ours_k2`" in warning and "`plain`" not in warning


def test_bench_summary_has_no_lossy_warning_under_the_exact_verifier(tmp_path, tiny_dir):
    cfg = _config(tmp_path, tiny_dir, "")
    out = _bench(tmp_path, cfg, 4)
    rep = json.loads((out / "report.json").read_text())
    assert rep["meta"]["verifier"]["type"] == "exact"
    assert not any(rep["summary"][m["name"]]["all"]["stats"]["lossy"] for m in rep["methods"])
    assert "LOSSY" not in (out / "summary.md").read_text()


def test_a_compare_config_with_another_verifier_is_refused_naming_both():
    base = {"target": {"backend": "torch", "model": "m"}, "proposer": {"type": "ngram", "num_draft_tokens": 2},
            "sampling": {"temperature": 1.0, "seed": 0}}
    exact = SpecConfig.parse(base)
    typical = SpecConfig.parse({**base, "verifier": {"type": "typical"}})
    with pytest.raises(ValueError, match=r"--compare-config x\.yaml: its verifier .*typical.* differs from the "
                                         r"primary config's .*exact"):
        check_compare_sampling(exact, typical, "--compare-config x.yaml")
    check_compare_sampling(typical, SpecConfig.parse({**base, "verifier": {"type": "typical"}}), "same")  # accepted


def _draws_as_exact(plain, reference, n: int) -> None:
    """``plain`` (built from a typical config) is exact and draws, seed for seed, what
    ``reference`` (the exact config's plain decoder) draws: the target's own law."""
    assert plain.proposer is None and not plain.verifier.lossy
    prompt = [3, 7, 1, 9]
    got = plain.generate_batch([prompt] * n, max_new_tokens=1, seeds=list(range(n)))
    want = reference.generate_batch([prompt] * n, max_new_tokens=1, seeds=list(range(n)))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert not got[0].stats.lossy


def test_plain_decoding_under_a_typical_config_is_the_targets_law():
    """Plain decoding of a typical config draws what plain decoding of the exact config draws, seed
    for seed (the exact verifier's keyed draws: the target's own law); the typical verifier would
    never draw the target's low-probability tokens."""
    rt = TorchRuntime(tiny_llama(vocab=32, seed=0, sharpness=4.0))
    cfg = {"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "ngram", "num_draft_tokens": 3},
           "sampling": {"temperature": 1.0, "seed": 0}}
    plain = SpeculativeDecoder.from_config({**cfg, "verifier": {"type": "typical"}}, target=rt).without_speculation()
    reference = SpeculativeDecoder.from_config({**cfg, "verifier": {"type": "exact"}}, target=rt).without_speculation()
    _draws_as_exact(plain, reference, 200)


@pytest.mark.parametrize("verifier, lossy", [(TYPICAL, True), ("sampling: {temperature: 1.0, seed: 0}\n", False)])
def test_generate_summary_names_a_lossy_verifier(tmp_path, tiny_dir, verifier, lossy):
    cfg = _config(tmp_path, tiny_dir, verifier)
    res = CliRunner().invoke(app, ["generate", "--config", str(cfg), "--prompt", "w1 w2 w1 w2", "--raw", "-n", "4"])
    assert res.exit_code == 0, res.output
    assert ("LOSSY verifier (typical)" in res.output) is lossy


def test_a_config_with_no_proposer_decodes_plain_under_the_exact_verifier():
    """``generate``/``serve --no-speculation`` build the decoder from the config with no proposer:
    nothing is drafted, so it samples the target's law whatever verifier the config names."""
    rt = TorchRuntime(tiny_llama(vocab=32, seed=0, sharpness=4.0))
    cfg = {"target": {"backend": "torch", "model": "x"}, "sampling": {"temperature": 1.0, "seed": 0}}
    plain = SpeculativeDecoder.from_config({**cfg, "verifier": {"type": "typical"}}, target=rt)
    reference = SpeculativeDecoder.from_config({**cfg, "verifier": {"type": "exact"}}, target=rt)
    _draws_as_exact(plain, reference, 100)


GREEDY_TYPICAL = "verifier: {type: typical}\nsampling: {temperature: 0.0}\n"


def test_greedy_under_a_typical_verifier_is_not_called_lossy(tmp_path, tiny_dir):
    """At temperature 0 every verifier matches the argmax: the output is exact, so neither the
    bench's summary nor ``generate``'s line warns, and a greedy compare config may name another
    verifier."""
    cfg = _config(tmp_path, tiny_dir, GREEDY_TYPICAL)
    out = _bench(tmp_path, cfg, 4)
    assert "LOSSY" not in (out / "summary.md").read_text()
    res = CliRunner().invoke(app, ["generate", "--config", str(cfg), "--prompt", "w1 w2 w1 w2", "--raw", "-n", "4"])
    assert res.exit_code == 0 and "LOSSY" not in res.output, res.output
    base = {"target": {"backend": "torch", "model": "m"}, "proposer": {"type": "ngram", "num_draft_tokens": 2}}
    check_compare_sampling(SpecConfig.parse(base), SpecConfig.parse({**base, "verifier": {"type": "typical"}}), "g")


def test_the_plugin_with_no_proposer_samples_the_targets_law_unwarned():
    """``spec_config`` with no proposer through the transformers plugin: plain sampling under the
    exact verifier (as ``from_config``), so a typical verifier named there neither truncates nor warns."""
    import warnings

    import torch

    from spec_plugins.integrations.transformers import speculative_generate

    model = tiny_llama(vocab=32, seed=0, sharpness=4.0)
    ids = torch.tensor([[3, 7, 1, 9]])
    outs = {}
    for verifier in ("typical", "exact"):
        got = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for seed in range(40):
                torch.manual_seed(seed)
                got.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=True,
                                          pad_token_id=0, custom_generate=speculative_generate,
                                          spec_config={"proposer": None, "verifier": {"type": verifier}}).tolist())
        assert not [w for w in seen if "lossy" in str(w.message)]
        outs[verifier] = got
    assert outs["typical"] == outs["exact"]
