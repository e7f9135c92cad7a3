"""A proposer's draft is checked where the batch places it (``api_inputs.check_draft``): a custom
proposer's bug is a ValueError naming it, not a crash deep inside a forward (an id outside the
vocabulary: IndexError on the CPU, a device-side assert on CUDA) nor a wrong output law (a q that
is no distribution, or gives its drafted token probability 0, which exact verification then
accepts every time)."""

from __future__ import annotations

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import ProposerConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.device_audit import HostSyncs
from spec_plugins.loop import Batch
from spec_plugins.proposers import Draft, Proposer
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

V = 64
PROMPTS = [[5, 17, 30, 42, 9], [3, 7, 1]]


class Scripted(Proposer):
    """Drafts what ``make(rows, depth)`` returns: a proposer bug under test."""

    class Config(ProposerConfig):
        type: str = "scripted"

    def __init__(self, make, k: int = 2) -> None:
        self.config = self.Config(num_draft_tokens=k)
        self.make = make

    def propose(self, ctx):
        return self.make(len(ctx.sequences), max(ctx.budgets))


def chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def point(B: int, n: int, token: int = 5) -> torch.Tensor:
    return torch.full((B, n), token, dtype=torch.long)


def q_at(B: int, n: int, token: int, width: int = V, scale: float = 1.0) -> torch.Tensor:
    """[B, n, width]: half the mass on ``token``, the rest spread evenly, times ``scale``."""
    q = torch.full((B, n, width), 0.5 / (width - 1))
    q[..., token] = 0.5
    return q * scale


def _negative(B, n):
    q = q_at(B, n, 5)
    q[..., 6] -= 0.1
    q[..., 7] += 0.1
    return Draft(point(B, n), chain(n), q)


def _partly_nan(B, n):
    q = q_at(B, n, 5)
    q[..., 9] = float("nan")
    return Draft(point(B, n), chain(n), q)


def _oov_invalid(B, n):
    tokens, valid = point(B, n), torch.ones(B, n, dtype=torch.bool)
    tokens[1, 1], valid[1, 1] = V + 100, False
    return Draft(tokens, chain(n), valid=valid)


BAD = {  # the hunt's repros: what the proposer returns -> what the error says
    "oov": (lambda B, n: Draft(point(B, n, V + 5), chain(n)), rf"token id {V + 5} \(row 0, node 0\) is outside "
                                                             rf"the target's vocabulary \(0\.\.{V - 1}\)"),
    "negative id": (lambda B, n: Draft(point(B, n, -3), chain(n)), "token id -3 .*outside"),
    "oov chains": (lambda B, n: Draft.from_chains([[1] * n, [V] * n]), rf"token id {V} \(row 1, node 0\)"),
    "oov on an invalid node": (_oov_invalid, rf"token id {V + 100} \(row 1, node 1\)"),  # the forward embeds it
    "rows": (lambda B, n: Draft(point(B + 1, n), chain(n)), r"tokens must be an integer tensor \[B=2, n\], got \[3,"),
    "float ids": (lambda B, n: Draft(point(B, n).float(), chain(n)), "tokens must be an integer tensor"),
    "parents": (lambda B, n: Draft(point(B, n), chain(n + 2)), f"parents must be {2} ints"),
    "parent after its child": (lambda B, n: Draft(point(B, n), (-1, 1)), "parents must be 2 ints.*each -1 or an earlier node"),
    "list": (lambda B, n: [[5] * n for _ in range(B)], "must return a Draft or None, got list"),
    "valid": (lambda B, n: Draft(point(B, n), chain(n), valid=torch.ones(B, dtype=torch.bool)),
              r"valid must be a bool tensor \[B=2, n=2\]"),
    "q narrow": (lambda B, n: Draft(point(B, n), chain(n), q_at(B, n, 5, V - 4)),
                 rf"probs must be a float tensor \[B=2, n=2, V={V}\].*got \[2, 2, {V - 4}\]"),
    "q wide": (lambda B, n: Draft(point(B, n), chain(n), q_at(B, n, 5, V + 4)), rf"got \[2, 2, {V + 4}\]"),
    "q x50": (lambda B, n: Draft(point(B, n), chain(n), q_at(B, n, 5, scale=50.0)), "sum to 50, not 1"),
    "q(x) = 0": (lambda B, n: Draft(point(B, n), chain(n), torch.eye(V)[6].expand(B, n, V)),
                 "token 5 .*has probability 0 under the draft's own probs"),
    "q negative": (_negative, "negative probability"),
    "q partly NaN": (_partly_nan, "not finite"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_draft_is_refused_naming_the_proposer(case):
    make, msg = BAD[case]
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(vocab=V, seed=3)), Scripted(make))
    with pytest.raises(ValueError, match=f"proposer Scripted returned a bad draft: .*{msg}"):
        dec.generate_batch(PROMPTS, 4, temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="proposer Scripted returned a bad draft"):
        dec.generate_batch(PROMPTS, 4)  # greedy rows: the draft is checked all the same


def _good(B: int, n: int) -> Draft:
    """A chain of 5s as deep as the budget whose q gives them half the mass; row 1 drafts one
    node, its others hold no distribution (an invalid node's q is never read); row 0's last node,
    whose q is NaN throughout (a row whose processors mask every token), is let through."""
    tokens = point(B, n)
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[1, 1:] = False
    q = q_at(B, n, 5)
    q[1, 1:] = 0.0
    q[0, n - 1] = float("nan")
    return Draft(tokens, chain(n), q, valid)


def test_a_well_formed_draft_passes_and_decodes_as_plain_greedy():
    model = tiny_llama(vocab=V, seed=3)
    dec = SpeculativeDecoder(TorchRuntime(model), Scripted(_good, k=3))
    got = dec.generate_batch(PROMPTS, 6)
    assert [g.token_ids for g in got] == [plain_greedy(model, p, 6) for p in PROMPTS]
    assert all(g.error is None for g in got)


def test_a_custom_draft_on_the_device_is_checked_and_the_package_s_own_is_not_read():
    """A draft on the device is read back (a host sync) only for a drafter that is not the package's
    own: the device-resident round of the built-in drafters keeps its one sync
    (``tests/test_host_syncs.py``)."""
    dev = torch.device("cpu", 0)  # a device unequal to the host's (``HostSyncs``)
    model = tiny_llama(vocab=V, seed=3)
    own = type("Own", (Scripted,), {"__module__": "spec_plugins.proposers.own"})
    with HostSyncs(dev) as syncs:
        for t in (*model.parameters(), *model.buffers()):
            syncs.mark(t)
        reads = {}
        for cls in (Scripted, own):
            rt = TorchRuntime(model)
            rt.device = dev
            batch = Batch(rt, cls(None), ExactVerifier())
            batch.add([RowRequest(i, p, 4) for i, p in enumerate(PROMPTS)])
            good = Draft(torch.full((2, 2), 5, dtype=torch.long, device=dev), chain(2))
            before = syncs.count
            batch.place(good)
            reads[cls.__name__] = syncs.count - before
            if cls is Scripted:
                with pytest.raises(ValueError, match="proposer Scripted .* outside the target's vocabulary"):
                    batch.place(Draft(torch.full((2, 2), V, dtype=torch.long, device=dev), chain(2)))
            batch.close()
    assert reads["Scripted"] >= 1 and reads["Own"] == 0
