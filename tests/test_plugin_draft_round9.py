"""The transformers plugin refuses a draft model that does not use the target's tokenizer, as
``SpeculativeDecoder.from_config`` does (``plugin_state.check_draft``): tokenizers are compared
where both are known (local directories, or the target's given), logits widths otherwise; a
padded vocabulary stays accepted, and its output equals transformers' greedy ``generate()``."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from grammar_helpers import MERGES, tiny_tokenizer
from helpers import hf_generate
from transformers import AutoModelForCausalLM

from spec_plugins.config import SpecConfig
from spec_plugins.integrations.plugin_state import Setup
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.stats import DecodeStats
from spec_plugins.vocab import VocabMismatch

PROMPT = [5, 6, 7, 5, 6, 7, 5]
TARGET = {"backend": "torch", "model": "<the model generate() was called on>"}
MISMATCH = "tokenizer/vocabulary mismatch between target .* and draft model"


def _other_tokenizer():
    """``tiny_tokenizer()``'s 32 tokens under other ids (reversed; ``<eos>`` kept at 0): another
    tokenizer of the same size, which only a comparison of the tokenizers tells apart."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = tiny_tokenizer().get_vocab()
    names = sorted(base, key=base.get)[1:]
    vocab = {"<eos>": 0, **{t: i + 1 for i, t in enumerate(reversed(names))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


@torch.no_grad()
def _padded(model: torch.nn.Module, rows: int, layers: int = 2) -> torch.nn.Module:
    """``model`` with its embeddings and LM head padded to ``rows`` (zero rows): the same model
    over a padded vocabulary, so every greedy draft is accepted."""
    wide = tiny_llama(vocab=rows, layers=layers)
    state = model.state_dict()
    for k, v in wide.state_dict().items():
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            v.zero_()[: state[k].shape[0]] = state[k]
        else:
            v.copy_(state[k])
    return wide


def _saved(tmp_path, name: str, model: torch.nn.Module, tok) -> str:
    """``model`` and ``tok`` written to a local directory; its path."""
    path = str(tmp_path / name)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _loaded(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _speculative(model, **kw) -> tuple[list[int], DecodeStats]:
    stats = DecodeStats()
    out = model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                         custom_generate=speculative_generate, spec_stats=stats, **kw)
    return out[0, len(PROMPT):].tolist(), stats


def test_a_draft_model_with_another_tokenizer_from_a_local_directory_is_refused(tmp_path):
    """Same vocabulary size, other token ids: refused by name (its drafts would mean other text);
    a draft of the same tokenizer with a far wider padded head is accepted (the tokenizers match)
    and its output equals transformers' greedy generate()."""
    target_model = tiny_llama(seed=3, sharpness=8.0)
    target = _loaded(_saved(tmp_path, "target", target_model, tiny_tokenizer()))
    other = _loaded(_saved(tmp_path, "other", tiny_llama(seed=4), _other_tokenizer()))
    with pytest.raises(VocabMismatch, match=MISMATCH):
        _speculative(target, draft_model=other)
    same = _loaded(_saved(tmp_path, "same", _padded(target_model, 512), tiny_tokenizer()))
    out, stats = _speculative(target, draft_model=same)
    assert out == hf_generate(target, [PROMPT], 12, pad=0)[0]
    assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens


def test_a_draft_model_section_with_another_tokenizer_is_refused(tmp_path):
    """A spec_config ``draft_model`` section whose model directory holds another tokenizer: refused
    against the target's directory's tokenizer, and against a tokenizer handed to the wiring
    (the call's spec_tokenizer) for a target loaded without one; the same tokenizer is accepted."""
    target_model = tiny_llama(seed=3, sharpness=8.0)
    target = _loaded(_saved(tmp_path, "target", target_model, tiny_tokenizer()))
    other = _saved(tmp_path, "other", tiny_llama(seed=4), _other_tokenizer())
    section = {"type": "draft_model", "num_draft_tokens": 3, "model": {"backend": "torch", "model": other}}
    with pytest.raises(VocabMismatch, match=MISMATCH):
        _speculative(target, spec_config={"proposer": section})
    in_memory = tiny_llama(seed=3)
    with pytest.raises(VocabMismatch, match=MISMATCH):
        Setup.of(in_memory).wired(SpecConfig.model_validate({"target": TARGET, "proposer": section}), None, False, None,
                                  tokenizer=tiny_tokenizer())
    same = _saved(tmp_path, "same", _padded(target_model, 48), tiny_tokenizer())
    out, stats = _speculative(target, spec_config={"proposer": {**section, "model": {"backend": "torch",
                                                                                     "model": same}}})
    assert out == hf_generate(target, [PROMPT], 12, pad=0)[0] and stats.accepted_tokens > 0


def test_without_tokenizers_a_vocabulary_wider_than_padding_explains_is_refused():
    """Models built in memory (no tokenizer to read): a draft head of 65536 rows for a 49152-row
    target is refused naming both; one padded to 49280 rows (SmolLM2's width rounded up) is
    accepted and its output equals transformers' greedy generate()."""
    target = tiny_llama(vocab=49152, layers=1, seed=3, sharpness=8.0)
    with pytest.raises(VocabMismatch, match=r"\(65536 logits\) and the target's \(49152\) differ by more than "
                                            r"padding explains"):
        _speculative(target, draft_model=tiny_llama(vocab=65536, layers=1, seed=4))
    out, stats = _speculative(target, draft_model=_padded(target, 49280, layers=1))
    assert out == hf_generate(target, [PROMPT], 12, pad=0)[0]
    assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens
