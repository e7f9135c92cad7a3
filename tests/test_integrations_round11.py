"""Integration inputs that were accepted and then ignored or misread: a ``spec_config`` sampling
section the transformers plugin dropped (decoding greedily), and a vLLM row still in prefill whose
request the adapter took for finished."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from helpers import hf_generate
from test_vllm_adapter import call, ours, vllm_config

from spec_plugins.config import ConfigError, SpecConfig
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.integrations.vllm import NgramDrafter, SuffixDrafter

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
PAD = 0
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3]]
NGRAM = {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 3}


def _generate(model, spec_config, **kw) -> list[list[int]]:
    """The new tokens of a left-padded ``generate(custom_generate=speculative_generate)``."""
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, pad_token_id=PAD,
                         custom_generate=speculative_generate, spec_config=spec_config, **kw)
    return out[:, width:].tolist()


# ---- transformers plugin: spec_config's sampling section -----------------------------------------
@pytest.mark.parametrize("form", ["path", "dict", "SpecConfig"])
def test_a_sampling_section_is_refused_not_dropped(form):
    """examples/configs/smollm2-ngram-sampling.yaml (temperature 0.8, top-p 0.95) decoded greedily
    through generate(): the section was dropped without a word. Every form of spec_config is now
    refused, naming the section's fields and where the call's sampling comes from."""
    path = CONFIGS / "smollm2-ngram-sampling.yaml"
    spec = {"path": str(path),
            "dict": {"proposer": NGRAM, "sampling": {"temperature": 0.8, "top_p": 0.95}},
            "SpecConfig": SpecConfig.from_file(path)}[form]
    with pytest.raises(ConfigError) as err:
        _generate(tiny_llama(vocab=64, seed=0), spec, do_sample=True)
    msg = str(err.value)
    for needle in ("sampling section", "temperature=0.8", "top_p=0.95", "generate()'s own arguments",
                   "do_sample=True"):
        assert needle in msg, msg
    if form == "path":
        assert str(path) in msg, msg


@pytest.mark.parametrize("config", ["smollm2-ngram.yaml", "smollm2-default.yaml", "smollm2-ngram-bench.yaml"])
def test_shipped_configs_with_the_default_sampling_section_still_decode(config):
    """The shipped configs people pass keep ``sampling: {temperature: 0.0, seed: 0}`` (the
    default): they decode as transformers' own greedy generate() does."""
    out = _generate(tiny_llama(vocab=64, seed=0), str(CONFIGS / config), do_sample=False)
    assert out == hf_generate(tiny_llama(vocab=64, seed=0), PROMPTS, 10, PAD)


def test_a_default_sampling_section_samples_as_generates_arguments_say():
    """A default section leaves sampling to generate()'s arguments: the same draws as a spec_config
    with no sampling section at all, under the same torch seed."""
    model = tiny_llama(vocab=64, seed=0)
    runs = []
    for spec in ({"proposer": NGRAM}, {"proposer": NGRAM, "sampling": {"temperature": 0.0, "seed": 0}}):
        torch.manual_seed(7)
        runs.append(_generate(model, spec, do_sample=True, temperature=0.9, top_k=20))
    assert runs[0] == runs[1]


# ---- vLLM adapter: a row still in prefill ---------------------------------------------------------
def test_a_row_in_prefill_keeps_its_index_and_enters_the_global_index_once():
    """A running row with no sampled tokens for a step (vLLM re-prefilling it in chunks) was taken
    for finished: its partial history entered the global index, it was indexed anew when it went
    on, and entered the global index a second time when it ended. It now keeps its index."""
    d = SuffixDrafter(vllm_config(), {"type": "suffix", "scope": "global"})
    h = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    call(d, [h], [[10]])
    idx = d.rows.held[0]
    assert call(d, [h], [[]]) == [[]]  # prefilling: no draft, not finished
    assert d.index.stats.requests == 0 and d.rows.held == [idx]
    call(d, [h + [11]], [[11]])
    assert d.rows.held[0] is idx and idx.tokens == h + [11]  # extended, not rebuilt
    call(d, [], [])  # it leaves the batch: finished, once
    assert d.index.stats.requests == 1 and d.index.stats.tokens == len(h) + 1


def test_ngram_drafts_resume_after_a_prefill_step_and_decoding_rows_claim_first():
    """After a prefill step a row drafts what our ngram proposer drafts on its whole history, on
    the index it kept; a new prompt in prefill repeating a running request's history (ahead of it
    in the batch) does not take that request's index."""
    d = NgramDrafter(vllm_config(), {"type": "ngram", "max_ngram": 3})
    a = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert call(d, [a], [[2]]) == [ours(a)]
    idx = d.rows.held[0]
    assert call(d, [a], [[]]) == [[]]
    a2 = a + [3]
    assert call(d, [a, a2], [[], [3]]) == [[], ours(a2)]  # row 0: a new prompt equal to a's old history
    assert d.rows.held[0] is idx and idx.tokens == a2
