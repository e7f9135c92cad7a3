"""Round 15: a row whose user processor raises (or leaves no distribution) at a node on its
accepted path keeps the accepted tokens before that node, as plain decoding emits them before it
reaches the node, and only then fails; tokens that end the row first (EOS, a stop string) end it
with no error. The result no longer depends on the draft: each case is compared with the plain
decoder over the same target (chain drafts: n-gram; tree drafts: suffix, recycling)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig, SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.loop.round import decode
from spec_plugins.policy import FixedLength
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from test_text import byte_tokenizer

TEXT = "ab ac ab ad ab ac ab ad ab ac"  # repeated with varied continuations: suffix and recycling draft trees
PROPOSERS = {"ngram": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 2},
             "suffix": {"type": "suffix", "num_draft_tokens": 6, "tree_nodes": 8},
             "recycling": {"type": "recycling", "num_draft_tokens": 4, "tree_size": 8}}
TREES = ("suffix", "recycling")
NO_DISTRIBUTION = "sampling failed: the processed logits are not finite (NaN, inf, or every token masked)"


@pytest.fixture(scope="module")
def setup():
    """The byte tokenizer, the text's ids, a prompt holding the text twice (the drafters find it
    there), the plain decoder and one speculative decoder per proposer, all over one target."""
    tok = byte_tokenizer()
    model = tiny_llama(vocab=len(tok), seed=0)
    decs = {k: SpeculativeDecoder.from_config(
        SpecConfig.parse({"target": {"backend": "torch", "model": "tiny-test-model"}, "proposer": p}),
        target=TorchRuntime(model, tok)) for k, p in PROPOSERS.items()}
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    prompt = tok(TEXT + "\n" + TEXT + "\n", add_special_tokens=False)["input_ids"]
    return tok, ids, prompt, decs["ngram"].without_speculation(), decs


class Forced:
    """Leaves only ``ids[n]`` at completion position n (rows told apart by their first token:
    ``prompts`` {first token: prompt length}); ``raise_after``: raises once a row in ``raising``
    holds more than that many new tokens; ``mask_at``: masks every token of such a row at exactly
    that many new tokens (no distribution)."""

    def __init__(self, ids: list[int], prompts: dict[int, int], raise_after: int | None = None,
                 mask_at: int | None = None, raising: tuple[int, ...] | None = None) -> None:
        self.ids, self.prompts, self.raise_after, self.mask_at = ids, prompts, raise_after, mask_at
        self.raising = tuple(prompts) if raising is None else raising

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -1e9)
        for i, row in enumerate(seq.tolist()):
            n = len(row) - self.prompts[row[0]]
            if row[0] in self.raising and self.raise_after is not None and n > self.raise_after:
                raise ValueError(f"at {n} new tokens")
            if row[0] in self.raising and n == self.mask_at:
                out[i] = float("-inf")
            else:
                out[i, self.ids[min(n, len(self.ids) - 1)]] = 0.0
        return out


class Trees:
    """An observer: whether some round's draft was a tree (a node whose parent is not the one before it)."""

    def __init__(self) -> None:
        self.seen = False

    def observe(self, record) -> None:
        if record.draft is not None:
            parents = record.draft.parents
            for row in (parents if parents and isinstance(parents[0], (tuple, list)) else [parents]):
                self.seen |= any(p != i - 1 for i, p in enumerate(row))


def _result(g) -> tuple:
    return g.token_ids, g.text, g.finish_reason, g.error, g.stats.new_tokens


# ---- generate -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_a_processor_raising_on_the_accepted_path_keeps_the_tokens_before_it_as_plain_decoding(setup, kind):
    """The n-gram drafter once kept 1 token where plain decoding keeps 4: the round's accepted
    tokens before the raising node were dropped with the row."""
    tok, ids, prompt, plain, decs = setup
    trees, accepted = Trees(), 0
    for after in (3, 8, 15, 22):
        proc = Forced(ids, {prompt[0]: len(prompt)}, raise_after=after)
        want = plain.generate(prompt, max_new_tokens=len(ids), processors=[proc])
        assert (want.token_ids, want.finish_reason) == (ids[: after + 1], "error")
        assert want.error == f"logits processing failed: ValueError: at {after + 1} new tokens"
        got = decs[kind].generate(prompt, max_new_tokens=len(ids), processors=[proc], observers=[trees])
        assert _result(got) == _result(want), after
        accepted += got.stats.accepted_tokens
    assert accepted > 0  # drafted tokens were accepted, so the raising nodes were drafted ones
    assert trees.seen == (kind in TREES)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_no_distribution_on_the_accepted_path_keeps_the_tokens_before_it_and_names_that_failure(setup, kind):
    """Every token masked at one node and a raise at the next: plain decoding fails at the first,
    with no distribution, not with the deeper node's processor error."""
    tok, ids, prompt, plain, decs = setup
    for at in (4, 11):
        proc = Forced(ids, {prompt[0]: len(prompt)}, raise_after=at, mask_at=at)
        want = plain.generate(prompt, max_new_tokens=len(ids), processors=[proc])
        assert (len(want.token_ids), want.error) == (at, NO_DISTRIBUTION)
        assert _result(decs[kind].generate(prompt, max_new_tokens=len(ids), processors=[proc])) == _result(want)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_a_stop_string_before_the_raising_node_ends_the_row_with_no_error(setup, kind):
    """The tokens before the raising node complete a stop string: plain decoding stops there and
    never reaches the node; the speculative round did fail the row."""
    tok, ids, prompt, plain, decs = setup
    for stop in ("ab ac", "ac ab", "ab ad"):
        k = TEXT.index(stop) + len(stop)  # the token completing it (one token a character)
        proc = Forced(ids, {prompt[0]: len(prompt)}, raise_after=k - 1)  # raises at the node after it
        want = plain.generate(prompt, max_new_tokens=len(ids), processors=[proc], stop=stop)
        assert (want.token_ids, want.text, want.error) == (ids[:k], TEXT[: k - len(stop)], None)
        got = decs[kind].generate(prompt, max_new_tokens=len(ids), processors=[proc], stop=stop)
        assert _result(got) == _result(want), stop


@pytest.mark.parametrize("kind", ["ngram", "recycling"])
def test_an_eos_before_the_raising_node_ends_the_row_with_no_error(setup, kind):
    tok, ids, prompt, plain, decs = setup
    dec = decs[kind]
    for k in (TEXT.index("c") + 1, TEXT.index("d") + 1):  # the row ends at its first "c" (or "d")
        proc = Forced(ids, {prompt[0]: len(prompt)}, raise_after=k - 1)  # raises at the node after it
        runs = []
        for proposer in (None, dec.proposer):
            stats, toks, errors = DecodeStats(), [], {}
            for step in decode(dec.target, proposer, dec.verifier, LogitsPipeline(SamplingConfig(), [proc]), [prompt],
                               len(ids), eos_ids=[ids[k - 1]], stats=stats, draft_length=FixedLength(4)):
                toks += step.emitted.get(0, [])
                errors.update(step.errors)
            runs.append((toks, errors, stats.new_tokens))
        assert runs[0] == (ids[:k], {}, k)
        assert runs[1] == runs[0], k
        assert stats.accepted_tokens > 0  # the EOS was a drafted node: the raising one came after it


# ---- stream ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_a_stream_carries_the_kept_tokens_up_to_its_error_event(setup, kind):
    """Plain decoding streams the tokens before the raising node, one a round, then the error
    event; a speculative round carries several of them to the failure at once, in the error event."""
    tok, ids, prompt, plain, decs = setup
    for after in (3, 15):
        proc = Forced(ids, {prompt[0]: len(prompt)}, raise_after=after)
        runs = [list(d.stream(prompt, max_new_tokens=len(ids), processors=[proc])) for d in (plain, decs[kind])]
        for events in runs:
            assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + ["error"]
            assert events[-1].error.endswith(f"at {after + 1} new tokens")
        seen = [([t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1].error) for events in runs]
        assert seen[0][0] == ids[: after + 1]
        assert seen[1] == seen[0]


# ---- generate_batch --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ngram", "suffix", "recycling"])
def test_a_batch_row_keeps_its_tokens_before_the_raising_node_and_its_neighbour_decodes_on(setup, kind):
    """Two rows of one length (one processing group): the raising row fails as it does alone in
    plain decoding, after the same tokens; the row beside it is the plain decoder's."""
    tok, ids, prompt, plain, decs = setup
    other = tok("Z", add_special_tokens=False)["input_ids"] + prompt[1:]
    proc = Forced(ids, {prompt[0]: len(prompt), other[0]: len(other)}, raise_after=8, raising=(prompt[0],))
    want = plain.generate_batch([prompt, other], max_new_tokens=len(ids), processors=[proc])
    assert [w.finish_reason for w in want] == ["error", "length"]
    assert want[0].token_ids == ids[:9] and want[1].token_ids == ids
    alone = plain.generate(prompt, max_new_tokens=len(ids), processors=[proc])
    assert _result(want[0]) == _result(alone)
    got = decs[kind].generate_batch([prompt, other], max_new_tokens=len(ids), processors=[proc])
    assert [_result(g) for g in got] == [_result(w) for w in want]
