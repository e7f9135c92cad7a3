"""Hardening round 9: plugin classes must carry the Config their configs are validated by, a proposer
instance's config is its ProposerConfig, and a draft may not reach past a row's budget."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pydantic
import pytest
from conftest import tiny_llama
from support import fake_dist

from spec_plugins.api_inputs import check_draft
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import ConfigError, ProposerConfig, SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.proposers import Draft, Proposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.registry import PROPOSERS, Registry, _check_proposer, _check_runtime


def _proposer(config: type | None) -> type:
    """A proposer class meeting the contract, with ``config`` as its ``Config`` (None: none)."""
    body = {"propose": lambda self, ctx: None, "__init__": lambda self, config, **_: setattr(self, "config", config)}
    if config is not None:
        body["Config"] = config
    return type("Thirdparty", (Proposer,), body)


@dataclasses.dataclass
class _DataclassConfig:
    type: str = "thirdparty"


class _PlainModel(pydantic.BaseModel):
    type: Literal["thirdparty"] = "thirdparty"


class _OtherName(ProposerConfig):
    type: Literal["other"] = "other"


class _NoDefault(ProposerConfig):
    type: str


@pytest.mark.parametrize("config, says", [
    (None, "got none"), (_DataclassConfig, "got _DataclassConfig"), (_PlainModel, "got _PlainModel"),
    (_OtherName, "default to 'thirdparty'.*the default 'other'"), (_NoDefault, "no default")])
def test_registration_refuses_a_proposer_without_its_proposer_config(config, says):
    """Such a class registered, and a config naming it crashed with a raw AttributeError
    (``cls.Config.model_validate``) or failed on a field the user never got wrong."""
    reg: Registry[object] = Registry("proposer", "spec_plugins.round9.none", check=_check_proposer)
    with pytest.raises(TypeError, match=f"proposer Thirdparty.*{says}"):
        reg.register("thirdparty")(_proposer(config))
    assert "thirdparty" not in reg.names()


def test_registration_refuses_a_runtime_whose_config_names_another_backend():
    """A runtime subclass keeping its parent's Config (``backend: torch``) cannot be configured by
    the name it registers under."""
    reg: Registry[object] = Registry("backend", "spec_plugins.round9.none", check=_check_runtime)
    with pytest.raises(TypeError, match="runtime Mine: its Config's backend must default to 'mine'.*'torch'"):
        reg.register("mine")(type("Mine", (TorchRuntime,), {}))
    assert "mine" not in reg.names()


def test_an_entry_point_proposer_without_a_config_is_a_config_error(tmp_path, monkeypatch):
    """The config check (and the CLI) printed an AttributeError traceback."""
    fake_dist(tmp_path, monkeypatch, "noconf_plug", """
        from spec_plugins.proposers import Proposer
        class NoConfig(Proposer):
            def propose(self, ctx):
                return None
    """, "[spec_plugins.proposers]\nnoconf = noconf_plug:NoConfig\n")
    for attr in ("_lazy", "_from_entry_points"):  # the entry point's traces leave with the test
        monkeypatch.setattr(PROPOSERS, attr, type(getattr(PROPOSERS, attr))(getattr(PROPOSERS, attr)))
    monkeypatch.setattr(PROPOSERS, "_entry_points_loaded", False)
    with pytest.raises(ConfigError, match=r"entry point noconf = noconf_plug:NoConfig .*cannot be used: proposer "
                                          r"NoConfig must carry a Config class subclassing .*ProposerConfig"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "noconf"}})


class _Mine(Proposer):
    class Config(ProposerConfig):
        type: Literal["mine"] = "mine"

    def __init__(self, config) -> None:
        self.config = config

    def propose(self, ctx):
        return Draft.from_chains([[s[-1]] * min(2, b) for s, b in zip(ctx.sequences, ctx.budgets)])


@pytest.mark.parametrize("config", [{"num_draft_tokens": 3}, "ngram"])
def test_a_proposer_instance_whose_config_is_no_proposer_config_is_refused_naming_it(config):
    """A dict crashed inside the draft policy (``'dict' object has no attribute 'num_draft_tokens'``),
    not naming the proposer. (None is no section: the policy's defaults, as a draft model built
    without one has.)"""
    with pytest.raises(TypeError, match="proposer _Mine: its config must be a ProposerConfig"):
        SpeculativeDecoder(TorchRuntime(tiny_llama(vocab=32)), _Mine(config))


def test_a_proposer_instance_with_its_proposer_config_runs():
    """The same proposer with its section (or another proposer's) decodes as before."""
    rt = TorchRuntime(tiny_llama(vocab=32))
    for config in (_Mine.Config(num_draft_tokens=2), NgramProposer.Config(num_draft_tokens=2), None):
        out = SpeculativeDecoder(rt, _Mine(config)).generate_batch([[1, 2, 3]], 4)[0]
        assert out.token_ids == SpeculativeDecoder(rt).generate_batch([[1, 2, 3]], 4)[0].token_ids


def test_a_draft_deeper_than_its_rows_budget_is_refused_naming_both_numbers():
    """A proposer asked for 2 tokens that drafted 8 had all 8 verified and committed, past the row's
    token limit and the target's context."""
    with pytest.raises(ValueError, match="proposer Repeat returned a bad draft: row 0 is drafted 8 tokens deep, "
                                         "past its budget of 2"):
        check_draft(Draft.from_chains([[5] * 8]), 1, 64, "Repeat", values=True, budgets=[2])
    with pytest.raises(ValueError, match="row 1 is drafted 4 tokens deep, past its budget of 3"):
        check_draft(Draft.from_chains([[5] * 2, [5] * 4]), 2, 64, "Repeat", values=False, budgets=[4, 3])


def test_a_draft_within_each_rows_budget_passes():
    """Rows padded past their own chains (valid False), a tree as deep as the budget and a row with
    no budget and no valid node all pass."""
    check_draft(Draft.from_chains([[5] * 4, [5], []]), 3, 64, "Repeat", values=True, budgets=[4, 1, 0])
    tree = Draft.from_chains([[5, 6, 7]])
    tree = Draft(tree.tokens, (-1, -1, 0))  # two children of the pending token, one grandchild: 2 deep
    check_draft(tree, 1, 64, "Tree", values=False, budgets=[2])
    with pytest.raises(ValueError, match="row 0 is drafted 2 tokens deep, past its budget of 1"):
        check_draft(tree, 1, 64, "Tree", values=False, budgets=[1])


def test_registration_refuses_a_verifier_without_its_verifier_config():
    """Verifiers had no registry check: one without a ``VerifierConfig`` registered, and the first
    config naming it failed as a raw ``AttributeError`` (``cls.Config.model_validate``)."""
    from spec_plugins.registry import _check_verifier
    from spec_plugins.verifiers import ExactVerifier

    reg: Registry[object] = Registry("verifier", "spec_plugins.round9.none", check=_check_verifier)
    with pytest.raises(TypeError, match="verifier Bare must carry a Config class subclassing "
                                        "spec_plugins.config.VerifierConfig"):
        reg.register("bare")(type("Bare", (), {}))
    with pytest.raises(TypeError, match="verifier Mine: its Config's type must default to 'mine'.*'exact'"):
        reg.register("mine")(type("Mine", (ExactVerifier,), {}))
    assert reg.names() == []
    reg.register("exact")(ExactVerifier)
    assert reg.get("exact") is ExactVerifier
