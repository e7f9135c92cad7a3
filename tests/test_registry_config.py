"""Registry (decorators + entry points) and config validation."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tiny_llama
from spec_plugins import SpecConfig, SpeculativeDecoder
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import ConfigError, default_config
from spec_plugins.registry import PROPOSERS, Registry, RegistryError


def _install_fake_dist(tmp_path: Path, monkeypatch) -> None:
    """A third-party package on sys.path with a real dist-info entry point (no pip needed)."""
    pkg = tmp_path / "thirdparty_drafter"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from typing import Literal
        from spec_plugins.config import ProposerConfig
        from spec_plugins.proposers.base import Draft, Proposer

        class RepeatLast(Proposer):
            """Drafts the last token again, num_draft_tokens times."""
            class Config(ProposerConfig):
                type: Literal["repeat_last"] = "repeat_last"
                bonus: int = 0

            def __init__(self, config, **_):
                self.config = config

            def propose(self, ctx):
                return Draft.from_chains([[s[-1]] * k for s, k in zip(ctx.sequences, ctx.budgets)])
    '''))
    dist = tmp_path / "thirdparty_drafter-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-drafter\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[spec_plugins.proposers]\nrepeat_last = thirdparty_drafter:RepeatLast\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_third_party_proposer_via_entry_point(tmp_path, monkeypatch):
    _install_fake_dist(tmp_path, monkeypatch)
    monkeypatch.setattr(PROPOSERS, "_entry_points_loaded", False)
    assert "repeat_last" in PROPOSERS.names()
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "unused"},
                            "proposer": {"type": "repeat_last", "num_draft_tokens": 3}})
    assert type(cfg.proposer).__name__ == "Config" and cfg.proposer.num_draft_tokens == 3
    model = tiny_llama(seed=3)
    dec = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model))
    out = dec.generate([4, 4, 4, 4], max_new_tokens=12)
    plain = dec.without_speculation().generate([4, 4, 4, 4], max_new_tokens=12)
    assert out.token_ids == plain.token_ids
    assert out.stats.draft_tokens > 0
    sys.modules.pop("thirdparty_drafter", None)


def test_registry_refuses_duplicates_and_names_known():
    reg: Registry[object] = Registry("widget", "spec_plugins.widgets")

    @reg.register("a")
    class A: ...

    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a")(type("B", (), {}))
    with pytest.raises(RegistryError, match="registered: a"):
        reg.get("zzz")
    with pytest.raises(TypeError):
        reg.view()["b"] = 1  # read-only


def test_lazy_entry_with_missing_dependency_gives_install_hint():
    reg: Registry[object] = Registry("backend", "spec_plugins.nothing")
    reg.add_lazy("fancy", "definitely_not_installed_mod:Thing", install_hint="pip install 'spec-plugins[fancy]'")
    with pytest.raises(RegistryError, match=r"spec-plugins\[fancy\]"):
        reg.get("fancy")


def test_yaml_and_json_configs(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(textwrap.dedent("""
        target:   {backend: torch, model: smollm2-135m-instruct, dtype: float32}
        proposer: {type: ngram, num_draft_tokens: 5, max_ngram: 3}
        verifier: {type: exact}
        sampling: {temperature: 0.0, top_k: null, top_p: null, seed: 0}
    """))
    a = SpecConfig.from_file(y)
    j = tmp_path / "c.json"
    j.write_text(json.dumps(a.model_dump(mode="json")))
    b = SpecConfig.from_file(j)
    assert a == b and a.proposer.max_ngram == 3
    assert SpecConfig.model_validate(a.model_dump()) == a
    assert default_config().proposer.type == "ngram"


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"target": {"backend": "tpu", "model": "x"}}, "allowed values"),
        ({"target": {"backend": "torch", "model": "x", "dtype": "int3"}}, "dtype"),
        ({"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "magic"}}, "allowed values: .*draft_model.*ngram"),
        ({"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "ngram", "max_ngram": 0}}, "max_ngram"),
        ({"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "ngram", "min_ngram": 4}}, "min_ngram"),
        ({"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "ngram", "num_draft_tokens": "many"}},
         "num_draft_tokens"),
        ({"target": {"backend": "torch", "model": "x"}, "sampling": {"temperature": -1}}, "temperature"),
        ({"target": {"backend": "torch", "model": "x"}, "sampling": {"top_p": 1.5}}, "top_p"),
        ({"target": {"backend": "torch", "model": "x"}, "bogus": 1}, "bogus"),
        ({"proposer": {"type": "ngram"}}, "target"),
    ],
)
def test_invalid_configs_name_the_field(data, needle):
    with pytest.raises(ConfigError, match=needle):
        SpecConfig.parse(data)


def test_default_config_file_matches_built_in_default() -> None:
    """examples/configs/smollm2-default.yaml is what benches use as 'the built-in default'."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples/configs/smollm2-default.yaml"
    written = SpecConfig.from_file(path).model_dump(exclude={"source"})
    assert written == default_config().model_dump(exclude={"source"})


@pytest.mark.parametrize("name, text, needle", [
    ("top.yaml", "target: {backend: torch, model: smollm2-135m-instruct}\nproposer: {type: ngram}\n"
                 "proposer: {type: ngram, num_draft_tokens: 2}\n", r"\(line 3, column 1\): duplicate key `proposer`"),
    ("inner.yaml", "target: {backend: torch, model: smollm2-135m-instruct, model: gemma-3-270m}\n",
     r"\(line 1, column 56\): duplicate key `model`"),
    ("c.json", '{"target": {"backend": "torch", "model": "x"}, "sampling": {"temperature": 0.7, "temperature": 0}}',
     "duplicate key `temperature`"),
], ids=["yaml-top-level", "yaml-nested", "json"])
def test_a_config_file_naming_a_key_twice_is_refused(tmp_path, name, text, needle):
    """The last value would silently win (a temperature of 0 where 0.7 was meant): refused, naming
    the key, the file and (YAML) the line and column of the second one."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as err:
        SpecConfig.from_file(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("section, fields", [
    ("proposer: {type: ngram, num_draft_tokens: yes}", ["num_draft_tokens"]),
    ("sampling: {temperature: true, top_k: on, seed: no}", ["temperature", "top_k", "seed"]),
    ("sampling: {top_p: true}", ["top_p"]),
], ids=["int-or-auto", "several", "float-or-none"])
def test_a_yaml_boolean_for_a_number_is_refused_naming_the_field(tmp_path, section, fields):
    """YAML 1.1 reads ``yes``/``on``/``true`` as booleans, which pydantic took as 1 (``num_draft_tokens:
    yes`` drafted 1 token): refused, naming each field; an on/off switch still takes them."""
    path = tmp_path / "c.yaml"
    path.write_text(f"target: {{backend: torch, model: smollm2-135m-instruct}}\n{section}\n")
    with pytest.raises(ConfigError) as err:
        SpecConfig.from_file(path)
    assert all(f"{f}: expected a number, got the boolean" in str(err.value) for f in fields), err.value
    path.write_text("target: {backend: torch, model: smollm2-135m-instruct, compile: on, kv: static}\n"
                    "proposer: {type: ngram, num_draft_tokens: 3}\n")
    assert SpecConfig.from_file(path).target.compile == "on"
