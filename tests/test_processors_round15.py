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


CYCLE = [5, 6, 9, 3]


class FollowThenRaise(LogitsProcessor):
    """Forces each row's next token from its own prefix (a row opening with 5 walks ``CYCLE``, which
    the n-gram drafter guesses from the prompt; a padded row walks x -> 5x + 1 mod 32, which it does
    not), and raises once more than ``after`` new tokens are there."""

    def __init__(self, prompt_len: int, after: int) -> None:
        self.prompt_len, self.after = prompt_len, after

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] - self.prompt_len > self.after:
            raise ValueError("boom")
        out = torch.full_like(scores, -1e9)
        for i, row in enumerate(input_ids.tolist()):
            nxt = CYCLE[(CYCLE.index(row[-1]) + 1) % 4] if row[0] == 5 else (row[-1] * 5 + 1) % 32
            out[i, nxt] = 0.0
        return out


class Recorder:
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def _streamed(rec: Recorder, batch: int) -> list[list[int]]:
    """The new tokens a streamer received, per row (the first put is the prompt)."""
    flat = [t for put in rec.puts[1:] for t in put]
    return [flat[i::batch] for i in range(batch)] if batch > 1 else [flat]


@pytest.mark.parametrize("drafter", ["chain", "tree"])
@pytest.mark.parametrize("after", [3, 7])
def test_a_raising_processor_streams_the_tokens_before_it_as_plain_generate(drafter, after):
    """Plain ``generate()`` streams every token before the step whose processor raises; the plugin
    streams the kept tokens of its failing round (and, with a batch, the other rows' columns up to
    that step) before it raises."""
    model = tiny_llama(seed=3)
    extra = (dict(spec_config={"proposer": {"type": "ngram", "num_draft_tokens": 4}}) if drafter == "chain"
             else dict(proposer=Siblings(32)))
    for ids, mask in ((torch.tensor([CYCLE * 3]), None),
                      (torch.tensor([CYCLE * 3, [0] * 10 + [1, 2]]), torch.tensor([[1] * 12, [0] * 10 + [1, 1]]))):
        inputs = {"input_ids": ids} | ({"attention_mask": mask} if mask is not None else {})
        plain, spec = Recorder(), Recorder()
        procs = LogitsProcessorList([FollowThenRaise(ids.shape[1], after)])
        kw = dict(max_new_tokens=12, do_sample=False, logits_processor=procs, pad_token_id=0)
        with pytest.raises(ValueError, match="boom"):
            model.generate(**inputs, **kw, streamer=plain)
        with pytest.raises(RuntimeError, match="boom"):
            model.generate(**inputs, **kw, spec_streamer=spec, custom_generate=speculative_generate, **extra)
        assert spec.ended and spec.puts[0] == plain.puts[0]
        assert _streamed(spec, len(ids)) == _streamed(plain, len(ids))
        assert len(_streamed(plain, len(ids))[0]) == after + 1
        if len(ids) > 1:  # batched: one [B] column per put, as plain puts them
            assert spec.puts == plain.puts


def test_token_healing_with_num_return_sequences_heals_each_copy_as_plain_generate():
    """transformers heals the prompts after expanding them for ``num_return_sequences``: with a
    sampling model config (which ``heal_tokens``' own ``generate()`` uses), each copy heals with
    its own draws."""
    model, tok = _healing_setup()
    model.generation_config.do_sample, model.generation_config.temperature = True, 1.0
    enc = tok(["ab b"], return_tensors="pt")
    kw = dict(max_new_tokens=2, do_sample=True, num_return_sequences=4, token_healing=True, pad_token_id=0,
              tokenizer=tok)
    copies_differ = False
    for seed in range(4):
        torch.manual_seed(seed)
        plain = model.generate(input_ids=enc.input_ids, **kw)
        torch.manual_seed(seed)
        spec = model.generate(input_ids=enc.input_ids, **kw, custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                              spec_config={"proposer": {"type": "ngram", "num_draft_tokens": 3}})
        n = enc.input_ids.shape[1]
        assert spec.shape == plain.shape and torch.equal(spec[:, :n], plain[:, :n]), seed
        copies_differ |= len({tuple(r) for r in plain[:, :n].tolist()}) > 1
    assert copies_differ  # the copies healed apart at some seed: the comparison can tell


def test_token_healing_in_a_generation_config_adds_no_deprecation_warning(monkeypatch):
    """Healing switched off on a copy of the caller's ``generation_config``, not by a keyword next
    to it, which transformers warns about (plain ``generate()`` does not warn)."""
    from transformers import GenerationConfig
    from transformers.generation import utils as gen_utils

    model, tok = _healing_setup()
    said: list[str] = []
    monkeypatch.setattr(gen_utils.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    enc = tok(["ab b"], return_tensors="pt")
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, token_healing=True, pad_token_id=0)
    plain = model.generate(input_ids=enc.input_ids, generation_config=gc, tokenizer=tok)
    spec = model.generate(input_ids=enc.input_ids, generation_config=gc, tokenizer=tok,
                          custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                          spec_config={"proposer": {"type": "ngram", "num_draft_tokens": 3}})
    assert torch.equal(spec, plain)
    assert gc.token_healing is True  # the caller's config is left as it was
    assert not [m for m in said if "generation_config" in m and "deprecated" in m]
