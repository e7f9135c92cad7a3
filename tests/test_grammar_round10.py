"""Structured outputs, round 10: a ``GrammarLogitsProcessor`` reused across ``generate()`` calls
refuses the later call by name instead of leaving it unconstrained; a dead end inside a JSON
string (llguidance's mask lets on to a closing quote its parser refuses) ends the row naming the
documented cause."""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from grammar_helpers import EOS, REGEX, VOCAB, NaiveGrammar, scripted, tiny_tokenizer

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.grammar import GrammarError, GrammarSpec, RowGrammar, compile_grammar, ll_tokenizer
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

ONE_CALL = "serves one generate() call; build a new one per call"
NO_WAY_ON = "no token of this model's vocabulary can continue the grammar here"
DEAD_SCHEMA = {"type": "string", "pattern": "^abz$"}  # after `"ab` no token spells "z"
KW = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": EOS, "eos_token_id": EOS}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, sharpness=2.0)


def _processor(tok, **kw):
    from transformers import LogitsProcessorList

    from spec_plugins.grammar.hf import GrammarLogitsProcessor

    return LogitsProcessorList([GrammarLogitsProcessor(GrammarSpec.regex(REGEX), tok, VOCAB, [EOS], **kw)])


def _generate(model, tok, text, procs, **kw):
    ids = torch.tensor([tok.encode(text)])
    return model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=procs, **KW, **kw)


@pytest.mark.parametrize("first,second", [("abc", "abcxy12abc{"), ("abcxy12abc", "xy")])
def test_a_reused_processor_refuses_a_later_generate_call_by_name(model, tok, first, second):
    """The first call is held to the grammar, as a fresh processor holds it; a second call with a
    longer prompt that starts with the first (its tail read as a completion the grammar refuses)
    or a shorter one raises, naming the one-call rule, instead of constraining nothing."""
    procs = _processor(tok)
    assert torch.equal(_generate(model, tok, first, procs), _generate(model, tok, first, _processor(tok)))
    with pytest.raises(GrammarError, match=re.escape(ONE_CALL)):
        _generate(model, tok, second, procs)
    # a fresh processor serves that call, held to the grammar
    out = _generate(model, tok, second, _processor(tok))[0, len(tok.encode(second)):].tolist()
    assert re.fullmatch(REGEX, tok.decode([t for t in out if t != EOS])), out


def test_a_reused_processor_under_speculative_generate_fails_naming_the_rule(model, tok):
    from spec_plugins.integrations.transformers import speculative_generate

    procs = _processor(tok)
    _generate(model, tok, "abc", procs, custom_generate=speculative_generate)
    with pytest.raises(RuntimeError, match=re.escape(ONE_CALL)):
        _generate(model, tok, "abcxy12abc{", procs, custom_generate=speculative_generate)


def test_a_completion_after_an_explicit_prompt_len_is_held_to_the_grammar(model, tok):
    """``prompt_len`` before a prefilled start ("ab"): plain and speculative ``generate()`` equal
    the independent processor started there; a prefilled start the grammar refuses ("12ab": the
    regex starts with a letter) is an error, not an unconstrained row."""
    from transformers import LogitsProcessorList

    from spec_plugins.integrations.transformers import speculative_generate

    start = len(tok.encode("abcxy12abc"))
    lltok = ll_tokenizer(tok, VOCAB, [EOS])
    naive = NaiveGrammar(lltok, compile_grammar(GrammarSpec.regex(REGEX), lltok).grammar, start)
    want = _generate(model, tok, "abcxy12abcab", LogitsProcessorList([naive]))
    assert torch.equal(_generate(model, tok, "abcxy12abcab", _processor(tok, prompt_len=start)), want)
    assert torch.equal(_generate(model, tok, "abcxy12abcab", _processor(tok, prompt_len=start),
                                 custom_generate=speculative_generate), want)
    with pytest.raises(GrammarError, match="does not allow"):
        _generate(model, tok, "abcxy12abc12ab", _processor(tok, prompt_len=start))


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema(DEAD_SCHEMA), GrammarSpec.regex('"abz"')])
def test_a_dead_end_inside_a_string_names_the_documented_cause(tok, spec):
    """After `"ab` llguidance's mask allows `"`, which its parser refuses: no token can go on, and
    ``advance`` says so (the documented cause), keeping the tokens before it."""
    g = RowGrammar(compile_grammar(spec, ll_tokenizer(tok, VOCAB, [EOS])), [EOS], VOCAB)
    quote, ab = tok.convert_tokens_to_ids('"'), tok.convert_tokens_to_ids("ab")
    assert g.advance([quote, ab, quote]) == 2
    assert NO_WAY_ON in g.error, g.error
    # a token refused where other tokens go on keeps llguidance's own message
    other = RowGrammar(compile_grammar(GrammarSpec.regex(REGEX), ll_tokenizer(tok, VOCAB, [EOS])), [EOS], VOCAB)
    assert other.advance([ab, quote]) == 1 and NO_WAY_ON not in other.error and other.error


@pytest.mark.parametrize("kind", [None, "chain", "tree"])
def test_a_row_at_a_dead_end_inside_a_string_ends_with_error_naming_the_cause(model, tok, kind):
    rt = TorchRuntime(model, matmul="native")
    proposer = None if kind is None else scripted([2, 21, 2], tree=kind == "tree")  # `"`, "ab", `"`
    g = RowGrammar(compile_grammar(GrammarSpec.json_schema(DEAD_SCHEMA), ll_tokenizer(tok, VOCAB, [EOS])),
                   [EOS], VOCAB)
    out, reason = [], None
    for step in decode(rt, proposer, ExactVerifier(), LogitsPipeline(SamplingConfig()), [tok.encode("abc")], 10,
                       [EOS], draft_length=FixedLength(3) if proposer is not None else None, grammars=[g]):
        out += step.emitted.get(0, [])
        reason = step.finished.get(0, reason)
    assert reason == "error" and tok.decode(out) == '"ab', (out, reason)
    assert NO_WAY_ON in g.error, g.error


def test_the_chat_route_at_a_dead_end_inside_a_string_is_a_500_naming_the_cause():
    from test_server import LiveServer

    from spec_plugins.proposers.ngram import NgramProposer

    chat = tiny_tokenizer()
    chat.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    srv = LiveServer(tiny_llama(vocab=len(chat), seed=3, sharpness=2.0), chat, policy="fixed",
                     proposer=NgramProposer(NgramProposer.Config(num_draft_tokens=4)))
    try:
        body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 10, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": DEAD_SCHEMA}}}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 500 and NO_WAY_ON in r.json()["error"]["message"], (r.status_code, r.text)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()
