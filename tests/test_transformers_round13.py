"""``speculative_generate`` where ``generate(position_ids=...)`` was accepted and then dropped:
plain ``generate()`` uses the given positions (and continues from the last one), this engine
derives them from the attention mask, so custom positions changed the output without a word.
Positions equal to the ones ``generate()`` derives itself still run, as plain ``generate()``."""

from __future__ import annotations

import pytest
import torch
from test_transformers_integration import PAD, PROMPTS, both, left_padded

from conftest import tiny_llama
from spec_plugins.integrations.transformers import CUSTOM_GENERATE, speculative_generate

NGRAM = {"spec_config": {"proposer": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 2}}}
CALLABLE = {"custom_generate": speculative_generate, **NGRAM}
DIRECTORY = {"custom_generate": CUSTOM_GENERATE, "trust_remote_code": True, **NGRAM}
GREEDY = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": PAD}
ONE_ROW = torch.tensor([[5, 9, 17, 2, 30, 11, 4]])


def _position_sensitive():
    """A tiny model whose attention is sharp enough that positions decide its greedy output."""
    model = tiny_llama(seed=0, sharpness=8.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
            layer.self_attn.o_proj.weight.mul_(30)
    return model


def _custom_positions() -> list[tuple[dict, torch.Tensor]]:
    """(inputs, position_ids other than generate()'s own): spread-out positions for one row and
    for each row of a left-padded batch."""
    batch = left_padded(PROMPTS)
    spread = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0) * 3
    return [({"input_ids": ONE_ROW}, torch.arange(7)[None] * 7), (batch, spread)]


@pytest.mark.parametrize("how", [CALLABLE, DIRECTORY], ids=["callable", "directory"])
@pytest.mark.parametrize("case", [0, 1], ids=["one_row", "padded_batch"])
def test_custom_position_ids_are_refused(how, case):
    """Plain generate() decodes otherwise with these positions; the call ran with the mask's."""
    model = _position_sensitive()
    inputs, pos = _custom_positions()[case]
    plain = model.generate(**inputs, position_ids=pos, **GREEDY)
    assert not torch.equal(plain, model.generate(**inputs, **GREEDY))  # the positions matter here
    with pytest.raises(ValueError, match=r"custom position_ids.*derives positions from the attention mask"):
        model.generate(**inputs, position_ids=pos, **GREEDY, **how)


def test_default_position_ids_of_one_row_run_as_plain_generate():
    """``arange`` over an unpadded prompt is what generate() uses without position_ids."""
    model = _position_sensitive()
    inputs = {"input_ids": ONE_ROW, "position_ids": torch.arange(7)[None]}
    plain, spec = both(model, inputs, NGRAM, **GREEDY)
    assert torch.equal(spec, plain)
    assert torch.equal(plain, model.generate(input_ids=ONE_ROW, **GREEDY))


@pytest.mark.parametrize("pad_value", [0, -1, 5], ids=["zero", "minus_one", "any"])
def test_default_position_ids_of_a_padded_batch_run_as_plain_generate(pad_value):
    """``attention_mask.cumsum(-1) - 1`` at the prompt tokens; what the pad slots hold does not
    matter to plain generate() (no real token attends to them), so it is not compared."""
    model = _position_sensitive()
    inputs = left_padded(PROMPTS)
    mask = inputs["attention_mask"]
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, pad_value)
    plain, spec = both(model, {**inputs, "position_ids": pos}, NGRAM, **GREEDY)
    assert torch.equal(spec, plain)
    assert torch.equal(plain, model.generate(**inputs, **GREEDY))
