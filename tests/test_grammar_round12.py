"""Structured outputs, round 12: a grammar past llguidance's lexer limits is refused at compile time
(a 422 on the routes), not failed on its first token blaming the vocabulary; a row that meets such
a limit later names it, and the other rows of its grammar go on; rows stay exact on any thread."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from grammar_helpers import ENDLESS, EOS, REGEX, VOCAB, A, C, X, tiny_tokenizer

from conftest import tiny_llama
from spec_plugins.grammar import GrammarError, GrammarLimits, GrammarSpec, RowGrammar, compile_grammar, ll_tokenizer

TOO_COMPLEX = "the grammar is too complex for llguidance's limits"
LEXER_LIMIT = "too many expressions constructed"
NO_WAY_ON = "no token of this model's vocabulary can continue the grammar here"
HEAVY = ["((ab){1000}){1000}", "((ab){800}){800}", "(((ab){100}){100}){100}"]  # near the compile-time limit
ROOMY = GrammarLimits(max_compile_ms=120_000)  # the lexer limit under test, not the clock on a busy machine
LBRACE = 1  # "{": not in REGEX
# a schema whose heavy pattern llguidance's lazy lexer meets only inside the string, after `{"a":"`
LATE = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^((ab){1000}){1000}$"}},
        "required": ["a"]}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def lltok(tok):
    return ll_tokenizer(tok, VOCAB, [EOS])


def _bits(mask: np.ndarray) -> set[int]:
    """The token ids a [words] int32 bitmask allows."""
    return {int(t) for t in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))}


def _fresh_mask(compiled, tokens) -> np.ndarray:
    """The reference: a brand-new llguidance matcher (nothing shared with the compiled grammar)
    fed ``tokens``, its mask after them."""
    import llguidance

    m = llguidance.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
    assert m.consume_tokens(list(tokens)), m.get_error()
    return np.frombuffer(m.compute_bitmask(), np.int32)[: (VOCAB + 31) // 32]


@pytest.mark.parametrize("pattern", HEAVY)
def test_a_regex_past_llguidances_lexer_limit_is_refused_at_compile_time(lltok, pattern):
    """Its first mask allows ``ab``, which llguidance's lexer then cannot consume: compile_grammar
    refuses it, naming the limit, instead of passing a grammar every row fails on at once."""
    with pytest.raises(GrammarError, match=re.escape(TOO_COMPLEX)) as err:
        compile_grammar(GrammarSpec.regex(pattern), lltok, ROOMY)
    assert LEXER_LIMIT in str(err.value) and "vocabulary" not in str(err.value)


@pytest.mark.parametrize("spec,first", [
    (GrammarSpec.regex("a{0}"), [EOS]),  # the empty output only: end of sequence alone at the start
    (GrammarSpec.regex("(ab)?"), [EOS]),  # may stop at once
    (GrammarSpec.regex("x*"), [X, X, EOS]),
    (GrammarSpec("lark", ENDLESS), [X, A, A]),
    (GrammarSpec("lark", 'start: "a" start'), [A, A, A]),  # forced text without end: not refused
    (GrammarSpec.json_schema({"type": "string", "pattern": "^abz$"}), []),  # a dead end found later
])
def test_grammars_that_may_stop_at_once_or_end_later_still_compile(lltok, spec, first):
    """The first-token check refuses a limit only: a grammar whose start allows end of sequence
    alone, or that may stop at once, or whose trouble lies further on, compiles, and a row takes
    the tokens a fresh matcher takes."""
    compiled = compile_grammar(spec, lltok)
    row = RowGrammar(compiled, [EOS], VOCAB)
    assert _bits(row.mask()) == _bits(_fresh_mask(compiled, []))
    assert row.advance(first) == len(first), row.error


def test_a_row_that_meets_a_lexer_limit_later_names_the_limit_not_the_vocabulary(tok, lltok):
    """``LATE`` compiles (its start is light); inside the string the mask allows ``ab``, which
    llguidance's lexer cannot consume (a fresh matcher refuses it too): the row's error names the
    complexity limit, not a token its vocabulary lacks."""
    import llguidance

    compiled = compile_grammar(GrammarSpec.json_schema(LATE), lltok, ROOMY)
    prefix, ab = tok.encode('{"a":"'), tok.convert_tokens_to_ids("ab")
    row = RowGrammar(compiled, [EOS], VOCAB)
    assert row.advance(prefix) == len(prefix)
    assert ab in _bits(row.masks([ab], [-1])[0])
    assert row.advance([ab]) == 0
    assert TOO_COMPLEX in row.error and LEXER_LIMIT in row.error, row.error
    assert NO_WAY_ON not in row.error, row.error
    ref = llguidance.LLMatcher(lltok, compiled.grammar, log_level=0)  # the reference: llguidance alone
    assert ref.consume_tokens(prefix)
    ref.deep_copy().compute_bitmask()
    assert not ref.consume_token(ab) and LEXER_LIMIT in ref.get_error()


def test_only_llguidances_limits_read_as_too_complex(tok, lltok):
    """llguidance tags a plain parse refusal with the same stop as its parser's limit; the error
    text tells them apart: its item limit (forced text without end, consumed at a state whose mask
    it computed) reads as too complex, a quote its parser refuses after `"ab` under ``^abz$`` does
    not."""
    import llguidance

    from spec_plugins.grammar.spec import too_complex

    endless = llguidance.LLMatcher(lltok, GrammarSpec("lark", ENDLESS).text(), log_level=0)
    assert endless.consume_tokens([X, A]) and not too_complex(endless)
    endless.compute_bitmask()
    assert not endless.consume_token(A) and too_complex(endless), endless.get_error()
    dead = llguidance.LLMatcher(lltok, GrammarSpec.regex('"abz"').text(), log_level=0)
    quote, ab = tok.convert_tokens_to_ids('"'), tok.convert_tokens_to_ids("ab")
    assert dead.consume_tokens([quote, ab]) and not dead.consume_token(quote)
    assert dead.is_error() and not too_complex(dead), dead.get_error()


def test_a_row_that_meets_a_limit_leaves_the_other_rows_of_its_grammar_going(tok, lltok):
    """The rows of one compiled grammar (a request's ``n`` choices, a batch's shared spec) each
    build their own matcher: copies of one would share its lexer and its limit error, so one
    row's heavy path would fail a sibling on a light one (the shared matcher did)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^((ab){1000}){1000}$"},
                                                "b": {"type": "integer"}}, "additionalProperties": False}
    compiled = compile_grammar(GrammarSpec.json_schema(schema), lltok, ROOMY)
    light = tok.encode('{"b":123}')
    heavy = tok.encode('{"a":"') + [tok.convert_tokens_to_ids("ab")]

    def rounds(row, tokens):
        for i, t in enumerate(tokens):  # one-token rounds: the round's masks, then the commit
            row.masks([t], [-1])
            if row.advance([t]) != 1:
                return f"token {i}: {row.error}"
        return "ok"

    before = RowGrammar(compiled, [EOS], VOCAB)
    assert TOO_COMPLEX in rounds(RowGrammar(compiled, [EOS], VOCAB), heavy)
    assert rounds(before, light) == "ok"
    assert rounds(RowGrammar(compiled, [EOS], VOCAB), light) == "ok"


def test_rows_sharing_a_compiled_grammar_on_threads_equal_fresh_matchers(tok, lltok):
    """Rows of one compiled grammar, each on its own thread along its own path: every mask (the
    committed state's, and a drafted node's) equals a brand-new matcher's after the same tokens,
    and the compiled grammar's start is never moved."""
    compiled = compile_grammar(GrammarSpec.regex(REGEX), lltok)
    ab, xy, twelve = (tok.convert_tokens_to_ids(t) for t in ("ab", "xy", "12"))
    paths = [[ab, C, ab], [xy, xy, C], [C, ab, xy], [ab, ab, twelve]] * 2

    def walk(path):
        row, out = RowGrammar(compiled, [EOS], VOCAB), []
        for t in path:
            assert row.advance([t]) == 1, row.error
            out.append(row.masks([ab], [-1]))
        return out

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(walk, paths))
    for path, masks in zip(paths, results):
        for i, m in enumerate(masks):
            done = path[: i + 1]
            assert _bits(m[0]) == _bits(_fresh_mask(compiled, done))
            if ab in _bits(m[0]):
                assert _bits(m[1]) == _bits(_fresh_mask(compiled, done + [ab]))
    assert _bits(RowGrammar(compiled, [EOS], VOCAB).mask()) == _bits(_fresh_mask(compiled, []))


@pytest.fixture(scope="module")
def live(tok):
    from test_server import LiveServer

    srv = LiveServer(tiny_llama(vocab=len(tok), seed=3, sharpness=2.0), tok, policy="fixed")
    yield srv
    srv.stop()


def test_the_routes_refuse_a_regex_past_the_lexer_limit_with_a_422(live, monkeypatch):
    """As documented: refused before any row starts, with a 422 naming the limit; the server goes
    on serving."""
    from spec_plugins.server.controls import Controls

    monkeypatch.setattr(Controls.compile, "__defaults__", (ROOMY,))  # the lexer limit, not a busy machine's clock
    r = httpx.post(live.url + "/generate", json={"inputs": "abc", "parameters": {
        "grammar": {"type": "regex", "value": HEAVY[0]}, "max_new_tokens": 8}}, timeout=120)
    assert r.status_code == 422, (r.status_code, r.text)
    assert TOO_COMPLEX in r.json()["error"], r.json()
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
