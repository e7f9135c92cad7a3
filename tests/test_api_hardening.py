"""The Python API under misuse and failure: generations interleaved on one decoder refuse clearly
instead of decoding on each other's cache, per-row sampling seeds hold, a failed row says why,
stop strings and token ids are taken as given or refused by name."""

from __future__ import annotations

import pytest
import torch
from grammar_helpers import EOS, VOCAB, tiny_tokenizer
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.grammar import GrammarSpec, ll_tokenizer
from spec_plugins.grammar.spec import GrammarError, from_response_format
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

TAKEN = "another generation on this decoder started before this one finished"
P1, P2 = [5, 17, 300, 42, 9, 77], [400, 401, 402, 3, 3, 3, 3, 3, 3, 250, 11]


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


# ---- one generation at a time per decoder ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "ngram", "draft"])
def test_interleaved_streams_refuse_the_first_at_its_next_step(kind):
    """A second stream on the same decoder takes its runtime (and row-aware proposer) over: the
    first refuses at its next step, naming why, where it decoded on the other's cache before."""
    model = tiny_llama(vocab=512, seed=7, sharpness=6.0)
    rt = TorchRuntime(model)
    prop = {"plain": None, "ngram": NgramProposer(NgramProposer.Config(num_draft_tokens=3)),
            "draft": DraftModelProposer(None, target=rt, runtime=TorchRuntime(tiny_llama(vocab=512, seed=8)))}[kind]
    dec = SpeculativeDecoder(rt, prop, ExactVerifier())
    s1, s2 = dec.stream(P1, 12), dec.stream(P2, 12)
    first = next(s1).token_ids
    got2 = next(s2).token_ids
    with pytest.raises(RuntimeError, match=TAKEN):
        next(s1)
    assert first == plain_greedy(model, P1, 1)
    got2 += _tokens(s2)  # the later stream owns the runtime: it completes, as it would alone
    assert got2 == plain_greedy(model, P2, 12) == dec.generate(P2, 12).token_ids


def test_a_stream_resumed_after_another_generate_refuses():
    model = tiny_llama(vocab=512, seed=7, sharpness=6.0)
    dec = SpeculativeDecoder(TorchRuntime(model), NgramProposer(NgramProposer.Config(num_draft_tokens=3)))
    s1 = dec.stream(P1, 12)
    next(s1)
    assert dec.generate(P2, 12).token_ids == plain_greedy(model, P2, 12)
    with pytest.raises(RuntimeError, match=TAKEN):
        next(s1)


def test_sequential_streams_each_equal_their_own_generate():
    model = tiny_llama(vocab=512, seed=7, sharpness=6.0)
    dec = SpeculativeDecoder(TorchRuntime(model), NgramProposer(NgramProposer.Config(num_draft_tokens=3)))
    for p in (P1, P2, P1):
        s = dec.stream(p, 12)
        got = _tokens([next(s)])  # a stream drained in steps, then another started after it
        got += _tokens(s)
        assert got == plain_greedy(model, p, 12) == dec.generate(p, 12).token_ids


def test_a_batch_whose_row_aware_proposer_was_taken_over_refuses():
    """Two targets sharing one draft-model proposer: its draft runtime's cache follows the batch
    built last, so the first refuses its next round (and admission)."""
    model = tiny_llama(seed=3)
    rt_a, rt_b = TorchRuntime(model), TorchRuntime(model)
    prop = DraftModelProposer(None, target=rt_a, runtime=TorchRuntime(tiny_llama(seed=4)))
    policy = DraftPolicy.of(FixedLength(2))
    a = Batch(rt_a, prop, ExactVerifier())
    a.add([RowRequest(0, [1, 2, 3], 8)])
    assert run_round(a, policy) is not None
    b = Batch(rt_b, prop, ExactVerifier())
    b.add([RowRequest(0, [4, 5], 8)])
    with pytest.raises(RuntimeError, match=TAKEN):
        run_round(a, policy)
    with pytest.raises(RuntimeError, match=TAKEN):
        a.add([RowRequest(1, [6, 7], 4)])
    a.close()  # leaves the new owner's rows alone
    assert len(rt_b.lengths()) == 1 and run_round(b, policy) is not None


# ---- per-row sampling seeds ---------------------------------------------------------------------------
SEED_PROMPTS = [[3, 9, 4, 1, 5], [2, 6, 5, 3], [7, 1, 8, 2, 8, 1], [3, 9, 4, 1, 5]]


@pytest.mark.parametrize("as_dict", [False, True])
def test_generate_batch_rows_follow_their_sampling_seed(as_dict):
    """Row i of ``generate_batch(sampling=[...])`` samples as ``generate(seed=sampling[i].seed)``
    alone (its seed was ignored: the rows shared the config's generator)."""
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, sharpness=1.0)))
    seeds = [1, 2, 3, 4]
    sampling = [dict(temperature=1.0, seed=s) if as_dict else SamplingConfig(temperature=1.0, seed=s) for s in seeds]
    got = [r.token_ids for r in dec.generate_batch(SEED_PROMPTS, 12, sampling=sampling)]
    want = [dec.generate(p, 12, temperature=1.0, seed=s).token_ids for p, s in zip(SEED_PROMPTS, seeds)]
    assert got == want
    assert got[0] != got[3]  # same prompt, different seeds


def test_generate_batch_seeds_win_over_the_sampling_seed():
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, sharpness=1.0)))
    sampling = [SamplingConfig(temperature=1.0, seed=1)] * 2
    got = [r.token_ids for r in dec.generate_batch(SEED_PROMPTS[:2], 12, sampling=sampling, seeds=[5, 6])]
    assert got == [dec.generate(p, 12, temperature=1.0, seed=s).token_ids for p, s in zip(SEED_PROMPTS, [5, 6])]


@pytest.mark.parametrize("as_dict", [False, True])
def test_generate_batch_rows_without_a_sampling_seed_share_the_call_s_generator(as_dict):
    """A sampling entry that sets no seed leaves its row on the generator the rows share, seeded by
    the call's ``seed`` (SamplingConfig's default seed 0 gave every such row a generator of its
    own seeded 0: identical samples, whatever ``seed`` said); as ``temperature=`` for every row."""
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(vocab=512, seed=7, sharpness=1.0)))
    prompt, hot = [5, 17, 300, 42, 9, 77], (dict(temperature=1.0) if as_dict else SamplingConfig(temperature=1.0))
    rows = [r.token_ids for r in dec.generate_batch([prompt] * 4, 12, sampling=[hot] * 4, seed=123)]
    assert rows == [r.token_ids for r in dec.generate_batch([prompt] * 4, 12, temperature=1.0, seed=123)]
    assert len({tuple(r) for r in rows}) > 1
    other = [r.token_ids for r in dec.generate_batch([prompt] * 4, 12, sampling=[hot] * 4, seed=999)]
    assert other != rows


# ---- why a row failed -----------------------------------------------------------------------------
def _text_decoder(proposer=True):
    prop = NgramProposer(NgramProposer.Config(num_draft_tokens=5)) if proposer else None
    return SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, sharpness=2.0)), prop, tokenizer=tiny_tokenizer())


def _boom(ids, logits):
    raise RuntimeError("my processor is broken")


NO_WAY_ON = "no token of this model's vocabulary can continue the grammar"


@pytest.mark.parametrize("case", ["processor", "grammar"])
def test_a_failed_row_says_why(case):
    dec = _text_decoder()
    kw, cause = ((dict(processors=[_boom]), "my processor is broken") if case == "processor"
                 else (dict(grammar=GrammarSpec.regex("abz")), NO_WAY_ON))  # "z": no token spells it
    r = dec.generate("abcxy12abc", 10, **kw)
    assert r.finish_reason == "error" and cause in r.error and r.to_dict()["error"] == r.error
    last = list(dec.stream("abcxy12abc", 10, **kw))[-1]
    assert last.finish_reason == "error" and cause in last.error
    rows = dec.generate_batch(["abcxy12abc", "ab"], 10, **kw)
    assert all(x.finish_reason == "error" and cause in x.error for x in rows)
    ok = dec.generate("abcxy12abc", 10)
    assert ok.finish_reason == "length" and ok.error is None and ok.to_dict()["error"] is None


def test_generate_batch_error_is_per_row():
    dec = _text_decoder()
    bad, free = dec.generate_batch(["abcxy12abc", "abcxy12abc"], 10, grammar=[GrammarSpec.regex("abz"), None])
    assert bad.finish_reason == "error" and NO_WAY_ON in bad.error
    assert free.error is None and free.finish_reason == "length"


def test_cli_prints_why_the_generation_failed(monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    monkeypatch.setattr(SpeculativeDecoder, "from_config", lambda cfg: _text_decoder())
    res = CliRunner().invoke(app, ["generate", "--prompt", "abcxy12abc", "-n", "10", "--regex", "abz", "--json"])
    assert res.exit_code == 1, res.output  # the failure reaches a script; 2 is a usage error
    assert "error: the generation failed: the output left its grammar" in res.output and NO_WAY_ON in res.output
    assert '"finish_reason": "error"' in res.output and '"error": "the output left its grammar' in res.output


# ---- stop strings -------------------------------------------------------------------------------------
def test_a_stop_string_given_alone_is_one_stop():
    """``stop="3,"`` stops at "3," (it was split into the stops "3" and ",")."""
    dec = _text_decoder()
    full = dec.generate("abcxy12abc", 20).text
    want = full[: full.index("3,")]
    assert len(want) > 1
    r = dec.generate("abcxy12abc", 20, stop="3,")
    assert (r.text, r.finish_reason) == (want, "stop_sequence")
    assert r.token_ids == dec.generate("abcxy12abc", 20, stop=["3,"]).token_ids
    assert "".join(e.text for e in dec.stream("abcxy12abc", 20, stop="3,")) == want
    assert [x.text for x in dec.generate_batch(["abcxy12abc"], 20, stop="3,")] == [want]
    assert dec.generate("abcxy12abc", 20, stop=None).text == full


@pytest.mark.parametrize("stop", [[5], ["ab", None], 5])
def test_stop_entries_that_are_not_strings_are_refused(stop):
    dec = _text_decoder()
    with pytest.raises(TypeError, match="stop"):
        dec.generate("abc", 5, stop=stop)
    with pytest.raises(TypeError, match="stop"):
        dec.generate_batch(["abc"], 5, stop=stop)


# ---- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", [[99999], [1, 2, 32], [-1]])
def test_prompt_ids_outside_the_vocabulary_are_refused_by_id(ids):
    dec = _text_decoder()
    bad = next(t for t in ids if not 0 <= t < VOCAB)
    with pytest.raises(ValueError, match=rf"token id {bad} .*outside the model's vocabulary \(0\.\.31\)"):
        dec.generate(ids, 5)
    with pytest.raises(ValueError, match=rf"token id {bad}"):
        dec.generate_batch([[1, 2], ids], 5)


@pytest.mark.parametrize("ids, what", [([1.7, 2.2], "float"), ([1, True], "bool"), (["1", "2"], "str"),
                                       ([1, 2.0], "float")])
def test_prompt_ids_that_are_not_integers_are_refused(ids, what):
    with pytest.raises(TypeError, match=f"integers.*{what}"):
        _text_decoder().generate(ids, 5)


def test_integer_ids_of_numpy_and_torch_are_taken():
    import numpy as np

    dec = _text_decoder(proposer=False)
    want = dec.generate([4, 5, 8], 5).token_ids
    assert dec.generate(torch.tensor([4, 5, 8]), 5).token_ids == want
    assert dec.generate(np.array([4, 5, 8]), 5).token_ids == want


def test_response_format_must_be_a_mapping():
    with pytest.raises(GrammarError, match=r'`response_format` must be an object.*str.*\{"type": "json_object"\}'):
        from_response_format("json_object")
    with pytest.raises(GrammarError, match="got list"):
        _text_decoder().generate("abc", 5, response_format=["json_object"])
    assert from_response_format({"type": "json_object"}) == GrammarSpec("json_object")


@pytest.mark.parametrize("seeds, msg", [([2 ** 70], r"seeds\[0\].*less than or equal"),
                                        ([1, -1], r"seeds\[1\].*greater than or equal")])
def test_generate_batch_checks_seeds_as_a_config_checks_a_seed(seeds, msg):
    dec = _text_decoder()
    with pytest.raises(ValueError, match=msg):
        dec.generate_batch([[4, 5]] * len(seeds), 5, seeds=seeds, temperature=1.0)


def test_generate_batch_sampling_entries_are_configs_or_their_fields():
    from pydantic import ValidationError

    dec = _text_decoder()
    with pytest.raises(TypeError, match=r"sampling\[0\] must be a SamplingConfig or a dict"):
        dec.generate_batch([[4, 5]], 5, sampling=[0.7])
    with pytest.raises(ValidationError, match="temprature"):
        dec.generate_batch([[4, 5]], 5, sampling=[{"temprature": 1.0}])


def test_generate_batch_refuses_one_string_prompt():
    """``generate_batch("abc")`` decoded the prompts "a", "b" and "c"."""
    with pytest.raises(TypeError, match=r"list of prompts.*generate\(\)"):
        _text_decoder().generate_batch("abc", 5)


# ---- stats and the grammar tokenizer ---------------------------------------------------------------
def test_rows_failing_at_prefill_count_no_new_tokens():
    dec = _text_decoder(proposer=False)
    rows = dec.generate_batch(["abc", "xy"], 5, processors=[_boom])
    assert [r.finish_reason for r in rows] == ["error", "error"]
    assert dec.last_stats.new_tokens == 0 == sum(len(r.token_ids) for r in rows)
    assert [r.stats.new_tokens for r in rows] == [0, 0]
    ok = dec.generate_batch(["abc", "xy"], 5)
    assert dec.last_stats.new_tokens == sum(len(r.token_ids) for r in ok) == 10
    assert [r.stats.new_tokens for r in ok] == [5, 5]


def test_a_tokenizer_wider_than_the_model_is_named():
    """A tokenizer with more tokens than the logits was refused as 'need a fast tokenizer'."""
    with pytest.raises(GrammarError, match="tokenizer has 36 tokens but the model's vocabulary .* has 32"):
        ll_tokenizer(tiny_tokenizer("egim"), VOCAB, [EOS])


def test_from_config_takes_a_path_object_as_a_file_path(tmp_path):
    """The docstring says "object, dict or file path": a ``pathlib.Path`` fell through to the
    config object branch (AttributeError 'PosixPath' has no 'target')."""
    import yaml

    tiny_llama(vocab=VOCAB, seed=2).save_pretrained(str(tmp_path / "m"))
    tiny_tokenizer().save_pretrained(str(tmp_path / "m"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(tmp_path / "m")},
                                    "proposer": {"type": "ngram"}}))
    dec = SpeculativeDecoder.from_config(path)
    assert dec.generate([3, 7, 1, 3, 7], max_new_tokens=6).token_ids == \
        SpeculativeDecoder.from_config(str(path)).generate([3, 7, 1, 3, 7], max_new_tokens=6).token_ids
    with pytest.raises(TypeError, match="config must be a SpecConfig, a dict or a file path, got int"):
        SpeculativeDecoder.from_config(3)


def test_chat_true_without_a_chat_template_is_refused():
    """``chat=True`` on a tokenizer without a template prompted the raw text silently (the same
    request as messages was refused); None and False still mean the raw text."""
    tok = tiny_tokenizer()
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(vocab=VOCAB, seed=2), tok), None, ExactVerifier(), tokenizer=tok)
    assert not dec.has_chat_template
    with pytest.raises(ValueError, match="chat=True, but the model's tokenizer has no chat template"):
        dec.generate("ab", max_new_tokens=2, chat=True)
    assert dec.encode("ab", chat=False) == dec.encode("ab") == tok("ab")["input_ids"]


@pytest.mark.parametrize("prompt", ["hello", [{"role": "user", "content": "hi"}]])
def test_a_text_prompt_without_a_tokenizer_is_refused_by_name(prompt):
    """With no tokenizer a str prompt was a bare ``TypeError: 'NoneType' object is not callable``
    and chat messages were said to lack a chat template."""
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=2)), None, ExactVerifier())
    assert dec.generate([3, 7, 1], max_new_tokens=3).token_ids == plain_greedy(dec.target.model, [3, 7, 1], 3)
    with pytest.raises(ValueError, match="needs a tokenizer .*pass token ids"):
        dec.generate(prompt, max_new_tokens=3)


def test_a_row_whose_processor_raises_while_a_draft_model_drafts_fails_alone():
    """The draft model runs the rows' processors over its own logits; one row's raising there left
    ``generate_batch`` with every row lost (an n-gram batch fails that row alone). The row now
    drafts nothing that round, the others draft as they would alone, and the batch fails the row
    when it processes its logits."""
    from spec_plugins.sampling import LogitsPipeline, RowPipelines
    from spec_plugins.types import ProposeContext

    def boom(seq, logits):
        raise RuntimeError("boom")

    prompts = [[3, 7, 1, 3, 7], [9, 9, 2, 5], [4, 1, 6]]
    greedy, failing = LogitsPipeline(SamplingConfig(temperature=0.0)), LogitsPipeline(SamplingConfig(temperature=0.0),
                                                                                     [boom])
    drafts = []
    for pipes in ([greedy, failing, greedy], [greedy] * 3):
        prop = DraftModelProposer(DraftModelProposer.Config(num_draft_tokens=3, model={"backend": "torch",
                                                                                        "model": "x"}),
                                  runtime=TorchRuntime(tiny_llama(seed=4)))
        prop.admit([p[:-1] for p in prompts])
        drafts.append(prop.propose(ProposeContext(prompts, [3, 3, 3], RowPipelines(pipes))))
    apart, alone = drafts
    assert apart.valid.tolist() == [[True] * 3, [False] * 3, [True] * 3]
    assert torch.equal(apart.tokens[[0, 2]], alone.tokens[[0, 2]])
