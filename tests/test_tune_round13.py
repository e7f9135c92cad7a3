"""``spec-plugins tune``: a suffix candidate was replayed with ``tree_nodes: 16`` but confirmed and
written with ``tree_nodes: auto``, which the decode cuts by cost each round (where drafting costs a
lot, to nothing), so the ranking and the YAML's "predicted" described a config that never ran: the
section replayed is now the one confirmed and written. tune measured its verify costs after a
fixed 128-token context, so a model of fewer than 145 positions failed every prompt with "context
128 + 17 positions exceeds the runtime's 32": it measures after as much context as fits, and a
model too short even for that is a TuneError naming the minimum."""

from __future__ import annotations

import pytest
import yaml

from conftest import tiny_llama
from spec_plugins.config import SpecConfig
from spec_plugins.tune import Budget, TuneError, tune
from spec_plugins.tune_yaml import render_yaml

PROMPTS = ["w1 w2 w3 w4 w1 w2 w3 w4 w1 w2", "w5 w6 w7 w5 w6 w7 w5", "w9 w8 w9 w8 w9 w8 w9"]


def _tiny(path, max_pos: int = 256):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w31").save_pretrained(str(path))
    tiny_llama(vocab=32, seed=4, sharpness=4.0, max_pos=max_pos).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("tune13") / "tiny-model")


def _steep_costs():
    """Frozen costs where every drafted position costs a whole forward: a tree cut by cost keeps
    nothing (no node beats no draft by the policy's margin), a fixed one is drafted whole."""
    from spec_plugins.policy import Costs, ForwardCost

    return Costs(ForwardCost.from_curve([1e-3 * n for n in range(1, 34)]), frozen=True)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_suffix_candidate_decodes_as_its_replay(tiny_dir, tmp_path, monkeypatch, k):
    """The decoder tune confirms for a suffix candidate of draft ``k`` takes the replay's rounds and
    accepts its tokens on the same prompts, whatever the runtime's costs."""
    from spec_plugins.bench.baselines import time_decoder
    from spec_plugins.bench.replay import fixed, replay_turn
    from spec_plugins.tune import PROPOSERS, _decoder
    from spec_plugins.tune_replay import replay_factory

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    base = _decoder(str(tiny_dir), "torch", None)
    costs = _steep_costs()
    real = _decoder(str(tiny_dir), "torch", "suffix", target=base.target, draft=k, costs=costs)
    for p in PROMPTS:
        ids = base.encode(p)
        out = time_decoder(base.without_speculation(), ids, 32).tokens
        run = time_decoder(real, ids, 32)
        assert run.tokens == out
        st = replay_turn(ids, out, replay_factory(PROPOSERS["suffix"])(), fixed(k)(), costs.forward.base, 0.0,
                         max_new=32, eos_ids=base.eos_ids(), vocab_size=base.target.vocab_size)
        assert st.accepted_tokens > 0  # the prompts repeat: the replay drafts and is accepted
        assert (run.stats.target_forwards, run.stats.accepted_tokens) == (st.target_forwards, st.accepted_tokens)


def test_tune_confirms_and_writes_the_suffix_section_it_replayed(tiny_dir, tmp_path, monkeypatch):
    """The replayed proposer's config, the confirmed decoder's and the YAML's proposer section are
    one (the draft length being the one the replay picked)."""
    import spec_plugins.tune as tune_module

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    replayed, confirmed = [], []
    real_factory, real_decoder = tune_module.replay_factory, tune_module._decoder

    def recording_factory(section):
        make = real_factory(section)

        def made():
            proposer = make()
            replayed.append(proposer.config.model_dump())
            return proposer
        return made

    def recording_decoder(*args, **kwargs):
        dec = real_decoder(*args, **kwargs)
        if dec.proposer is not None:
            confirmed.append(dec.proposer.config.model_dump())
        return dec

    monkeypatch.setattr(tune_module, "replay_factory", recording_factory)
    monkeypatch.setattr(tune_module, "_decoder", recording_decoder)
    # noise -1: the best confirmed candidate is written whatever plain measured
    res = tune(str(tiny_dir), PROMPTS, ["torch"], ["suffix"], Budget(600), max_new=16, confirm=1, noise=-1.0,
               log=lambda m: None)
    assert res.chosen.proposer == "suffix" and replayed and len(confirmed) == 1
    written = yaml.safe_load(render_yaml(res, "spec-plugins tune"))["proposer"]
    as_replayed = {**replayed[0], "num_draft_tokens": res.chosen.draft}
    assert SpecConfig.parse({**res.config, "proposer": written}).proposer.model_dump() == as_replayed
    assert confirmed[0] == as_replayed
    assert written["tree_nodes"] != "auto"


def test_a_replay_of_an_auto_tree_is_refused():
    from spec_plugins.tune_replay import replay_factory

    with pytest.raises(ValueError, match="cannot predict tree_nodes: auto"):
        replay_factory({"type": "suffix", "num_draft_tokens": 4, "tree_nodes": "auto"})


def test_a_short_context_model_is_measured_within_it(tmp_path, monkeypatch):
    """A model of 32 positions: the costs are measured after the context that fits beside the 17
    positions, and tune completes."""
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    d = _tiny(tmp_path / "short", max_pos=32)
    res = tune(str(d), ["w1 w2 w3 w1 w2 w3"], ["torch"], ["ngram"], Budget(600), max_new=8, log=lambda m: None)
    assert res.runtimes["torch"]["prompts"] == 1 and res.runtimes["torch"]["t1_ms"] > 0
    SpecConfig.parse(res.config)


def test_a_model_too_short_to_measure_is_a_tune_error_naming_the_minimum(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    d = _tiny(tmp_path / "shorter", max_pos=16)
    with pytest.raises(TuneError, match="tune .* needs a context of at least 18 positions; this runtime's holds 16"):
        tune(str(d), ["w1 w2 w3"], ["torch"], ["ngram"], Budget(600), max_new=4, log=lambda m: None)
