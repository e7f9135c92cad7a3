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
from support import fake_dist


def _install_fake_dist(tmp_path: Path, monkeypatch) -> None:
    fake_dist(tmp_path, monkeypatch, "thirdparty_drafter", '''
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
    ''', "[spec_plugins.proposers]\nrepeat_last = thirdparty_drafter:RepeatLast\n")


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
    ("proposer: {type: recycling, paths: [[0], [0, 1], [yes]]}", ["paths[2][0]"]),
], ids=["int-or-auto", "several", "float-or-none", "nested-in-a-list"])
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


@pytest.mark.parametrize("data, needle", [
    ({"proposer": {"type": ["ngram"]}}, "proposer: type must be a proposer name (a string), got list ['ngram']"),
    ({"proposer": {"type": {"a": 1}}}, "proposer: type must be a proposer name (a string), got dict"),
    ({"target": {"backend": ["torch"], "model": "x"}}, "target: backend must be a backend name (a string), got list"),
    ({"verifier": {"type": ["exact"]}}, "verifier: type must be a verifier name (a string), got list"),
    ({"proposer": {"type": "hybrid", "proposers": [{"type": "suffix", "tree_nodes": 8}, {"type": ["x"]}]}},
     "proposer: hybrid: proposers[1]: type must be a proposer name (a string), got list ['x']"),
], ids=["type-list", "type-dict", "backend-list", "verifier-list", "hybrid-child-list"])
def test_a_plugin_name_that_is_not_a_string_is_refused_naming_the_field(data, needle):
    """A YAML list or mapping where a plugin's name belongs (``type: [ngram]``) was a raw
    ``TypeError: unhashable type`` from the registry lookup: refused, naming the field."""
    with pytest.raises(ConfigError) as err:
        SpecConfig.parse({"target": {"backend": "torch", "model": "x"}, **data})
    assert needle in str(err.value) and "allowed values" in str(err.value), err.value


@pytest.fixture
def fresh_entry_points(monkeypatch):
    """The global registries reload their entry points in this test and forget them after."""
    from spec_plugins.registry import BACKENDS

    for reg in (PROPOSERS, BACKENDS):
        monkeypatch.setattr(reg, "_entry_points_loaded", False)
        for name, value in list(vars(reg).items()):  # its tables, restored afterwards
            if isinstance(value, (dict, set)):
                monkeypatch.setattr(reg, name, type(value)(value))


def test_a_broken_entry_point_is_a_config_error_naming_it(tmp_path, monkeypatch, fresh_entry_points):
    """An entry point naming a missing attribute, or a class breaking the plugin contract, was a raw
    AttributeError / TypeError; it is a config error naming the entry point, and the CLI says
    ``error: invalid ...`` with exit 2."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    fake_dist(tmp_path, monkeypatch, "brokenplug", """
        class NotAProposer:
            pass
        class Half:
            pass
    """, """
        [spec_plugins.proposers]
        notaproposer = brokenplug:NotAProposer
        typo = brokenplug:Missing
        [spec_plugins.backends]
        halfbackend = brokenplug:Half
    """)
    target = {"backend": "torch", "model": "x"}
    for data, needle in [
        ({"target": target, "proposer": {"type": "typo"}},
         "entry point typo = brokenplug:Missing in group spec_plugins.proposers) cannot be loaded: "
         "module brokenplug has no attribute 'Missing'"),
        ({"target": target, "proposer": {"type": "notaproposer"}},
         "entry point notaproposer = brokenplug:NotAProposer in group spec_plugins.proposers) cannot be used: "
         "proposer NotAProposer must subclass"),
        ({"target": {"backend": "halfbackend", "model": "x"}},
         "entry point halfbackend = brokenplug:Half in group spec_plugins.backends) cannot be used: "
         "runtime Half does not implement the Runtime contract"),
    ]:
        with pytest.raises(ConfigError, match="invalid config") as err:
            SpecConfig.parse(data)
        assert needle in str(err.value), err.value
    config = tmp_path / "c.yaml"
    config.write_text("target: {backend: torch, model: x}\nproposer: {type: notaproposer}\n")
    res = CliRunner().invoke(app, ["generate", "-c", str(config), "-p", "hi"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.exception
    assert f"error: invalid {config}" in res.output.replace("\n", ""), res.output
    sys.modules.pop("brokenplug", None)


def _proposer_registry() -> Registry[object]:
    """A registry like ``PROPOSERS`` (same group, built-in ``ngram``), loading entry points anew."""
    from spec_plugins.registry import _check_proposer

    return Registry("proposer", "spec_plugins.proposers",
                    builtins={"ngram": "spec_plugins.proposers.ngram:NgramProposer"}, check=_check_proposer)


def test_an_entry_point_taking_a_built_in_name_is_refused(tmp_path, monkeypatch):
    """A third-party entry point called ``ngram`` was silently ignored (the built-in kept the name):
    refused, naming both; one pointing at the built-in itself (the project's own entry points, a
    second installed copy) is the same plugin and loads, as an environment without any does."""
    from spec_plugins.proposers.ngram import NgramProposer

    assert _proposer_registry().names() == ["ngram"]  # this environment: no third-party proposers
    fake_dist(tmp_path / "same", monkeypatch, "sameplug", "",
               "[spec_plugins.proposers]\nngram = spec_plugins.proposers.ngram:NgramProposer\n")
    reg = _proposer_registry()
    assert reg.names() == ["ngram"] and reg.get("ngram") is NgramProposer
    fake_dist(tmp_path / "dup", monkeypatch, "dupplug", """
        from spec_plugins.proposers.ngram import NgramProposer
        class MyNgram(NgramProposer):
            pass
    """, "[spec_plugins.proposers]\nngram = dupplug:MyNgram\n")
    reg = _proposer_registry()
    for _ in range(2):  # refused each time, nothing half-loaded
        with pytest.raises(RegistryError, match=r"entry point ngram = dupplug:MyNgram .*the name 'ngram' is "
                                                r"already the proposer spec_plugins\.proposers\.ngram:NgramProposer"):
            reg.get("ngram")
    assert reg.names() == ["ngram"]


def test_an_entry_point_re_exporting_a_decorated_class_is_the_same_plugin(tmp_path, monkeypatch):
    """A plugin registered by decorator whose entry point names the package's re-export
    (``bigram = bigplug:Bigram``, the class living in ``bigplug.impl``) was refused as a clash once
    the package was imported, and the refusal blocked every config; a clash with another object is
    refused only when its name is looked up, so other names still load."""
    import sys

    (tmp_path / "bigplug").mkdir()
    (tmp_path / "bigplug" / "impl.py").write_text(textwrap.dedent("""
        from typing import Literal
        from spec_plugins.proposers.ngram import NgramProposer
        class Bigram(NgramProposer):
            class Config(NgramProposer.Config):
                type: Literal["bigram"] = "bigram"
    """))
    (tmp_path / "bigplug" / "__init__.py").write_text("from bigplug.impl import Bigram\n")
    fake_dist(tmp_path, monkeypatch, "bigplug_dist", "", "[spec_plugins.proposers]\nbigram = bigplug:Bigram\n"
               "other = bigplug.impl:Bigram\nngram = bigplug:Bigram\n")
    monkeypatch.delitem(sys.modules, "bigplug", raising=False)
    reg = _proposer_registry()
    import bigplug

    reg.register("bigram")(bigplug.Bigram)  # the package registers itself on import, as the docs show
    assert reg.names() == ["bigram", "ngram", "other"]
    assert reg.get("bigram") is bigplug.Bigram
    with pytest.raises(RegistryError, match="entry point other = bigplug.impl:Bigram.*must default to 'other'"):
        reg.get("other")  # the same class under another name: its Config names it bigram
    with pytest.raises(RegistryError, match="entry point ngram = bigplug:Bigram"):
        reg.get("ngram")  # another object under a built-in's name


def test_an_entry_point_module_raising_at_import_is_a_registry_error(tmp_path, monkeypatch):
    """Only ImportError was caught: a plugin module raising anything else at import (a missing
    shared library) escaped the config's validation as a raw traceback."""
    fake_dist(tmp_path, monkeypatch, "crashplug", "raise RuntimeError('cannot find libfoo.so')\n",
               "[spec_plugins.proposers]\ncrash = crashplug:Crash\n")
    reg = _proposer_registry()
    with pytest.raises(RegistryError, match=r"'crash' \(entry point crash = crashplug:Crash in group "
                                            r"spec_plugins.proposers\) cannot be loaded: importing crashplug raised "
                                            r"RuntimeError: cannot find libfoo.so"):
        reg.get("crash")
    assert reg.get("ngram").__name__ == "NgramProposer"


def test_a_config_from_a_pipe_is_read_and_a_directory_refused(tmp_path):
    """``--config <(...)`` hands over a pipe, which was refused as "a directory": a pipe is read;
    only a directory gets that message."""
    import os
    import threading
    import time

    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes on this platform")
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    text = b"target: {backend: torch, model: smollm2-135m-instruct}\nproposer: {type: ngram, num_draft_tokens: 3}\n"

    def write() -> None:  # opens without blocking once the reader has the pipe open (gives up after 10 s)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.01)
                continue
            os.write(fd, text)
            os.close(fd)
            return

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    cfg = SpecConfig.from_file(fifo)
    writer.join()
    assert cfg.proposer.num_draft_tokens == 3 and cfg.target.model == "smollm2-135m-instruct"
    with pytest.raises(ConfigError, match="is a directory, not a YAML/JSON file"):
        SpecConfig.from_file(tmp_path)
