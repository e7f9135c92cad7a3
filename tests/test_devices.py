"""Device placement, as far as this machine allows: a runtime wrapper checks that everything the
round hands the runtime is on the runtime's device (with the right dtypes), and a verifier
wrapper checks that every tensor it combines is on the logits' device. On a CPU-only machine
that is one device; ``scripts/gpu_check.sh`` runs this file on CUDA too (``--device cuda``
cases run wherever torch sees a GPU), where a host tensor mixed into the verifier would raise.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class DeviceChecked:
    """A runtime seen through a contract check: inputs on ``device``, long token ids."""

    def __init__(self, inner: TorchRuntime) -> None:
        self.inner, self.device = inner, inner.device
        self.capabilities, self.vocab_size, self.max_context = inner.capabilities, inner.vocab_size, inner.max_context
        self.forwards = 0

    def forward(self, tokens, tree=None, want_hidden=False):
        assert isinstance(tokens, torch.Tensor) and tokens.dtype == torch.long, tokens
        assert tokens.device == self.device, f"forward got tokens on {tokens.device}, runtime on {self.device}"
        self.forwards += 1
        out = self.inner.forward(tokens, tree, want_hidden)
        assert out.logits.device == self.device
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class CheckedVerifier(ExactVerifier):
    """The exact verifier, asserting that the tensors it combines share the logits' device."""

    calls = 0

    def __call__(self, x, parents, target_logits, q, pipeline, generator, valid=None):
        dev = target_logits.device
        for name, t in (("draft tokens", x), ("draft probs", q), ("valid", valid)):
            assert t is None or t.device == dev, f"{name} on {t.device}, logits on {dev}"
        assert generator is None or generator.device == dev, f"generator on {generator.device}, logits on {dev}"
        type(self).calls += 1
        return super().__call__(x, parents, target_logits, q, pipeline, generator, valid)


def _run(rt, proposer, pipeline, prompts, n, gen=None):
    outs = [[] for _ in prompts]
    for step in decode(rt, proposer, CheckedVerifier(), pipeline, prompts, n, (), gen, None, FixedLength(3)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["ngram", "recycling", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_round_keeps_every_tensor_on_the_runtime_device(device, kind, temperature):
    model = tiny_llama(seed=3, sharpness=2.0).to(device)
    rt = DeviceChecked(TorchRuntime(model))
    proposer = {"ngram": lambda: NgramProposer(NgramProposer.Config()),
                "recycling": lambda: RecyclingProposer(RecyclingProposer.Config(), target=rt),
                "draft": lambda: DraftModelProposer(None, target=rt,
                                                    runtime=TorchRuntime(tiny_llama(seed=4).to(device)))}[kind]()
    pipe = LogitsPipeline(SamplingConfig(temperature=temperature, top_k=8 if temperature else None))
    gen = torch.Generator(device=device).manual_seed(0) if temperature else None
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7], [9]]
    CheckedVerifier.calls = 0
    outs = _run(rt, proposer, pipe, prompts, 12, gen)
    assert all(len(o) == 12 for o in outs) and rt.forwards > 0 and CheckedVerifier.calls > rt.forwards // 2
    if temperature == 0.0:
        from helpers import plain_greedy

        cpu_model = model.to("cpu")
        assert outs == [plain_greedy(cpu_model, p, 12) for p in prompts]


@pytest.mark.parametrize("device", DEVICES)
def test_server_batch_generators_live_on_the_runtime_device(device):
    from spec_plugins.loop import Batch
    from spec_plugins.types import RowRequest

    rt = DeviceChecked(TorchRuntime(tiny_llama(seed=3).to(device)))
    batch = Batch(rt, NgramProposer(NgramProposer.Config()), CheckedVerifier(), seed=1)
    assert batch.generator.device == rt.device
    batch.add([RowRequest("a", [1, 2, 3], 5, SamplingConfig(temperature=0.7), seed=3)])
    assert batch.rows[0].generator.device == rt.device


# ---- the device audit: every proposer, built and run for a few rounds ------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["ngram", "suffix", "recycling", "lookahead", "draft", "medusa-tree",
                                  "medusa-chain", "eagle-chain", "eagle-tree", "hybrid"])
def test_no_tensor_is_made_without_its_device(kind, rows, device, tmp_path):
    """Building a proposer and running rounds through it creates no tensor without an explicit
    device, and mixes no devices in one call (``spec_plugins/device_audit.py``): on a CPU this is
    what finds a head built on the host or a per-round mask made on the host, which crash (or
    copy and sync every round) once the target is on CUDA. One row greedy; three rows of
    different lengths (holes) sampled."""
    from spec_plugins.device_audit import DeviceAudit

    from helpers import EVERY_PROPOSER, every_proposer, save_random_heads

    assert kind in EVERY_PROPOSER
    model = tiny_llama(seed=3, sharpness=2.0)
    heads = save_random_heads(model, tmp_path)
    model = model.to(device)
    temperature = 0.0 if rows == 1 else 0.9
    pipe = LogitsPipeline(SamplingConfig(temperature=temperature, top_k=8 if temperature else None))
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]][:rows]
    with DeviceAudit() as audit:
        rt = DeviceChecked(TorchRuntime(model, matmul="native"))
        proposer = every_proposer(kind, rt, heads, draft=lambda: TorchRuntime(tiny_llama(seed=4).to(device)))
        gen = torch.Generator(device=device).manual_seed(0) if temperature else None
        outs = _run(rt, proposer, pipe, prompts, 10, gen)
    assert all(len(o) == 10 for o in outs)
    assert not audit.leaks, f"{kind}: tensors made without a device or across devices:\n{audit.report()}"
