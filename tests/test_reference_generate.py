"""Greedy speculative output equals transformers' own ``model.generate(do_sample=False)``: an
independent reference (not our plain decoding), for every proposer, one row and a batch with
holes, on the growing (dynamic) and the static KV cache.

The batch's reference is one left-padded ``generate`` call (attention mask, pad token set), checked
here to equal ``generate`` on each row alone, so the padding cannot hide a difference."""

from __future__ import annotations

import pytest
import torch
from helpers import EVERY_PROPOSER, every_proposer, hf_generate, save_random_heads

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.backends.torch_static import StaticTorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]]  # lengths 7, 9, 2: holes
N = 16
PAD = 0  # a token of the vocabulary (32); masked out, it changes nothing (checked below)
RUNTIMES = {"dynamic": lambda m: TorchRuntime(m, matmul="native"), "static": StaticTorchRuntime}


def generate(model, prompts) -> list[list[int]]:
    return hf_generate(model, prompts, N, PAD)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_llama(seed=3, sharpness=2.0)
    return model, save_random_heads(model, tmp_path_factory.mktemp("heads"))


def test_the_left_padded_reference_equals_generate_on_each_row_alone(target):
    model, _ = target
    assert generate(model, PROMPTS) == [generate(model, [p])[0] for p in PROMPTS]


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", EVERY_PROPOSER)
def test_greedy_output_equals_transformers_generate(target, kind, rows, runtime):
    model, heads = target
    prompts = PROMPTS[:rows]
    make = RUNTIMES[runtime]
    rt = make(model)
    proposer = every_proposer(kind, rt, heads, draft=lambda: make(model))
    outs = [[] for _ in prompts]
    for step in decode(rt, proposer, ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, N, (), None, None,
                       FixedLength(3)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    assert outs == generate(model, prompts), (kind, rows, runtime)
