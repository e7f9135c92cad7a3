"""Round 12: inputs read as they are meant. A JSON config without a ``.json`` suffix (a pipe, an
upper-case suffix) is read as JSON, tab indentation included; a ``.GGUF`` file is a GGUF file; an
empty model name is refused, not read as the working directory; two ``logit_bias`` keys naming one
token are refused wherever a bias is built, not summed past the per-token bound."""

from __future__ import annotations

import json
import os

import pytest
import torch

from spec_plugins.config import ConfigError, SpecConfig, load_file
from spec_plugins.models import ModelNotFound, resolve_model
from spec_plugins.processors import LogitBias

CONFIG = {"target": {"backend": "torch", "model": "smollm2-135m-instruct"},
          "proposer": {"type": "ngram", "num_draft_tokens": 3}}


@pytest.mark.parametrize("name", ["cfg.JSON", "cfg.conf"])
def test_tab_indented_json_is_read_as_json_whatever_the_suffix(tmp_path, name):
    """YAML refuses tabs; JSON allows them: text that is JSON is read as JSON."""
    path = tmp_path / name
    path.write_text(json.dumps(CONFIG, indent="\t"))
    assert load_file(path) == CONFIG
    assert SpecConfig.from_file(path).target.model == "smollm2-135m-instruct"


def test_tab_indented_json_through_a_pipe_is_read_as_json():
    """``--config <(...)``: a pipe has no suffix at all."""
    r, w = os.pipe()
    with os.fdopen(w, "w") as f:
        f.write(json.dumps(CONFIG, indent="\t"))
    try:
        assert load_file(f"/dev/fd/{r}") == CONFIG
    finally:
        os.close(r)


def test_json_text_keeps_its_duplicate_key_refusal_and_yaml_flow_mappings_stay_yaml(tmp_path):
    dup = tmp_path / "dup.conf"
    dup.write_text('{\n\t"a": 1,\n\t"a": 2\n}')
    with pytest.raises(ConfigError, match="duplicate key `a`"):
        load_file(dup)
    flow = tmp_path / "flow.yaml"
    flow.write_text("{a: 1, b: [x, y]}")
    assert load_file(flow) == {"a": 1, "b": ["x", "y"]}
    flow.write_text('{"a": NaN}')  # not JSON: YAML's reading, as before
    assert load_file(flow) == {"a": "NaN"}


def test_an_upper_case_gguf_suffix_names_a_gguf_file(tmp_path):
    gguf = tmp_path / "model.GGUF"
    gguf.write_bytes(b"GGUF")
    src = resolve_model(str(gguf))
    assert src.gguf_path == gguf.resolve()
    with pytest.raises(ModelNotFound, match="GGUF file not found"):
        resolve_model(str(tmp_path / "gone.GGUF"))


def test_an_empty_model_name_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")  # a transformers directory where the process runs
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match="the model name is empty"):
        resolve_model("")
    with pytest.raises(ModelNotFound, match="the model name is empty"):
        resolve_model("  ")
    bad = {**CONFIG, "target": {"backend": "torch", "model": ""}}
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="model"):
        SpecConfig.from_file(path)


def test_two_keys_naming_one_token_are_refused_not_summed():
    """``LogitBias`` bounds each token's bias to [-100, 100]: "5", 5 and "05" are one token, and
    summing them would give it +300."""
    with pytest.raises(ValueError, match="both name token 5"):
        LogitBias({5: 100.0, "5": 100.0, "05": 100.0}, vocab=10)
    bias = LogitBias({5: 100.0, "6": -100.0}, vocab=10)
    out = bias(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 10))
    assert out[0, 5] == 100.0 and out[0, 6] == -100.0 and out[0, :5].abs().sum() == 0


def test_the_generate_summary_says_nothing_was_drafted_rather_than_zero_acceptance():
    """``spec-plugins generate``'s summary: a policy that drafted nothing is no 0% acceptance."""
    from spec_plugins.cli import _acceptance
    from spec_plugins.stats import DecodeStats

    none = DecodeStats()
    none.observe_round([], 0, 1)
    assert _acceptance(none) == "nothing drafted"
    some = DecodeStats()
    some.observe_round([1, 1, 1, 1], 2, 3)
    assert _acceptance(some) == "acceptance 50.00% of 4 drafted"
