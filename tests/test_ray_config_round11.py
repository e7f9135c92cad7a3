"""``serve --ray`` hands every replica the config as a dict, and each replica parses it again: the
dict must parse to the config the command read. A full dump wrote every default as if given, so a
config whose checks look at which fields were given (recycling's ``tree_size`` against a short
``num_draft_tokens``) was refused by every replica though the command accepted it."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from conftest import tiny_llama
from spec_plugins.cli import app
from spec_plugins.config import SpecConfig


@pytest.mark.parametrize("proposer", [
    {"type": "recycling", "num_draft_tokens": 1},
    {"type": "lookahead", "num_draft_tokens": 2},
    {"type": "suffix", "scope": "global"},
    {"type": "ngram", "num_draft_tokens": "auto"},
])
def test_each_replica_parses_the_config_the_command_read(tmp_path, proposer):
    model = tmp_path / "tiny"
    tiny_llama(seed=3).save_pretrained(str(model))
    cfg = tmp_path / "spec.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(model)}, "proposer": proposer}))
    out = tmp_path / "serve.yaml"
    res = CliRunner().invoke(app, ["serve", "--ray", "-c", str(cfg), "--write-config", str(out)])
    assert res.exit_code == 0, res.output
    replica = yaml.safe_load(out.read_text())["applications"][0]["args"]["options"]["config"]
    assert SpecConfig.parse(replica) == SpecConfig.from_file(cfg)


def test_no_speculation_reaches_the_replicas(tmp_path):
    """``--no-speculation`` drops the proposer: the replicas' config has none either."""
    model = tmp_path / "tiny"
    tiny_llama(seed=3).save_pretrained(str(model))
    cfg = tmp_path / "spec.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(model)}, "proposer": {"type": "ngram"}}))
    out = tmp_path / "serve.yaml"
    res = CliRunner().invoke(app, ["serve", "--ray", "-c", str(cfg), "--no-speculation", "--write-config", str(out)])
    assert res.exit_code == 0, res.output
    replica = yaml.safe_load(out.read_text())["applications"][0]["args"]["options"]["config"]
    assert SpecConfig.parse(replica).proposer is None
