"""Round 13: the registry, config dispatch, model loading and tokenizer checks.

A decorator may not take a lazy entry's name; entry points are read as the packaging spec defines
them; config instances are validated like dicts; a model without tokenizer files (or an empty
GGUF) is refused naming its path; a draft tokenizer with tokens the target lacks (or the reverse)
is accepted and decodes exactly; a hybrid child's errors name the child. Registry tests use fresh
``Registry`` objects (or a subprocess), so the global registries stay as they were."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from typing import Any
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from helpers import hf_generate

from spec_plugins.backends.torch_runtime import TorchRuntime, load_hf
from spec_plugins.config import ConfigError, ProposerConfig, RuntimeConfig, SpecConfig, VerifierConfig
from spec_plugins.registry import Registry, RegistryError
from spec_plugins.vocab import VocabMismatch, check_vocab_compatible
from support import fake_dist

REPO = Path(__file__).resolve().parents[1]
TARGET = {"backend": "torch", "model": "x"}


# ---- 1. a decorator under a lazy entry's name --------------------------------------------------

def test_a_decorator_taking_a_lazy_built_in_name_is_refused_and_the_built_ins_keep_working():
    """``@register_proposer("ngram")`` before ngram was imported silently replaced the built-in (the
    default config ran the plugin), and ``"medusa"`` made importing eagle (which imports medusa)
    fail. Run in a subprocess: the global registries of this process stay untouched."""
    script = textwrap.dedent("""
        from typing import Literal
        from spec_plugins import register_proposer
        from spec_plugins.config import ProposerConfig, SpecConfig, default_config
        from spec_plugins.proposers import Proposer
        from spec_plugins.registry import RegistryError

        for name in ("ngram", "medusa"):
            class Mine(Proposer):
                class Config(ProposerConfig):
                    type: Literal[name] = name
                def __init__(self, config, **_): self.config = config
                def propose(self, ctx): return None
            try:
                register_proposer(name)(Mine)
                print("accepted", name)
            except RegistryError as exc:
                print("refused", exc)
        print("default", type(default_config().proposer).__qualname__)
        eagle = SpecConfig.parse({"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "eagle", "heads": "h"}})
        print("eagle", type(eagle.proposer).__qualname__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == ("refused proposer 'ngram' is already registered (spec_plugins.proposers.ngram:NgramProposer); "
                        "register yours under another name")
    assert lines[1].startswith("refused proposer 'medusa' is already registered "
                               "(spec_plugins.proposers.medusa:MedusaProposer)")
    assert lines[2:] == ["default NgramProposer.Config", "eagle EagleProposer.Config"]


def test_a_decorator_on_the_lazy_entrys_own_object_is_accepted(tmp_path, monkeypatch):
    """The entry's own class registers under its name: imported by the decorating code, or by the
    registry while its package (re-exporting it) is still being imported."""
    reg: Registry[object] = Registry("widget", "spec_plugins.round13.none",
                                     builtins={"plain": "r13plain:Plain", "thing": "r13pkg:Thing"})
    holder = types.ModuleType("r13_holder")
    holder.reg = reg
    monkeypatch.setitem(sys.modules, "r13_holder", holder)
    (tmp_path / "r13plain.py").write_text("class Plain:\n    pass\n")
    (tmp_path / "r13pkg").mkdir()
    (tmp_path / "r13pkg" / "__init__.py").write_text("from r13pkg.impl import Thing\n")
    (tmp_path / "r13pkg" / "impl.py").write_text("from r13_holder import reg\n\n@reg.register('thing')\n"
                                                 "class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("r13plain", "r13pkg", "r13pkg.impl"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    import r13plain

    assert reg.register("plain")(r13plain.Plain) is r13plain.Plain and reg.get("plain") is r13plain.Plain
    assert reg.get("thing") is sys.modules["r13pkg"].Thing
    with pytest.raises(RegistryError, match=r"widget 'plain' is already registered"):
        reg.register("plain")(type("Plain", (), {}))


def test_a_decorator_taking_an_entry_points_name_is_refused(tmp_path, monkeypatch):
    """An entry point loaded but not imported yet held its name as weakly as a built-in did."""
    fake_dist(tmp_path, monkeypatch, "r13ep", "class Real:\n    pass\n", "[spec_plugins.round13.eps]\n"
               "real = r13ep:Real\n")
    reg: Registry[object] = Registry("widget", "spec_plugins.round13.eps")
    assert reg.names() == ["real"]
    with pytest.raises(RegistryError, match=r"widget 'real' is already registered \(entry point real = r13ep:Real"):
        reg.register("real")(type("Real", (), {}))
    assert reg.get("real").__module__ == "r13ep"


def test_an_entry_point_naming_a_re_export_accepts_its_defining_modules_decorator(tmp_path, monkeypatch):
    """An entry point ``r13re.api:Plugin`` re-exporting the class its package defines (and
    registers) in ``r13re._impl``: importing ``_impl`` directly runs the decorator while ``_impl``
    is half imported, so the entry cannot be imported to compare yet; it is compared on first use
    (it was refused as "already registered" by its own class). Another class under the name is
    still refused at once."""
    pkg = tmp_path / "r13re"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_impl.py").write_text(textwrap.dedent("""
        import tests_registry_round13_reg as holder

        @holder.REG.register("plugin")
        class Plugin:
            pass
    """))
    (pkg / "api.py").write_text("from r13re._impl import Plugin\n")
    (pkg / "other.py").write_text(textwrap.dedent("""
        import tests_registry_round13_reg as holder

        @holder.REG2.register("plugin")
        class Plugin:
            pass
    """))
    dist = tmp_path / "r13re-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: r13re\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[spec_plugins.round13.re]\nplugin = r13re.api:Plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    holder = types.ModuleType("tests_registry_round13_reg")
    holder.REG = Registry("widget", "spec_plugins.round13.re")  # type: ignore[attr-defined]
    holder.REG2 = Registry("widget", "spec_plugins.round13.re")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests_registry_round13_reg", holder)
    for reg in (holder.REG, holder.REG2):  # type: ignore[attr-defined]
        assert reg.names() == ["plugin"]  # the entry point is lazy
    import r13re._impl  # noqa: E402

    assert holder.REG.get("plugin") is r13re._impl.Plugin  # type: ignore[attr-defined]
    with pytest.raises(RegistryError, match=r"'plugin' is already registered \(entry point plugin = r13re.api:Plugin"):
        import r13re.other  # noqa: E402,F401  (another class under the entry point's name: it imports whole)


# ---- 2. entry-point values as the packaging spec defines them ------------------------------------

def test_entry_points_with_dotted_objects_and_extras_load(tmp_path, monkeypatch):
    """``mod:Outer.Inner`` and ``mod:Class [extra]`` are valid entry points; both were refused as a
    missing attribute, and extras turned a re-export of a built-in into a clash."""
    fake_dist(tmp_path, monkeypatch, "r13nest", """
        class Plugins:
            class Echo:
                pass
        class Echo2:
            pass
        class Thing:
            pass
    """, "[spec_plugins.round13.nest]\necho = r13nest:Plugins.Echo\necho2 = r13nest:Echo2 [fast]\n"
         "thing = r13nest:Thing [extra]\nbad = r13nest:Plugins.Nope\n")
    reg: Registry[object] = Registry("widget", "spec_plugins.round13.nest", builtins={"thing": "r13nest:Thing"})
    import r13nest

    assert reg.get("echo") is r13nest.Plugins.Echo
    assert reg.get("echo2") is r13nest.Echo2
    assert reg.get("thing") is r13nest.Thing  # the same object: no clash
    with pytest.raises(RegistryError, match=r"r13nest:Plugins has no attribute 'Nope'"):
        reg.get("bad")


# ---- 3. models that cannot load name their path ---------------------------------------------------

def test_a_model_directory_without_tokenizer_files_is_refused_naming_it(tmp_path):
    """save_pretrained() of a model alone: transformers blamed a missing sentencepiece/tiktoken."""
    d = tmp_path / "weights_only"
    tiny_llama().save_pretrained(str(d))
    with pytest.raises(ValueError, match=rf"{d}: the directory holds no tokenizer files"):
        load_hf(str(d), device="cpu")


def test_an_empty_gguf_file_is_refused_naming_it(tmp_path):
    """numpy's "cannot mmap an empty file" named no file."""
    empty = tmp_path / "e.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"GGUF file {empty} is empty"):
        load_hf(str(empty), device="cpu")


# ---- 4. config instances are validated like dicts -------------------------------------------------

def test_a_base_config_instance_naming_an_unknown_plugin_is_refused():
    with pytest.raises(ConfigError, match=r"type='nonexistent' is not a known proposer"):
        SpecConfig.parse({"target": TARGET, "proposer": ProposerConfig(type="nonexistent")})


def test_base_config_instances_become_their_plugins_configs():
    """``ProposerConfig(type="ngram")`` failed at build (no ``min_ngram``), ``VerifierConfig(type=
    "typical")`` built a TypicalVerifier without an epsilon; a plugin's own Config passes as is."""
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.verifiers import TypicalVerifier

    cfg = SpecConfig(target=RuntimeConfig(backend="torch", model="x"),
                     proposer=ProposerConfig(type="ngram", num_draft_tokens=3), verifier=VerifierConfig(type="typical"))
    assert type(cfg.proposer) is NgramProposer.Config and cfg.proposer.num_draft_tokens == 3
    assert cfg.proposer.min_ngram == NgramProposer.Config().min_ngram
    assert type(cfg.verifier) is TypicalVerifier.Config and cfg.verifier.epsilon == TypicalVerifier.Config().epsilon
    assert cfg.target.backend == "torch" and type(cfg.target) is not RuntimeConfig
    own = NgramProposer.Config(num_draft_tokens=2)
    assert SpecConfig(target=TARGET, proposer=own).proposer is own


def test_a_spec_config_from_a_base_proposer_config_decodes_exactly():
    from spec_plugins import SpeculativeDecoder

    model = tiny_llama(seed=3, sharpness=4.0)
    cfg = SpecConfig(target=TARGET, proposer=ProposerConfig(type="ngram", num_draft_tokens=3))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    out = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model)).generate(prompt, max_new_tokens=12)
    assert out.token_ids == hf_generate(model, [prompt], 12, pad=0)[0]


# ---- 5. tokenizers with tokens only one model holds -----------------------------------------------

def _tokenizer(extra: str | None = None):
    """A 32-token word-level tokenizer (the tiny models' vocabulary), plus ``extra`` as an added token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *(f"w{i}" for i in range(1, 32))])},
                                   unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    if extra is not None:
        tok.add_special_tokens({"pad_token": extra})
    return tok


@torch.no_grad()
def _resized(model: torch.nn.Module, vocab: int, extra_logit: float = 0.0) -> torch.nn.Module:
    """``model`` with its embedding and LM-head rows cut or extended to ``vocab`` (new rows: zero
    embeddings, an LM-head row whose logit is ``extra_logit`` times the hidden state's sum)."""
    out = tiny_llama(vocab=vocab)
    state = model.state_dict()
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        w = state[key][:vocab]
        if vocab > w.shape[0]:
            fill = torch.full((vocab - w.shape[0], w.shape[1]), extra_logit if key == "lm_head.weight" else 0.0)
            w = torch.cat([w, fill])
        state[key] = w
    out.load_state_dict(state)
    return out


def test_tokens_only_one_tokenizer_holds_are_accepted_and_shared_ones_still_checked():
    base, padded = _tokenizer(), _tokenizer("<pad>")
    check_vocab_compatible(base, padded)
    check_vocab_compatible(padded, base)
    swapped = _tokenizer()
    swapped.add_special_tokens({"additional_special_tokens": ["<x>", "<y>"]})
    other = _tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<y>", "<x>"]})
    with pytest.raises(VocabMismatch, match=r"2 tokens both hold have different ids \('<x>': target id 32, "
                                            r"draft id 33"):
        check_vocab_compatible(swapped, other)
    with pytest.raises(VocabMismatch, match=r"1 ids name other tokens \(id 32: target '<x>', draft '<pad>'\)"):
        check_vocab_compatible(_tokenizer("<x>"), padded)  # one id, two meanings: drafts would mean other text


@pytest.mark.parametrize("side", ["draft", "target"])
def test_a_tokenizer_with_an_added_token_drafts_and_decodes_exactly(tmp_path, side):
    """A draft tokenizer with one added token (its model one row wider, that row's logit made the
    draft's argmax: cut away) or a target with one (the draft one row narrower): the draft model is
    built from its directory through the config, drafts, and greedy output is transformers' own."""
    from spec_plugins import SpeculativeDecoder

    base = tiny_llama(seed=3, sharpness=4.0)
    if side == "draft":
        target, target_tok = base, _tokenizer()
        draft, draft_tok = _resized(base, 33, extra_logit=50.0), _tokenizer("<pad>")
    else:
        target, target_tok = _resized(base, 33), _tokenizer("<pad>")
        draft, draft_tok = base, _tokenizer()
    d = tmp_path / "draft"
    draft.save_pretrained(str(d))
    draft_tok.save_pretrained(str(d))
    cfg = SpecConfig.parse({"target": TARGET, "proposer": {
        "type": "draft_model", "num_draft_tokens": 3,
        "model": {"backend": "torch", "model": str(d), "device": "cpu", "matmul": "native"}}})
    dec = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(target, tokenizer=target_tok))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 7, 8, 9]] + ([[1, 32, 3]] if side == "target" else [])
    accepted = 0
    for prompt in prompts:
        out = dec.generate(prompt, max_new_tokens=16)
        assert out.token_ids == hf_generate(target, [prompt], 16, pad=0)[0]
        accepted += out.stats.accepted_tokens
    assert accepted > 0


# ---- 6. a hybrid child's errors name the child ----------------------------------------------------

def test_a_hybrid_childs_field_error_names_its_index_and_type():
    with pytest.raises(ConfigError, match=r"invalid config: proposer: proposers\[1\] \(suffix\): bogus: Extra inputs "
                                          r"are not permitted"):
        SpecConfig.parse({"target": TARGET, "proposer": {"type": "hybrid", "proposers": [
            {"type": "suffix"}, {"type": "suffix", "bogus": 1}]}})


def test_a_truncated_gguf_is_refused_naming_it(tmp_path):
    """A GGUF cut short (a download stopped part way) failed with a bare struct.error."""
    from spec_plugins.models import load_tokenizer

    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 40)
    with pytest.raises(ValueError, match=r"cannot load the tokenizer of .*cut\.gguf"):
        load_tokenizer(str(tmp_path), gguf_file=path.name)


def test_a_config_instance_keeps_its_unset_fields_unset():
    """A base config instance passed through the API is read as the dict of what it was given:
    its defaults stay unset (a server's ``exclude_unset`` dump writes only what the user set)."""
    spec = SpecConfig(target=TARGET, proposer=ProposerConfig(type="ngram"))
    assert spec.proposer.model_fields_set == SpecConfig(target=TARGET, proposer={"type": "ngram"}).proposer.model_fields_set
    assert spec.proposer.model_fields_set == {"type"}


def test_an_unknown_hybrid_child_type_names_its_index():
    with pytest.raises(ConfigError, match=r"proposers\[1\]: type='bogus' is not a known proposer"):
        SpecConfig.parse({"target": TARGET, "proposer": {"type": "hybrid", "proposers": [{"type": "suffix"}, {"type": "bogus"}]}})


def test_an_import_error_chain_that_loops_is_walked_once():
    """``raise e from e`` in a plugin's module made the chain of causes a loop: registering under
    that entry's name never returned. It is refused as any entry that does not import."""
    from spec_plugins.registry import _needs_itself

    e = ValueError("boom")
    e.__cause__ = e
    outer = RegistryError("widget 'w' cannot be loaded")
    outer.__cause__ = e
    assert _needs_itself(outer, type("W", (), {})) is False
    a, b = ImportError("a"), ImportError("b")
    a.__cause__, b.__cause__ = b, a
    outer.__cause__ = a
    assert _needs_itself(outer, type("W", (), {})) is False


def test_a_config_instance_keeps_nested_configs_as_they_are():
    """A third-party config class naming ``draft_model`` and holding a runtime config instance whose
    ``backend`` was left at its default: its dump without unset fields dropped the nested
    ``backend`` ("missing field"); the nested config is now passed as it is."""
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.proposers.draft_model import DraftModelProposer

    class Loose(ProposerConfig):
        type: str = "draft_model"
        model: Any = None

    nested = TorchRuntime.Config(model="y")
    assert "backend" not in nested.model_fields_set
    cfg = SpecConfig(target=TARGET, proposer=Loose(type="draft_model", model=nested))
    assert isinstance(cfg.proposer, DraftModelProposer.Config) and cfg.proposer.model.model == "y"
