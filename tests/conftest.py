"""Tiny randomly initialised llama models, built in seconds, no files, no hub."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from spec_plugins.backends.torch_runtime import TorchRuntime


def tiny_llama(vocab: int = 32, seed: int = 0, sharpness: float = 1.0, layers: int = 2, hidden: int = 32,
               max_pos: int = 256):
    """A random LlamaForCausalLM; ``sharpness`` scales the LM head so distributions are peaky."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(sharpness)
        # random init leaves layer outputs tiny; widen the embeddings so context matters
        m.model.embed_tokens.weight.mul_(20.0)
    return m


def tiny_runtime(**kw) -> TorchRuntime:
    return TorchRuntime(tiny_llama(**kw))


@pytest.fixture
def target_model():
    return tiny_llama(seed=0, sharpness=8.0)


@pytest.fixture
def draft_model():
    return tiny_llama(seed=1, sharpness=8.0)


# ---- measured statistics a test reports (printed in the run's summary, not asserted) ------------
_REPORTS: list[str] = []


@pytest.fixture
def report():
    """``report(line)``: a measured statistic for the run's summary (e.g. how far llama.cpp's text
    drifts from one-token decoding on this build), where a bound would be build-dependent."""
    return _REPORTS.append


def pytest_terminal_summary(terminalreporter):
    if _REPORTS:
        terminalreporter.section("measured statistics")
        for line in _REPORTS:
            terminalreporter.write_line(line)
