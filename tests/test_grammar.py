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
from grammar_helpers import EOS, REGEX, SCHEMA, VOCAB, NaiveGrammar, tiny_tokenizer
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
])
def test_bad_grammars_are_refused_by_name(lltok, spec, message):
    with pytest.raises(GrammarError, match=message):
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
