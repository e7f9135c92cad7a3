"""CLI and config inputs, round 10: the shipped default prompts and the device audit's idea of
"our code" hold in a wheel install (a built wheel, unpacked as pip installs it); bench and export
refuse bad options before any model loads; ``tune --runtimes ""`` is refused like ``","``; YAML
reads exponent floats as JSON does; and the command ``tune`` records reruns as written."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from spec_plugins.cli import app

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model fails the test with an AssertionError (exit code 1 from the CLI runner)."""
    from spec_plugins.backends import torch_runtime

    from spec_plugins.decoder import SpeculativeDecoder

    def boom(*a, **kw):
        raise AssertionError("reached model loading")

    monkeypatch.setattr(SpeculativeDecoder, "from_config", boom)
    monkeypatch.setattr(torch_runtime, "load_hf", boom)


def _run(args: list[str]):
    return CliRunner().invoke(app, [str(a) for a in args])


def _reached_loading(res) -> bool:
    return isinstance(res.exception, AssertionError) and "reached model loading" in str(res.exception)


# ---- 1. a wheel install ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> tuple[Path, list[str]]:
    """This source tree built into a wheel (``pip wheel``, as ``pip install .`` builds it) and
    unpacked into a site directory of its own, with the wheel's file names."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "data", "bench-out", "build", "*.egg-info", "__pycache__", ".*cache", "tests", "docs"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    whl = next((tmp / "dist").glob("spec_plugins-*.whl"))
    site = tmp / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
        names = z.namelist()
    return site, names


def _in_site(site: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter that imports spec_plugins from ``site`` (first on the
    path, ahead of the editable install's finder)."""
    env = {"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], cwd=site.parent, env=env, capture_output=True, text=True,
                          check=False)


def test_wheel_ships_the_default_prompts_and_finds_them(wheel_site):
    """``spec-plugins tune --out tuned.yaml`` failed from a wheel install: its default --prompts
    (and train's) pointed at site-packages/examples/prompts, which the wheel does not have."""
    site, names = wheel_site
    assert {"spec_plugins/prompts/dev.jsonl", "spec_plugins/prompts/train.jsonl"} <= set(names)
    res = _in_site(site, (
        "import spec_plugins, spec_plugins.tune_cli as t, spec_plugins.training.sources as s\n"
        "from spec_plugins.bench.prompts import load_prompts\n"
        f"assert spec_plugins.__file__.startswith({str(site)!r}), spec_plugins.__file__\n"
        "print(t.DEFAULT_PROMPTS, s.DEFAULT_PROMPTS)\n"
        "assert len(load_prompts(t.DEFAULT_PROMPTS)) > 0 and len(s.load_prompts(s.DEFAULT_PROMPTS)) > 0\n"))
    assert res.returncode == 0, res.stdout + res.stderr
    tune_default, train_default = res.stdout.split()
    assert Path(tune_default) == site / "spec_plugins" / "prompts" / "dev.jsonl"
    assert Path(train_default) == site / "spec_plugins" / "prompts" / "train.jsonl"


def test_wheel_ships_the_trained_heads_configs_name(wheel_site):
    """Configs (tune's defaults among them) name ``examples/heads/...``; a wheel install had no
    such folder, and ``resolve_head_dir`` looked for it beside site-packages."""
    site, names = wheel_site
    head = "smollm2-135m-instruct/eagle"
    assert {f"spec_plugins/shipped_heads/{head}/{f}" for f in ("config.json", "head.safetensors")} <= set(names)
    res = _in_site(site, (
        "from spec_plugins.proposers.medusa import resolve_head_dir\n"
        f"print(resolve_head_dir('examples/heads/{head}'))\n"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert Path(res.stdout.strip()) == site / "spec_plugins" / "shipped_heads" / head


def test_source_tree_defaults_are_the_examples_files():
    """From the source tree (the editable install) the defaults are the files in examples/prompts."""
    from spec_plugins.training.sources import DEFAULT_PROMPTS as train_default
    from spec_plugins.tune_cli import DEFAULT_PROMPTS as tune_default

    assert tune_default.resolve() == (REPO / "examples" / "prompts" / "dev.jsonl").resolve()
    assert train_default.resolve() == (REPO / "examples" / "prompts" / "train.jsonl").resolve()


_AUDIT_PROBE = """
import torch
from spec_plugins.device_audit import DeviceAudit
import exporters as foreign  # another distribution's top-level package named like our folder
ours = compile("torch.zeros(2)", {ours!r}, "exec")
with DeviceAudit() as audit:
    foreign.make()
    exec(ours, {{"torch": torch}})
print([leak.where for leak in audit.leaks])
"""


def test_device_audit_in_a_wheel_install_audits_only_this_project(wheel_site):
    """In a wheel install ``backends`` and ``exporters`` sit inside ``spec_plugins``; the audit
    also claimed site-packages/backends and site-packages/exporters, so another package with such
    a name had its host tensors reported as our leaks."""
    site, _ = wheel_site
    (site / "exporters").mkdir(exist_ok=True)
    (site / "exporters" / "__init__.py").write_text("import torch\n\ndef make():\n    return torch.zeros(2)\n")
    ours = site / "spec_plugins" / "backends" / "probe.py"
    res = _in_site(site, _AUDIT_PROBE.format(ours=str(ours)))
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout.strip().replace("'", '"')) == ["spec_plugins/backends/probe.py:1"]


def test_device_audit_in_the_source_tree_names_backends_files():
    """The editable layout: code in the top-level ``backends`` folder is ours, named from the repo."""
    import torch

    from spec_plugins.device_audit import DeviceAudit

    code = compile("torch.zeros(2)", str(REPO / "backends" / "probe.py"), "exec")
    elsewhere = compile("torch.zeros(2)", str(REPO.parent / "backends_other" / "probe.py"), "exec")
    with DeviceAudit() as audit:
        exec(code, {"torch": torch})  # noqa: S102 - code compiled here, under a file name of ours
        exec(elsewhere, {"torch": torch})  # noqa: S102 - and one outside the project
    assert [leak.where for leak in audit.leaks] == ["backends/probe.py:1"]


# ---- 2. bench and export options, refused before any model loads ----------------------------------
def _bench_files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "bad_type.yaml").write_text("mine:\n  type: nonsense\n")
    (tmp_path / "bad_field.yaml").write_text("mine:\n  type: ngram\n  max_ngram: lots\n")
    (tmp_path / "good.yaml").write_text("mine:\n  type: ngram\n  num_draft_tokens: 2\n")
    (tmp_path / "broken.yaml").write_text("target: [\n")
    (tmp_path / "other.yaml").write_text("target: {backend: torch, model: smollm2-135m-instruct}\n")
    return {"prompts": tmp_path / "p.jsonl"}


@pytest.mark.parametrize("extra, msg", [
    (["--baselines", "plain,tranformers"], "unknown baseline 'tranformers'; registered: "),
    (["--compare-config", "{d}/nope.yaml"], "--compare-config: config file not found: {d}/nope.yaml"),
    (["--compare-config", "{d}/other.yaml", "--compare-config", "{d}/broken.yaml"],
     "--compare-config: config {d}/broken.yaml cannot be read"),
    (["--methods", "{d}/bad_type.yaml"],
     "invalid --methods {d}/bad_type.yaml, method 'mine': proposer: type='nonsense' is not a known proposer"),
    (["--methods", "{d}/bad_field.yaml"], "invalid --methods {d}/bad_field.yaml, method 'mine': proposer: max_ngram: Input should be a valid integer"),
])
def test_bench_refuses_bad_options_before_any_model_loads(nothing_loads, tmp_path, extra, msg):
    files = _bench_files(tmp_path)
    res = _run(["bench", "--prompts", files["prompts"], "--out", tmp_path / "out",
                *[a.format(d=tmp_path) for a in extra]])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and msg.format(d=tmp_path) in out, (res.exception, res.output)
    assert not (tmp_path / "out").exists()


def test_bench_with_good_options_goes_on_to_load(nothing_loads, tmp_path):
    """The early checks refuse only what is wrong: valid --methods and --compare-config reach loading."""
    files = _bench_files(tmp_path)
    res = _run(["bench", "--prompts", files["prompts"], "--out", tmp_path / "out", "--baselines", "plain",
                "--methods", tmp_path / "good.yaml", "--compare-config", tmp_path / "other.yaml"])
    assert _reached_loading(res), (res.exception, res.output)


def test_bench_options_refuse_an_unknown_baseline_when_made():
    from spec_plugins.bench import BenchOptions
    from spec_plugins.registry import RegistryError

    with pytest.raises(RegistryError, match="unknown baseline 'nope'; registered: .*plain"):
        BenchOptions(baselines=["plain", "nope"])
    assert list(BenchOptions(baselines=["plain", "llamacpp"]).baselines) == ["plain", "llamacpp"]


@pytest.mark.parametrize("layers, msg", [
    ("x,y", "--feature-layers 'x,y': expected auto, none or comma-separated layer outputs numbered from 1"),
    ("3,,5", "--feature-layers '3,,5': expected auto, none"),
    ("0,3", "--feature-layers '0,3': expected auto, none or comma-separated layer outputs numbered from 1"),
    ("-2", "--feature-layers '-2': expected auto, none or comma-separated layer outputs numbered from 1"),
])
def test_export_refuses_bad_feature_layers_before_loading(nothing_loads, tmp_path, layers, msg):
    res = _run(["export", "onnx", "--out", tmp_path / "e", "--feature-layers", layers])
    assert res.exit_code == 2 and msg in " ".join(res.output.split()), (res.exception, res.output)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("layers", ["auto", "none", "3,5"])
def test_export_good_feature_layers_go_on_to_load(nothing_loads, tmp_path, layers):
    assert _reached_loading(_run(["export", "onnx", "--out", tmp_path / "e", "--feature-layers", layers]))


# ---- 3. tune --runtimes "" ------------------------------------------------------------------------
@pytest.mark.parametrize("runtimes", ["", ","])
def test_tune_empty_runtimes_is_refused_not_every_runtime(monkeypatch, tmp_path, runtimes):
    import spec_plugins.tune as tune_module

    def every_runtime(model):
        raise AssertionError("took the default runtimes")

    monkeypatch.setattr(tune_module, "default_runtimes", every_runtime)
    res = _run(["tune", "--runtimes", runtimes, "--proposers", "ngram", "--out", tmp_path / "t.yaml"])
    assert res.exit_code == 2 and "at least one runtime" in res.output, (res.exception, res.output)
    assert not (tmp_path / "t.yaml").exists()


# ---- 4. YAML exponent floats ----------------------------------------------------------------------
def test_yaml_config_with_exponent_numbers_loads_as_the_json_one(tmp_path):
    from spec_plugins.config import SpecConfig, load_file

    body = {"target": {"backend": "torch", "model": "smollm2-135m-instruct"},
            "proposer": {"type": "ngram", "num_draft_tokens": 4}}
    (tmp_path / "c.json").write_text(json.dumps(body)[:-1] + ', "sampling": {"temperature": 1e-3, "seed": 1e3}}')
    (tmp_path / "c.yml").write_text(yaml.safe_dump(body) + "sampling: {temperature: 1e-3, seed: 1e3}\n")
    assert load_file(tmp_path / "c.yml") == load_file(tmp_path / "c.json")
    from_yaml, from_json = SpecConfig.from_file(tmp_path / "c.yml"), SpecConfig.from_file(tmp_path / "c.json")
    assert from_yaml == from_json and from_yaml.sampling.seed == 1000


@pytest.mark.parametrize("text", ["1e3", "-2E+4", "1.5e-3", "1.5e3", "+1e0", ".5e2", "7E-2"])
def test_yaml_reads_exponent_floats(tmp_path, text):
    from spec_plugins.config import load_file

    (tmp_path / "x.yaml").write_text(f"v: {text}\n")
    got = load_file(tmp_path / "x.yaml")["v"]
    assert isinstance(got, float) and got == float(text)
    if not text.startswith(("+", ".")):  # JSON's own reading, where JSON allows the form
        assert got == json.loads(text)


@pytest.mark.parametrize("text, want", [
    ("1_000", 1000), ("12", 12), ("-7", -7), ("0x1F", 31), ("1.5", 1.5), ("1e3abc", "1e3abc"), ("'1e3'", "1e3"),
    ("e3", "e3"), ("1e", "1e"), ("1_0e3", "1_0e3"), ("v1e3", "v1e3"), ("true", True),
])
def test_yaml_other_scalars_are_read_as_before(tmp_path, text, want):
    from spec_plugins.config import load_file

    (tmp_path / "x.yaml").write_text(f"v: {text}\n")
    got = load_file(tmp_path / "x.yaml")["v"]
    assert got == want and type(got) is type(want)
    assert got == yaml.safe_load(f"v: {text}")["v"]  # PyYAML's own loader, unchanged by ours


def test_pyyaml_safe_loader_itself_is_left_alone():
    import spec_plugins.config  # noqa: F401 - its resolver is registered on import

    assert yaml.safe_load("v: 1e3")["v"] == "1e3"


# ---- 5. the command tune records ------------------------------------------------------------------
def test_tune_records_a_quoted_command_and_hint(monkeypatch, tmp_path):
    import spec_plugins.tune as tune_module
    from spec_plugins.tune import Measured, TuneResult

    chosen = Measured("torch+ngram", "torch", "ngram", "auto", 200.0, predicted=210.0)
    plain = Measured("plain@torch", "torch", None, None, 100.0)
    result = TuneResult(chosen, plain, [chosen], {"torch": {"plain_tokens_per_s": 100.0, "t1_ms": 1.0,
                                                           "cost_relative": [1.0]}}, {"target": {}}, 1.0)
    monkeypatch.setattr(tune_module, "tune", lambda *a, **k: result)
    d = tmp_path / "dir with space"
    d.mkdir()
    prompts = d / "my prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    out = d / "it's tuned.yaml"
    args = ["tune", "--runtimes", "torch", "--proposers", "ngram", "--prompts", str(prompts), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["spec-plugins", *args])
    res = _run(args)
    assert res.exit_code == 0, (res.exception, res.output)
    first = out.read_text().splitlines()[0]
    assert first.startswith("# written by: ")
    assert shlex.split(first.removeprefix("# written by: ")) == ["spec-plugins", *args]
    hint = res.output.split("run it with `", 1)[1].split("`", 1)[0]
    assert shlex.split(hint) == ["spec-plugins", "generate", "--config", str(out), "--prompt", "..."]
