"""Round 18, the Python API's batch inputs: one prompt given where generate_batch's list goes is
refused pointing at generate(), a bad prompt of a batch is named by its index, and a bad per-row
``sampling[i]`` or sampling argument is named as the caller gave it, not as SamplingConfig's field."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from pydantic import ValidationError
from spec_plugins.backends.torch_runtime import TorchRuntime

from spec_plugins.config import SamplingConfig, SpecConfig
from spec_plugins.decoder import SpeculativeDecoder


@pytest.fixture(scope="module")
def dec() -> SpeculativeDecoder:
    return SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, sharpness=8.0)))


@pytest.mark.parametrize("one", [[3, 4, 5], (3, 4, 5), torch.tensor([3, 4, 5])])
def test_one_token_id_list_is_refused_pointing_at_generate(dec, one):
    """``generate_batch([3, 4, 5])`` read each id as a prompt and failed on ``int``."""
    with pytest.raises(TypeError, match=r"list of prompts, got one list of token ids; use generate\(\)"):
        dec.generate_batch(one, 4)


def test_a_tensor_of_rows_is_still_a_batch(dec):
    out = dec.generate_batch(torch.tensor([[3, 4], [5, 6]]), 2)
    assert [r.prompt_ids for r in out] == [[3, 4], [5, 6]]


@pytest.mark.parametrize("prompts, kind, msg", [
    ([[3, 4], [5, 99]], ValueError, r"^prompts\[1\]: prompt token id 99 .* outside the model's vocabulary"),
    ([[3, 4], [5, "x"]], TypeError, r"^prompts\[1\]: prompt token ids must be integers; position 1"),
    ([[3, 4], []], ValueError, r"^prompts\[1\]: prompt is empty"),
])
def test_a_bad_prompt_of_a_batch_is_named_by_its_index(dec, prompts, kind, msg):
    with pytest.raises(kind, match=msg) as info:
        dec.generate_batch(prompts, 4)
    assert type(info.value) is kind


@pytest.mark.parametrize("row, where", [({"top_p": 2}, "sampling[1].top_p"),
                                        ({"temprature": 0.5}, "sampling[1].temprature")])
def test_a_bad_row_sampling_names_its_row_and_field(dec, row, where):
    """A raw ``1 validation error for SamplingConfig`` named neither the row nor the call."""
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError, a ValueError
        dec.generate_batch([[3, 4], [5, 6]], 4, sampling=[{}, row])
    assert isinstance(info.value, ValidationError)
    text = str(info.value)
    assert text.startswith("1 validation error for generate_batch\n") and f"\n{where}\n" in text
    assert info.value.errors()[0]["loc"] == ("sampling[1]", where.split(".")[1])


@pytest.mark.parametrize("call", ["generate", "stream", "generate_batch"])
@pytest.mark.parametrize("bad, field", [({"temperature": -1.0}, "temperature"), (dict(seed=-3), "seed")])
def test_a_bad_sampling_argument_is_named_under_its_call(dec, call, bad, field):
    prompt = [[3, 4]] if call == "generate_batch" else [3, 4]
    with pytest.raises(ValidationError) as info:
        out = getattr(dec, call)(prompt, 4, **bad)
        next(iter(out))
    assert str(info.value).startswith(f"1 validation error for {call}\n{field}\n")


def test_a_row_sampling_replaces_the_config_sampling_not_merged():
    """The README's claim: a row's entry leaves out a field, and the row gets SamplingConfig's
    default for it (greedy), not the config's temperature."""
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "unused"},
                            "sampling": {"temperature": 5.0, "seed": 1}})
    hot = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3)), config=cfg)
    out = hot.generate_batch([[3, 4]] * 2, 12, sampling=[{"top_k": 5}, SamplingConfig(temperature=0.0)])
    assert out[0].token_ids == out[1].token_ids


def test_a_batch_given_to_generate_points_at_generate_batch(dec):
    """The mirror of the hint above: rows where one prompt goes name ``generate_batch()``."""
    for rows in ([[3, 4], [5, 6]], torch.tensor([[3, 4], [5, 6]])):
        with pytest.raises(TypeError, match=r"generate_batch\(\) takes several prompts"):
            dec.generate(rows, 2)
