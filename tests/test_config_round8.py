"""Config fields that were accepted and then ignored or misread: a ``spec_config`` file without a
``target`` section (the transformers plugin), a TensorRT ``device`` that is not CUDA, and suffix
index caps set for a ``scope`` that has no such index."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import tiny_llama
from helpers import hf_generate

from spec_plugins.config import ConfigError, SpecConfig
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.proposers.suffix import SuffixProposer
from spec_plugins.stats import DecodeStats

PAD = 0
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]
SECTION = {"proposer": {"type": "ngram", "num_draft_tokens": 4}}


# ---- transformers plugin: spec_config as a file without `target` ---------------------------------
def _spec_generate(spec_config, n: int = 12) -> tuple[list[list[int]], DecodeStats]:
    """The new tokens of a left-padded greedy ``generate(custom_generate=...)`` on a fresh model."""
    model, stats = tiny_llama(seed=3), DecodeStats()
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=PAD, custom_generate=speculative_generate, spec_config=spec_config,
                         spec_stats=stats)
    return out[:, width:].tolist(), stats


@pytest.mark.parametrize("suffix, text", [(".yaml", "proposer: {type: ngram, num_draft_tokens: 4}\n"),
                                          (".json", '{"proposer": {"type": "ngram", "num_draft_tokens": 4}}')])
def test_spec_config_file_without_target_works_like_the_dict(tmp_path, suffix, text):
    """docs/transformers.md: spec_config may be a path, dict or SpecConfig and the target section
    may be omitted; a path without one was refused ("target: Field required"). The file form
    drafts as the dict form does and both equal transformers' own greedy generate()."""
    path = tmp_path / f"spec{suffix}"
    path.write_text(text)
    from_file, file_stats = _spec_generate(str(path))
    from_dict, dict_stats = _spec_generate(SECTION)
    assert from_file == from_dict == hf_generate(tiny_llama(seed=3), PROMPTS, 12, PAD)
    assert file_stats.draft_tokens == dict_stats.draft_tokens > 0  # the file's proposer drafted
    assert _spec_generate(path)[0] == from_dict  # a Path too


@pytest.mark.parametrize("text, needles", [
    ("proposer: {type: ngram, num_draft_tokens: 4, bogus: 1}\n", ["proposer", "bogus"]),
    ("proposer: {type: ngram, num_draft_tokens: -1}\n", ["proposer", "num_draft_tokens", "-1"]),
    ("- proposer\n", ["must be a mapping", "list"]),
    ("proposer: {type: ngram\n", ["cannot be read", "line"]),
])
def test_spec_config_file_errors_name_the_file_and_the_field(tmp_path, text, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        _spec_generate(str(path))
    msg = str(err.value)
    assert str(path) in msg and "target" not in msg, msg
    for needle in needles:
        assert needle in msg, msg


def test_spec_config_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="spec_config file not found: .*nope.yaml"):
        _spec_generate(str(tmp_path / "nope.yaml"))


# ---- TensorRT runtime: device must be CUDA -------------------------------------------------------
def _trt(device: str) -> SpecConfig:
    return SpecConfig.parse({"target": {"backend": "tensorrt", "engine_dir": "engines", "device": device}})


@pytest.mark.parametrize("device", ["cpu", "gpu0", "cuda:-1", "CUDA", "meta", "cuda:a", ""])
def test_tensorrt_device_must_be_cuda(device):
    """TensorRT runs on CUDA only: 'cpu' and typos were accepted by the config and failed (or not)
    only when an engine loaded; now the config refuses them, naming the field and the value."""
    with pytest.raises(ConfigError, match=r"device: .*CUDA devices only.*'cuda' or 'cuda:N'") as err:
        _trt(device)
    assert repr(device) in str(err.value)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_tensorrt_cuda_devices_validate_without_a_gpu(device):
    assert _trt(device).target.device == device


def test_tensorrt_config_validates_without_tensorrt_installed():
    """The device check needs neither the tensorrt package nor a GPU (import blocked here)."""
    code = ("import sys; sys.modules['tensorrt'] = None\n"
            "from spec_plugins.config import ConfigError, SpecConfig\n"
            "t = {'backend': 'tensorrt', 'engine_dir': 'e'}\n"
            "assert SpecConfig.parse({'target': {**t, 'device': 'cuda:1'}}).target.device == 'cuda:1'\n"
            "try:\n    SpecConfig.parse({'target': {**t, 'device': 'cpu'}})\n"
            "except ConfigError as e:\n    print('refused:', e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "refused:" in run.stdout and "device" in run.stdout and "'cpu'" in run.stdout, run.stdout


# ---- suffix proposer: index caps only with a scope that has the index ----------------------------
@pytest.mark.parametrize("section, field, scope", [
    ({"global_max_nodes": 1000}, "global_max_nodes", "request"),
    ({"global_max_tokens": 5000}, "global_max_tokens", "request"),
    ({"max_tenants": 5}, "max_tenants", "request"),
    ({"scope": "global", "max_tenants": 5}, "max_tenants", "global"),
    ({"scope": "request", "max_tenants": 5, "global_max_nodes": 9}, "global_max_nodes", "request"),
])
def test_suffix_fields_for_another_scope_are_refused(section, field, scope):
    """These caps bound the global index, which ``scope: request`` does not keep, and
    ``max_tenants`` counts tenants, which only ``scope: tenant`` keeps: they changed nothing and
    were accepted silently."""
    with pytest.raises(ConfigError) as err:
        SpecConfig.parse({"target": {"backend": "torch", "model": "m"}, "proposer": {"type": "suffix", **section}})
    msg = str(err.value)
    assert f"{field} (scope:" in msg and f"nothing with scope: {scope}" in msg, msg


@pytest.mark.parametrize("section", [
    {"scope": "global", "global_max_tokens": 5000, "global_max_nodes": 1000},
    {"scope": "tenant", "global_max_tokens": 5000, "global_max_nodes": 1000, "max_tenants": 5},
    {"scope": "request", "global_max_tokens": 200_000, "global_max_nodes": None, "max_tenants": 10_000},
])
def test_suffix_fields_that_apply_or_keep_their_defaults_are_accepted(section):
    """Defaults written out (docs/proposers.md lists them with scope: request) change nothing: accepted."""
    cfg = SuffixProposer.Config(**section)
    assert SuffixProposer.Config(**cfg.model_dump()) == cfg  # a dumped config validates again


def test_suffix_caps_reach_the_index_of_the_scope_that_keeps_one():
    prop = SuffixProposer(SuffixProposer.Config(scope="tenant", global_max_tokens=500, max_tenants=3))
    assert prop.index.max_tokens == 500
