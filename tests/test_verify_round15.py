"""Round 15: an undeclared verifier is never counted exact, a q whose sum misses 1 (within
``api_inputs.Q_SUM_TOLERANCE``) verifies to the target's law, and the transformers plugin says
when the verifier it samples through is lossy."""

from __future__ import annotations

import warnings
from typing import Literal

import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_llama
from spec_plugins import verify
from spec_plugins.config import VerifierConfig
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.registry import Registry, RegistryError, _check_verifier
from spec_plugins.verifiers import ExactVerifier

S = 0.99  # a q row's sum as a foreign proposer may hand it (Q_SUM_TOLERANCE lets 1 +- 1e-2 through)


# ---- 1. a verifier must declare lossy ---------------------------------------------------------
class NoLossy:
    """Accepts every drafted token (plainly lossy) and never says so."""

    class Config(VerifierConfig):
        type: Literal["no_lossy"] = "no_lossy"

    def __init__(self, config: VerifierConfig | None = None) -> None:
        self.config = config or self.Config()


class StrLossy(NoLossy):
    lossy = "yes"


class Declared(NoLossy):
    lossy = True


def test_registration_refuses_a_verifier_that_does_not_declare_lossy():
    """``Batch`` reads ``lossy`` off the verifier (absent: exact), so an undeclared accept-all
    verifier decoded with ``stats.lossy`` False and ``spec_lossy 0``."""
    reg: Registry[object] = Registry("verifier", "spec_plugins.round15.none", check=_check_verifier)
    with pytest.raises(TypeError, match=r"verifier NoLossy must declare lossy: ClassVar\[bool\].*declares nothing"):
        reg.register("no_lossy")(NoLossy)
    with pytest.raises(TypeError, match="verifier StrLossy must declare lossy.*declares 'yes'"):
        reg.register("no_lossy")(StrLossy)
    assert reg.names() == []
    assert reg.register("no_lossy")(Declared) is Declared
    reg.register("exact")(ExactVerifier)  # the package's own (and subclasses) declare it


def test_a_lazy_verifier_without_lossy_is_refused_naming_its_entry():
    reg: Registry[object] = Registry("verifier", "spec_plugins.round15.none", check=_check_verifier)
    reg.add_lazy("no_lossy", f"{__name__}:NoLossy")
    with pytest.raises(RegistryError, match="verifier 'no_lossy'.*cannot be used: verifier NoLossy must declare lossy"):
        reg.get("no_lossy")


# ---- 2. q normalised where the verifier reads it ---------------------------------------------
P = torch.tensor([0.03, 0.47, 0.50])  # target at the drafted node
QN = torch.tensor([0.01, 0.49, 0.50])  # the law the drafter samples from (q / sum(q))


def _chain_law(p: torch.Tensor, q: torch.Tensor, qn: torch.Tensor) -> torch.Tensor:
    """The one-step output law of the chain rule run with ``q`` on drafts drawn from ``qn``."""
    acc = torch.clamp(p / q, max=1.0)
    resid = (p - q).clamp_min(0)
    return qn * acc + (1 - (qn * acc).sum()) * resid / resid.sum()


def test_acceptance_and_residual_use_the_normalised_q(monkeypatch):
    """Closed form on the rule's internals: uniform draws on a grid make the acceptance rate of a
    drafted token exactly min(1, p/q) up to 1/B, and a token with p = 0 is always rejected, so the
    distribution handed to ``sample`` is the residual; both must use q / sum(q)."""
    B, V = 20000, 3
    grid = (torch.arange(B, dtype=torch.float32)[:, None] + 0.5) / B
    monkeypatch.setattr(torch, "rand", lambda b, n, generator=None, device=None: grid[:b].expand(b, n).clone())
    p = P.expand(B, 2, V).contiguous()
    q = (QN * S).expand(B, 1, V).contiguous()
    v = verify.rejection_verify(torch.full((B, 1), 1), (-1,), p, q, torch.Generator().manual_seed(0))
    accepted = v.path[:, 0].float().mean().item()
    assert abs(accepted - (P[1] / QN[1]).item()) < 2 / B  # raw q gives P[1] / (S * QN[1]): 1/99 higher
    seen = []
    monkeypatch.setattr(verify, "sample", lambda probs, gen: seen.append(probs.clone()) or probs.argmax(-1))
    p0 = torch.tensor([0.0, 0.6, 0.4])
    q0 = torch.tensor([0.5, 0.2, 0.3])
    verify.rejection_verify(torch.zeros(4, 2, dtype=torch.long), (-1, 0), torch.stack([p0, P, P])[None].expand(4, 3, V),
                            torch.stack([q0, QN])[None].expand(4, 2, V) * S, None)
    resid = seen[-1] / seen[-1].sum(-1, keepdim=True)
    want = (p0 - q0).clamp_min(0)
    assert torch.allclose(resid, (want / want.sum()).expand(4, V), atol=1e-6), resid


def test_chain_output_law_is_the_target_with_q_summing_to_099():
    """End to end: drafts drawn from q / sum(q), verified with q as handed; the first emitted token
    follows p (chi-square), and the same sample size rejects the raw-q rule's law (power)."""
    N, V = 400_000, 3
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(QN, N, replacement=True, generator=gen)[:, None]
    v = verify.rejection_verify(x, (-1,), P.expand(N, 2, V).contiguous(), (QN * S).expand(N, 1, V).contiguous(), gen)
    first = torch.where(v.path[:, 0], x[:, 0], v.next)
    obs = torch.bincount(first, minlength=V).double().numpy()
    assert chisquare(obs, (P.double() * N).numpy()).pvalue > 1e-4
    biased = _chain_law(P.double(), QN.double() * S, QN.double())
    assert 0.5 * (biased - P.double()).abs().sum() > 4e-3  # the raw-q law differs from p
    power = torch.bincount(torch.multinomial(biased.float(), N, replacement=True, generator=gen), minlength=V)
    assert chisquare(power.double().numpy(), (P.double() * N).numpy()).pvalue < 1e-8


def test_a_normalised_q_and_point_masses_verify_as_before():
    """A q that sums to 1 (the package's drafters) keeps its law: the rule's closed form; q None
    (point masses) is the follow-the-samples walk, untouched."""
    N, V = 400_000, 3
    gen = torch.Generator().manual_seed(1)
    x = torch.multinomial(QN, N, replacement=True, generator=gen)[:, None]
    v = verify.rejection_verify(x, (-1,), P.expand(N, 2, V).contiguous(), QN.expand(N, 1, V).contiguous(), gen)
    first = torch.where(v.path[:, 0], x[:, 0], v.next)
    assert chisquare(torch.bincount(first, minlength=V).double().numpy(), (P.double() * N).numpy()).pvalue > 1e-4
    y = torch.tensor([[1, 2], [0, 1]])
    pm = torch.nn.functional.one_hot(y, V).float()  # p a point mass at y per position
    pt = verify.rejection_verify(torch.tensor([[1], [1]]), (-1,), pm, None, torch.Generator().manual_seed(0))
    assert pt.path.tolist() == [[True], [False]] and pt.next.tolist() == [2, 0]


# ---- 3. the transformers plugin warns when it samples through a lossy verifier ---------------
def _lossy_warnings(verifier: str, do_sample: bool) -> list[warnings.WarningMessage]:
    model = tiny_llama(seed=3)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        model.generate(torch.tensor([[5, 6, 7, 5, 6, 7, 5]]), attention_mask=torch.ones(1, 7, dtype=torch.long),
                       max_new_tokens=6, do_sample=do_sample, pad_token_id=0, custom_generate=speculative_generate,
                       spec_config={"proposer": {"type": "ngram", "num_draft_tokens": 2},
                                    "verifier": {"type": verifier}})
    return [w for w in got if issubclass(w.category, UserWarning) and "lossy" in str(w.message)]


def test_transformers_plugin_warns_once_per_sampled_call_through_a_lossy_verifier():
    got = _lossy_warnings("typical", do_sample=True)
    assert len(got) == 1 and "'typical' verifier is lossy" in str(got[0].message)
    assert _lossy_warnings("exact", do_sample=True) == []
    assert _lossy_warnings("typical", do_sample=False) == []  # greedy match: exact with any verifier
