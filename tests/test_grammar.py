"""Grammar-constrained decoding is exact under speculation.

Greedy output equals transformers' own ``generate()`` with the constraint applied by an
independent logits processor (``grammar_helpers.NaiveGrammar``: a fresh matcher per call), for
every proposer, one row and a batch whose rows have different grammars or none; forced tokens
drafted ahead change nothing but the number of forwards; sampling under a grammar passes
chi-square against the enumerated masked law, chain and tree, and a grammar applied at the root
only (not at the drafted nodes) fails the same test. Bad grammars are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from grammar_helpers import (ENDLESS, EOS, REGEX, SCHEMA, VOCAB, A, B, C, NaiveGrammar, Padded, X, scripted,
                             tiny_tokenizer)
from helpers import EVERY_PROPOSER, chi_square_pvalue, every_proposer, exact_joint, full_logits, save_random_heads

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.grammar import GrammarError, GrammarLimits, GrammarSpec, RowGrammar, compile_grammar, ll_tokenizer
from spec_plugins.grammar.matcher import ALL
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.verifiers import ExactVerifier

N = 24


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def lltok(tok):
    return ll_tokenizer(tok, VOCAB, [EOS])


@pytest.fixture(scope="module")
def grammars(lltok):
    return {"json": compile_grammar(GrammarSpec.json_schema(SCHEMA), lltok),
            "regex": compile_grammar(GrammarSpec.regex(REGEX), lltok)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_llama(seed=3, sharpness=2.0)
    return model, save_random_heads(model, tmp_path_factory.mktemp("heads"))


def _prompts(tok):
    return [tok.encode('{"a":"abc","b":12}{"a":"xy","b":3}'), tok.encode('abcxy12abc'), tok.encode('{"b":')]


@torch.no_grad()
def reference(model, prompts, kinds, grammars, n=N):
    """transformers' greedy ``generate`` over left-padded prompts, each row under its grammar."""
    from transformers import LogitsProcessorList

    width = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    procs = [NaiveGrammar(grammars[k].tokenizer, grammars[k].grammar, width,
                          rows={r for r, kk in enumerate(kinds) if kk == k}) for k in set(kinds) - {None}]
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=EOS,
                         eos_token_id=EOS, logits_processor=LogitsProcessorList(procs))
    return [_cut(row) for row in out[:, width:].tolist()]


def _cut(row):
    return row[: row.index(EOS) + 1] if EOS in row else row


def ours(rt, proposer, prompts, kinds, grammars, forced=True, stats=None, sampling=SamplingConfig(), gen=None,
         k=3, n=N):
    rows = [None if kk is None else RowGrammar(grammars[kk], [EOS], VOCAB, forced) for kk in kinds]
    outs = [[] for _ in prompts]
    for step in decode(rt, proposer, ExactVerifier(), LogitsPipeline(sampling), prompts, n, [EOS], gen, stats,
                       FixedLength(k) if proposer is not None else None, grammars=rows):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", EVERY_PROPOSER)
def test_greedy_under_grammars_equals_transformers_generate(target, tok, grammars, kind, rows):
    model, heads = target
    prompts = _prompts(tok)[:rows]
    kinds = ["json", "regex", None][:rows]
    rt = TorchRuntime(model, matmul="native")
    proposer = every_proposer(kind, rt, heads, draft=lambda: TorchRuntime(model, matmul="native"))
    assert ours(rt, proposer, prompts, kinds, grammars) == reference(model, prompts, kinds, grammars)


def test_a_grammar_changes_the_output_and_holds_it(target, tok, grammars):
    """The constraint is not vacuous: free greedy output leaves the grammar, constrained output
    does not (and a finished JSON row parses against its schema)."""
    model, _ = target
    prompts = _prompts(tok)
    free = reference(model, prompts, [None] * 3, grammars)
    held = reference(model, prompts, ["json"] * 3, grammars)
    assert free != held
    for row in held:
        m = grammars["json"].matcher()
        assert m.consume_tokens([t for t in row if t != EOS])
        if row[-1] == EOS:
            assert set(json.loads(tok.decode(row[:-1]))) == {"a", "b"}


def test_forced_tokens_are_drafted_ahead_and_change_nothing_but_forwards(target, tok, grammars):
    model, heads = target
    prompts = _prompts(tok)
    kinds = ["json", "json", "regex"]
    want = reference(model, prompts, kinds, grammars)
    for proposer in (None, "ngram"):
        runs = {}
        for forced in (True, False):
            rt = TorchRuntime(model, matmul="native")
            prop = every_proposer(proposer, rt, heads) if proposer else None
            stats = DecodeStats()
            runs[forced] = (ours(rt, prop, prompts, kinds, grammars, forced, stats), stats)
        assert runs[True][0] == runs[False][0] == want
        assert runs[True][1].forced_tokens > 0 and runs[False][1].forced_tokens == 0
        assert runs[True][1].target_forwards < runs[False][1].target_forwards


def _path_mask(compiled, tokens):
    """The allowed-token bitmask after ``tokens``, from a fresh matcher (None: not reachable)."""
    m = compiled.matcher()
    if not m.consume_tokens(list(tokens)):
        return None
    return np.frombuffer(m.compute_bitmask(), np.int32)[: (VOCAB + 31) // 32]


@pytest.mark.parametrize("seed", range(4))
def test_tree_masks_equal_a_fresh_matcher_per_node(grammars, tok, seed):
    """Random trees (valid and invalid tokens, several children per node) from a committed state
    part way through: each live node's mask is the fresh matcher's after its path; a node the
    grammar does not allow, and its subtree, allow everything; the committed state is unchanged."""
    rng = np.random.default_rng(seed)
    g = RowGrammar(grammars["json"], [EOS], VOCAB)
    done = tok.encode('{"a":"ab')
    g.advance(done)
    before = g.mask().copy()
    n = 12
    parents = [-1] + [int(rng.integers(-1, j)) for j in range(1, n)]
    tokens = [int(t) for t in rng.integers(1, VOCAB, n)]
    for j in range(n):  # half the nodes continue validly, so the walk goes deep
        path, p = [], parents[j]
        while p >= 0:
            path.append(tokens[p])
            p = parents[p]
        mask = _path_mask(grammars["json"], done + path[::-1])
        ok = [t for t in range(VOCAB) if mask is not None and (mask[t >> 5] >> (t & 31)) & 1]
        if ok and rng.random() < 0.6:
            tokens[j] = int(rng.choice(ok))
    masks = g.masks(tokens, parents)
    assert (masks[0] == before).all() and (g.mask() == before).all()
    for j in range(n):
        path, p = [tokens[j]], parents[j]
        while p >= 0:
            path.append(tokens[p])
            p = parents[p]
        want = _path_mask(grammars["json"], done + path[::-1])
        assert (masks[j + 1] == (want if want is not None else ALL)).all(), j


def _sample_first(rt, proposer, grammar, sampling, n_samples, seed, prompt):
    gen = torch.Generator().manual_seed(seed)
    rows = [RowGrammar(grammar, [EOS], VOCAB) for _ in range(n_samples)]
    outs = [[] for _ in range(n_samples)]
    for step in decode(rt, proposer, ExactVerifier(), LogitsPipeline(sampling), [prompt] * n_samples, 4, [EOS], gen,
                       None, FixedLength(2), grammars=rows):
        for i, t in step.emitted.items():
            outs[i].extend(t)
        if min(len(o) for o in outs) >= 3:
            break
    return [tuple(o[:3]) for o in outs]


def _masked_law(model, grammar, prompt, sampling):
    proc = NaiveGrammar(grammar.tokenizer, grammar.grammar, len(prompt))
    return exact_joint(model, prompt, 3, LogitsPipeline(sampling, [proc]))


SAMPLING = SamplingConfig(temperature=1.0)
PROMPT_S = [6, 8, 10, 9]  # "a c y x"


def _proposer(kind, rt):
    """A chain drafter that samples from its own (unconstrained) law, or a point-mass tree
    drafter with several children per node (token recycling): both draft tokens the grammar refuses."""
    from spec_plugins.proposers.draft_model import DraftModelProposer
    from spec_plugins.proposers.recycling import RecyclingProposer

    if kind == "chain":
        draft = tiny_llama(seed=12, sharpness=3.0)
        return DraftModelProposer(None, target=rt, runtime=TorchRuntime(draft))
    prop = RecyclingProposer(RecyclingProposer.Config(paths=[[0], [1], [2], [0, 0], [0, 1], [1, 0]], candidates=3))
    for t in range(VOCAB):  # the table as recycling learns it: the unconstrained target's top 3 after each token
        prop.update(torch.tensor([[t]]), full_logits(rt.model, PROMPT_S + [t])[None, None])
    return prop


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampling_under_a_grammar_is_exact(grammars, tok, kind):
    model = tiny_llama(seed=11, sharpness=3.0)
    prompt = PROMPT_S
    rt = TorchRuntime(model)
    samples = _sample_first(rt, _proposer(kind, rt), grammars["regex"], SAMPLING, 6000, 0, prompt)
    p = chi_square_pvalue(samples, _masked_law(model, grammars["regex"], prompt, SAMPLING))
    assert p > 1e-3, p


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_power_a_grammar_applied_at_the_root_only_fails_the_same_test(grammars, tok, kind, monkeypatch):
    """Drafted nodes left unmasked: the target's unmasked law decides them, and the test sees it."""
    root_only = RowGrammar.masks

    def masks(self, tokens, parents, valid=None):
        out = root_only(self, tokens, parents, valid)
        out[1:] = ALL
        return out

    monkeypatch.setattr(RowGrammar, "masks", masks)
    model = tiny_llama(seed=11, sharpness=3.0)
    prompt = PROMPT_S
    rt = TorchRuntime(model)
    samples = _sample_first(rt, _proposer(kind, rt), grammars["regex"], SAMPLING, 6000, 0, prompt)
    assert chi_square_pvalue(samples, _masked_law(model, grammars["regex"], prompt, SAMPLING)) < 1e-6


@pytest.mark.parametrize("spec,message", [
    (GrammarSpec.json_schema({"type": "strin"}), "invalid json schema"),
    (GrammarSpec.json_schema("{not json"), "not valid JSON"),
    (GrammarSpec.regex("a(?=b)"), "look-around"),
    (GrammarSpec.regex("a(b"), "unclosed group"),
    (GrammarSpec.regex("zzz"), "cannot match any output"),
    (GrammarSpec("lark", "start: foo"), "invalid lark"),
    # llguidance drops a trailing lone backslash: the row would run under another language
    (GrammarSpec.regex("(ab|c)+\\"), "the regex .* ends in a lone backslash"),
    (GrammarSpec.regex("\\"), "lone backslash"),
    (GrammarSpec.json_schema({"type": "string", "pattern": "^(ab|c)+\\"}), r"\$\.pattern .* lone backslash"),
    (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "x\\\\\\"}}}),
     r"\$\.properties\.a\.pattern"),
    (GrammarSpec.json_schema({"type": "object", "patternProperties": {"^k\\": {"type": "integer"}}}),
     "patternProperties key"),
])
def test_bad_grammars_are_refused_by_name(lltok, spec, message):
    with pytest.raises(GrammarError, match=message):
        compile_grammar(spec, lltok)


@pytest.mark.parametrize("spec", [
    GrammarSpec.regex("a\\\\"),  # an escaped backslash: a literal one
    GrammarSpec.json_schema({"type": "string", "pattern": "^a\\\\$", "default": "\\"}),
    GrammarSpec.json_schema({"type": "object", "properties": {"pattern": {"type": "string"}}}),
    # const and enum hold data: a key "pattern" there is no regex
    GrammarSpec.json_schema({"type": "object", "const": {"pattern": "C:\\"}}),
    GrammarSpec.json_schema({"enum": [{"pattern": "C:\\", "patternProperties": {"x\\": 1}}]}),
])
def test_escaped_backslashes_and_properties_named_pattern_compile(lltok, spec):
    compile_grammar(spec, lltok)


def test_grammar_limits(lltok):
    big = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(500)}}
    with pytest.raises(GrammarError, match="characters; the limit is"):
        compile_grammar(GrammarSpec.json_schema(big), lltok, GrammarLimits(max_chars=5_000))
    with pytest.raises(GrammarError, match="compile; the limit is"):
        compile_grammar(GrammarSpec.json_schema(big), lltok, GrammarLimits(max_compile_ms=0.0))
    with pytest.raises(GrammarError):
        compile_grammar(GrammarSpec.json_schema(big), lltok, GrammarLimits(max_grammar_size=100))
    with pytest.raises(GrammarError, match="not supported"):
        GrammarSpec("yaml", "a: b")


@pytest.mark.parametrize("draft", ["ngram", "same_draft"])
def test_the_transformers_plugin_with_a_grammar_processor_equals_generate(tok, draft):
    """``GrammarLogitsProcessor`` (a function of each row's prefix) in ``logits_processor``:
    speculative ``generate()`` equals plain ``generate()`` with the same processor, left-padded
    batch, chain and draft model; and it holds the output to the grammar."""
    from transformers import LogitsProcessorList

    from spec_plugins.grammar.hf import GrammarLogitsProcessor
    from spec_plugins.integrations.transformers import speculative_generate

    model = tiny_llama(seed=3, sharpness=2.0)
    prompts = _prompts(tok)
    width = max(map(len, prompts))
    inputs = {"input_ids": torch.tensor([[EOS] * (width - len(p)) + p for p in prompts]),
              "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])}
    kw = dict(max_new_tokens=N, do_sample=False, pad_token_id=EOS, eos_token_id=EOS)
    proc = lambda: LogitsProcessorList([GrammarLogitsProcessor(GrammarSpec.regex(REGEX), tok, VOCAB, [EOS])])  # noqa: E731
    plain = model.generate(**inputs, **kw, logits_processor=proc())
    extra = {"draft_model": model} if draft == "same_draft" else {}
    spec = model.generate(**inputs, **kw, logits_processor=proc(), custom_generate=speculative_generate, **extra)
    assert torch.equal(spec, plain)
    for row in plain[:, width:].tolist():
        text = tok.decode([t for t in _cut(row) if t != EOS])
        assert __import__("re").fullmatch(REGEX, text) or not _cut(row)[-1] == EOS, text


def _drafter(kind, rt, heads, tokens=(A,) * 4):
    """No proposer (None), a library proposer by name, or ``tokens`` drafted every round as a
    chain or a tree (``scripted``)."""
    if kind in ("chain", "tree"):
        return scripted(list(tokens), tree=kind == "tree")
    return None if kind is None else every_proposer(kind, rt, heads)


@pytest.fixture(scope="module")
def endless(lltok):
    return compile_grammar(GrammarSpec("lark", ENDLESS), lltok)


def test_masks_on_a_branch_with_forced_text_without_end_equal_a_fresh_matcher(endless):
    """After "xa" the grammar forces "a" without end. llguidance consumes such a token only where no
    mask was computed at its state: the walk masks every node and goes on down that branch, each
    node's mask the fresh matcher's, and the committed state still takes "bc"."""
    g = RowGrammar(endless, [EOS], VOCAB)
    assert g.advance([X]) == 1
    masks = g.masks([A, A, A, B], [-1, 0, 1, -1])
    for j, path in enumerate([[A], [A, A], [A, A, A], [B]]):
        assert (masks[j + 1] == _path_mask(endless, [X] + path)).all(), j
    assert (g.mask() == _path_mask(endless, [X])).all() and not g.matcher.is_error()
    assert g.advance([B, C, EOS]) == 3, g.error


def test_a_cursor_rebuilds_a_matcher_left_in_error(endless):
    """A matcher in error cannot roll back: the cursor replaces it and walks on exactly."""
    from spec_plugins.grammar.matcher import Cursor, mask_of

    walk = Cursor(endless.matcher)
    assert walk.move([X, A])
    walk.matcher.compute_bitmask()  # at this state llguidance's next consume runs out of items
    assert not walk.move([X, A, A]) and walk.matcher.is_error()
    assert walk.move([X, B]) and (mask_of(walk.matcher, 1) == _path_mask(endless, [X, B])).all()
    assert walk.move([X, A, A, A]) and (mask_of(walk.matcher, 1) == _path_mask(endless, [X, A, A, A])).all()


@pytest.mark.parametrize("kind", ["chain", "tree", "ngram"])
def test_speculation_into_an_endless_branch_equals_plain_decoding(target, tok, endless, kind):
    """Drafts that run down the endless branch ("x" then "a"s) leave the output as transformers'
    ``generate`` under the independent processor has it."""
    model, heads = target
    prompts = [tok.encode("xaaaaxaaaaxaaaa"), tok.encode("abcxy12abc")]
    rt = TorchRuntime(model, matmul="native")
    proposer = _drafter(kind, rt, heads)
    grammars = {"endless": endless}
    want = reference(model, prompts, ["endless"] * 2, grammars, n=8)
    assert ours(rt, proposer, prompts, ["endless"] * 2, grammars, n=8) == want
    assert all(row[-1] == EOS for row in want)


def test_the_transformers_plugin_into_an_endless_branch_equals_generate(tok):
    """``GrammarLogitsProcessor`` under n-gram drafts of "a"s: speculative ``generate()`` equals
    plain ``generate()`` with it, and with the independent processor."""
    from transformers import LogitsProcessorList

    from spec_plugins.grammar.hf import GrammarLogitsProcessor
    from spec_plugins.integrations.transformers import speculative_generate

    model = tiny_llama(seed=3, sharpness=2.0)
    ids = torch.tensor([tok.encode("xaaaaxaaaaxaaaa")])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=EOS, eos_token_id=EOS)
    grammar = GrammarSpec("lark", ENDLESS)
    proc = lambda: LogitsProcessorList([GrammarLogitsProcessor(grammar, tok, VOCAB, [EOS])])  # noqa: E731
    plain = model.generate(ids, **kw, logits_processor=proc())
    spec = model.generate(ids, **kw, logits_processor=proc(), custom_generate=speculative_generate)
    assert torch.equal(spec, plain)
    lltok = ll_tokenizer(tok, VOCAB, [EOS])
    naive = NaiveGrammar(lltok, compile_grammar(grammar, lltok).grammar, ids.shape[1])
    assert torch.equal(plain, model.generate(ids, **kw, logits_processor=LogitsProcessorList([naive])))


def test_the_grammar_processor_as_documented_masks_a_padded_vocabulary(tok):
    """``GrammarLogitsProcessor(spec, tokenizer)`` on a model whose logits are wider than the
    tokenizer (Qwen2.5: 151936 columns, 151665 tokens): the extra columns, made the argmax here,
    are never allowed; plain and speculative ``generate()`` equal the independent processor's."""
    from transformers import LogitsProcessorList

    from spec_plugins.grammar.hf import GrammarLogitsProcessor
    from spec_plugins.integrations.transformers import speculative_generate

    model = tiny_llama(vocab=2 * VOCAB, seed=3, sharpness=2.0)
    ids = torch.tensor([tok.encode("abcxy12abc")])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=EOS, eos_token_id=EOS)
    grammar = GrammarSpec.regex(REGEX)
    procs = lambda: LogitsProcessorList([Padded(VOCAB), GrammarLogitsProcessor(grammar, tok)])  # noqa: E731
    plain = model.generate(ids, **kw, logits_processor=procs())
    lltok = ll_tokenizer(tok, VOCAB, [EOS])
    naive = NaiveGrammar(lltok, compile_grammar(grammar, lltok).grammar, ids.shape[1])
    assert torch.equal(plain, model.generate(ids, **kw, logits_processor=LogitsProcessorList([Padded(VOCAB), naive])))
    assert torch.equal(model.generate(ids, **kw, logits_processor=procs(), custom_generate=speculative_generate), plain)
    assert int(plain[0, ids.shape[1]:].max()) < VOCAB


def _finish(rt, proposer, prompt, compiled, n=12):
    """One row decoded under ``compiled``: its tokens, finish reason and grammar state."""
    g = RowGrammar(compiled, [EOS], VOCAB)
    out, reason = [], None
    for step in decode(rt, proposer, ExactVerifier(), LogitsPipeline(SamplingConfig()), [prompt], n, [EOS],
                       draft_length=FixedLength(3) if proposer is not None else None, grammars=[g]):
        out += step.emitted.get(0, [])
        reason = step.finished.get(0, reason)
    return out, reason, g


@pytest.mark.parametrize("kind", [None, "ngram", "chain", "tree"])
def test_a_lark_rule_that_only_recurses_runs_to_length(target, tok, lltok, kind):
    """``start: "a" start`` forces "a" without end (its language is empty): as the docs say, a row
    under it runs to ``length``, equal to transformers' ``generate`` under the independent
    processor, and so does a recursion through a choice."""
    model, heads = target
    prompts = [tok.encode("abcxy12abc")]
    for text in ['start: "a" start', 'start: ("a" | "b") start']:
        grammars = {"rec": compile_grammar(GrammarSpec("lark", text), lltok)}
        rt = TorchRuntime(model, matmul="native")
        proposer = _drafter(kind, rt, heads)
        out, reason, _ = _finish(rt, proposer, prompts[0], grammars["rec"])
        assert reason == "length" and out == reference(model, prompts, ["rec"], grammars, n=12)[0], (text, out)


@pytest.mark.parametrize("kind", [None, "ngram", "chain", "tree"])
def test_a_matcher_in_error_ends_the_row_with_error_naming_the_cause(target, tok, lltok, kind):
    """``abz`` where no token spells "z": after "ab" llguidance's matcher is in error and allows
    end-of-sequence only. The row ends with ``error`` naming that, never as a finished output."""
    model, heads = target
    rt = TorchRuntime(model, matmul="native")
    proposer = _drafter(kind, rt, heads, [EOS, A])  # a drafted end-of-sequence, where the grammar allows it
    compiled = compile_grammar(GrammarSpec.regex("abz"), lltok)
    out, reason, g = _finish(rt, proposer, tok.encode("abcxy12abc"), compiled)
    assert reason == "error" and EOS not in out, (out, reason)
    assert "no token of this model's vocabulary can continue the grammar" in g.error, g.error


def test_an_end_of_sequence_the_grammar_does_not_allow_is_refused(grammars):
    """``advance`` ends a row on end-of-sequence only where the grammar is complete; it counts the
    tokens it accepted, those before the refused one."""
    g = RowGrammar(grammars["regex"], [EOS], VOCAB)
    assert g.advance([21, EOS]) == 1 and "not complete" in g.error  # "ab": the regex needs a number
    g = RowGrammar(grammars["regex"], [EOS], VOCAB)
    assert g.advance([21, 25, EOS]) == 3, g.error  # "ab12"
    # tokens past an allowed end (a decoder stopping on other ids) are past the grammar
    assert RowGrammar(grammars["regex"], [EOS], VOCAB).advance([21, 25, EOS, 21]) == 4


class _LastSequence:
    """Observer: the row's token list after the last round (``RoundRecord.sequences``) and the
    most tokens a round carried (its accepted drafted tokens and the next token)."""

    tokens: list = []
    widest = 0

    def observe(self, record):
        self.tokens = record.sequences[0]
        self.widest = max(self.widest, len(record.accepted[0]) + 1)


def _generate_and_stream(model, tok, proposer, forced, stop):
    """``generate`` and ``stream`` of "abc" under ``cxyabz`` (no token spells "z": after "cxyab" the
    grammar has no way on): (ids, text, finish, error, row tokens past the prompt) of each, and
    the most tokens a round carried."""
    from spec_plugins import SpeculativeDecoder

    runs, widest = [], 0
    for how in ("generate", "stream"):
        dec = SpeculativeDecoder(TorchRuntime(model, tok, matmul="native"), proposer() if proposer else None,
                                 ExactVerifier(), tokenizer=tok)
        seen = _LastSequence()
        kw = dict(grammar=GrammarSpec.regex("cxyabz"), stop=stop, forced_drafts=forced, observers=[seen])
        if how == "generate":
            r = dec.generate("abc", 12, **kw)
            ids, text, reason, error = r.token_ids, r.text, r.finish_reason, r.error
            assert r.stats.new_tokens == len(ids), r.stats  # a failing round's kept tokens count
        else:
            events = list(dec.stream("abc", 12, **kw))
            ids = [t for e in events for t in e.token_ids]
            text, reason, error = "".join(e.text for e in events), events[-1].finish_reason, events[-1].error
        runs.append((ids, text, reason, error, seen.tokens[len(tok.encode("abc")):]))
        widest = max(widest, seen.widest)
    return runs, widest


@pytest.mark.parametrize("stop, finish", [(["xy"], "stop_sequence"), ((), "error")])
@pytest.mark.parametrize("drafts", ["forced", "ngram"])
def test_a_round_past_a_grammar_failure_ends_as_plain_decoding(target, tok, stop, finish, drafts):
    """A round carrying tokens up to one the grammar refuses keeps those before it, as one-token
    rounds emit them, and a stop string they complete ends the row with ``stop`` (no error): output,
    finish reason, error and the row's own tokens equal plain decoding's (no drafts)."""
    from spec_plugins.proposers.ngram import NgramProposer

    model, _ = target
    plain, _ = _generate_and_stream(model, tok, None, False, stop)
    ngram = (lambda: NgramProposer(NgramProposer.Config(num_draft_tokens=4))) if drafts == "ngram" else None
    spec, widest = _generate_and_stream(model, tok, ngram, True, stop)
    assert widest > 1  # a round carried several tokens
    assert plain[0][2] == finish and len(plain[0][0]) > 1, plain
    for p, s in zip(plain, spec):
        assert s == p and s[4] == s[0], (s, p)  # the row's tokens are its output


def test_an_end_of_sequence_the_grammar_knows_ends_the_row_whatever_the_drafts(target, tok):
    """A grammar's end-of-sequence id ends its row even where the decoder stops on other ids
    (``decode(eos_ids=())``): speculative output equals plain decoding's (before: tokens drafted past
    the grammar's end were taken unchecked, outside the grammar)."""
    from spec_plugins.proposers.ngram import NgramProposer

    model, _ = target
    compiled = compile_grammar(GrammarSpec.regex("ab12"), ll_tokenizer(tok, VOCAB, [EOS]))
    prompt = (tok.encode("ab12") + [EOS]) * 4

    def run(proposer, forced):
        out, reasons = [], []
        for step in decode(TorchRuntime(model, matmul="native"), proposer, ExactVerifier(),
                           LogitsPipeline(SamplingConfig()), [prompt], 12, (), None, None, FixedLength(4),
                           grammars=[RowGrammar(compiled, [EOS], VOCAB, forced)]):
            out += step.emitted.get(0, [])
            reasons += list(step.finished.values())
        return out, reasons

    plain = run(None, False)
    assert plain == (tok.encode("ab12") + [EOS], ["eos_token"]), plain
    assert run(None, True) == plain
    assert run(NgramProposer(NgramProposer.Config(num_draft_tokens=4)), False) == plain
