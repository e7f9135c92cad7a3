"""Round 15: user processors that change their scores in place under a node-by-node retry, and
``token_healing`` through the directory form, each against plain ``generate()``."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from grammar_helpers import tiny_tokenizer
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import tiny_llama
from spec_plugins.config import ProposerConfig, SamplingConfig
from spec_plugins.integrations.transformers import CUSTOM_GENERATE, speculative_generate
from spec_plugins.proposers import Draft, Proposer
from spec_plugins.sampling import LogitsPipeline

BANNED = 7


class InPlaceBias(LogitsProcessor):
    """A common user idiom: the bias is added to the scores it was given, which it returns."""

    def __init__(self, token: int, bias: float) -> None:
        self.token, self.bias = token, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.token] += self.bias
        return scores


class BanAndAssert(LogitsProcessor):
    """Bans ``BANNED`` and raises on a prefix holding it after ``start``: plain decoding never
    reaches such a prefix, a tree draft does (a drafted node that is then rejected)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if (input_ids[:, self.start:] == BANNED).any():
            raise AssertionError(f"token {BANNED} was generated")
        return scores.index_fill(1, torch.tensor([BANNED]), float("-inf"))


class Siblings(Proposer):
    """Drafts every token as a sibling at depth 1, ``BANNED`` first (its group's call raises)."""

    tree = True

    class Config(ProposerConfig):
        type: Literal["siblings_r15"] = "siblings_r15"

    def __init__(self, vocab: int) -> None:
        self.config, self.vocab = self.Config(num_draft_tokens=1), vocab

    def propose(self, ctx) -> Draft:
        toks = [BANNED] + [t for t in range(self.vocab) if t != BANNED]
        return Draft(torch.tensor([toks] * len(ctx.sequences)), tuple([-1] * len(toks)))

    def observe(self, record) -> None:
        pass


def test_retried_nodes_see_scores_an_in_place_processor_has_not_changed():
    """The group's call biases its scores in place and then raises at the drafted ``BANNED``
    node; each node's retry must start from the unprocessed scores (bias added once)."""
    p = LogitsPipeline(SamplingConfig(temperature=0.0), [InPlaceBias(4, 1.5), BanAndAssert(2)])
    logits = torch.zeros(1, 4, 8)
    out, raised = p.process_tree_apart(logits, [[5, 6]], torch.tensor([[3, BANNED, 1, 2]]), (-1, 0, 0, 0))
    assert list(raised) == [(0, 1)]
    assert out[0, [0, 2, 3], 4].tolist() == [1.5, 1.5, 1.5]
    assert bool(out[0, 1].isnan().all())
    assert torch.equal(logits, torch.zeros(1, 4, 8))  # the caller's logits are left as they were


def test_in_place_processor_with_a_raising_one_under_a_tree_draft_equals_plain_generate():
    model = tiny_llama(seed=3)
    ids = torch.tensor([[5, 6, BANNED, 5, 6, 9, 3]])
    differ = []
    for tok in (0, 3, 4, 14, 20):
        def procs():
            return LogitsProcessorList([InPlaceBias(tok, 0.1), BanAndAssert(ids.shape[1])])
        plain = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, logits_processor=procs())
        spec = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, logits_processor=procs(),
                              custom_generate=speculative_generate, proposer=Siblings(32))
        if not torch.equal(plain, spec):
            differ.append(tok)
    assert differ == []


def _healing_setup():
    tok = tiny_tokenizer()
    tok.pad_token = tok.bos_token = tok.convert_ids_to_tokens(0)
    return tiny_llama(seed=5, vocab=len(tok), sharpness=8.0), tok


@pytest.mark.parametrize("with_mask", [True, False])
def test_token_healing_in_the_directory_form_equals_plain_generate(with_mask):
    """The directory form heals with its ``tokenizer=`` as plain ``generate()`` does (the
    callable's heal step in transformers never has the tokenizer)."""
    model, tok = _healing_setup()
    for prompt in ("ab b", " ab ab"):  # the tail 'b' heals to 'ba'; the leading space is stripped
        enc = tok([prompt], return_tensors="pt")
        inputs = dict(enc) if with_mask else {"input_ids": enc.input_ids}
        assert not torch.equal(model.heal_tokens(enc.input_ids, tok), enc.input_ids)  # healing changes it
        kw = dict(max_new_tokens=8, do_sample=False, token_healing=True, pad_token_id=0, tokenizer=tok)
        plain = model.generate(**inputs, **kw)
        spec = model.generate(**inputs, **kw, custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                              spec_config={"proposer": {"type": "ngram", "num_draft_tokens": 3}})
        assert torch.equal(spec, plain), prompt


def test_token_healing_of_padded_prompts_is_refused_by_name():
    model, tok = _healing_setup()
    tok.padding_side = "left"
    enc = tok(["ab b", "b"], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="token_healing=True with padded prompts"):
        model.generate(**enc, max_new_tokens=4, do_sample=False, token_healing=True, pad_token_id=0,
                       tokenizer=tok, custom_generate=CUSTOM_GENERATE, trust_remote_code=True)
