"""Quality measures of a runtime's model: per-token log-probabilities through the runtime
contract equal the model's own, perplexity follows, and greedy agreement counts divergences."""

from __future__ import annotations

import math

import torch

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench.quality import greedy_agreement, perplexity, token_logprobs


def test_token_logprobs_and_perplexity_match_the_model():
    model = tiny_llama(seed=5, sharpness=3.0)
    ids = torch.randint(0, 32, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    rt = TorchRuntime(model)
    lp = token_logprobs(rt, ids, chunk=16)
    want = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(lp, want, atol=1e-4, rtol=1e-4)
    mask = [[j % 2 == 0 for j in range(len(ids))]]
    p = perplexity(rt, [ids], mask)
    assert p.tokens == sum(mask[0][1:])
    assert math.isclose(p.nll, float(-want[torch.tensor(mask[0][1:])].mean()), rel_tol=1e-4)
    assert rt.lengths() == []  # the runtime is left empty


def test_greedy_agreement():
    got = greedy_agreement([[1, 2, 3], [1, 2, 4], [1]], [[1, 2, 3], [1, 2, 3], [1, 2]])
    assert got == {"identical": 1, "of": 3, "first_difference": [None, 2, 1]}
