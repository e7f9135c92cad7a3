"""Round 16 of the training pipeline's edges: every file of a saved head and its report is written
whole or not at all (a full disk leaves the earlier file and no 0-byte or partial one, and the
error names the file); files written through ``write_atomic`` get a plain write's mode, not
safetensors' 0600; a prompts file that is not UTF-8 and a ``--temperatures`` entry that is not a
number are errors that name the file and line / the option."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from test_training_hardening import cli, feature_dir, save_model

from spec_plugins.files import WriteError, write_atomic
from spec_plugins.heads.common import save_head
from spec_plugins.training.sources import load_prompts

HEAD = ["--draft-vocab", "24", "--window", "16", "--batch-size", "2", "--max-steps", "1", "--no-progress",
        "--threads", "1"]


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    """Training features of a saved tiny target."""
    from transformers import AutoModelForCausalLM

    r = tmp_path_factory.mktemp("r16")
    d = save_model(r / "a", seed=4)
    return feature_dir(AutoModelForCausalLM.from_pretrained(d).eval(), r / "feat", d)


def _full_disk_on(monkeypatch, name: str) -> None:
    """``Path.write_text`` of a file whose name holds ``name`` writes a few bytes, then fails as a
    full disk does."""
    real = Path.write_text

    def write_text(self, data, *a, **k):
        if name in self.name:
            real(self, data[:5], *a, **k)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data, *a, **k)
    monkeypatch.setattr(Path, "write_text", write_text)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---- 1. a full disk while a head is saved ---------------------------------------------------------
def test_a_failed_head_write_keeps_the_earlier_files_and_names_the_file(tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "h"
    save_head(torch.nn.Linear(4, 3), {"kind": "k", "n": 1}, out)
    before = {n: (out / n).read_bytes() for n in _names(out)}
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 7)  # what a full disk leaves: a truncated file
        raise safetensors.SafetensorError("Error while serializing: I/O error")
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(WriteError, match=str(out / "head.safetensors")):
        save_head(torch.nn.Linear(4, 3), {"kind": "k", "n": 2}, out)
    assert {n: (out / n).read_bytes() for n in _names(out)} == before  # no temporary file, nothing changed
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    _full_disk_on(monkeypatch, "config.json")
    with pytest.raises(WriteError, match=str(out / "config.json") + ".*No space left on device"):
        save_head(torch.nn.Linear(4, 3), {"kind": "k", "n": 3}, out)
    assert _names(out) == sorted(before) and (out / "config.json").read_bytes() == before["config.json"]
    with pytest.raises(WriteError, match="config.json"):
        save_head(torch.nn.Linear(4, 3), {"kind": "k"}, tmp_path / "fresh")
    assert _names(tmp_path / "fresh") == ["head.safetensors"]  # no 0-byte or partial config.json


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("name", ["config.json", "train_report.json"])
def test_train_onto_a_full_disk_names_the_file_and_leaves_no_partial_one(kind, name, feats, tmp_path, monkeypatch):
    _full_disk_on(monkeypatch, name)
    out = tmp_path / "h"
    extra = ["--num-heads", "2"] if kind == "medusa" else []
    res = cli("train", kind, "--features", feats, "--out", out, *HEAD, *extra)
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"error: cannot write {out}: {out / name}: OSError" in res.output, res.output
    assert "No space left on device" in res.output
    assert name not in _names(out) and not [n for n in _names(out) if n.endswith(".tmp")], _names(out)


# ---- 2. the mode of safetensors files ------------------------------------------------------------
def test_safetensors_files_get_the_mode_of_a_plain_write(tmp_path):
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "shard.safetensors", lambda tmp: save_file({"a": torch.zeros(2)}, str(tmp)))
        save_head(torch.nn.Linear(4, 3), {"kind": "k"}, tmp_path / "h")
        os.umask(0o077)
        write_atomic(tmp_path / "private.safetensors", lambda tmp: save_file({"a": torch.zeros(2)}, str(tmp)))
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): oct(stat.S_IMODE(p.stat().st_mode))
             for p in (tmp_path / "shard.safetensors", tmp_path / "h/head.safetensors", tmp_path / "h/config.json",
                       tmp_path / "private.safetensors")}
    assert modes == {"shard.safetensors": "0o644", "h/head.safetensors": "0o644", "h/config.json": "0o644",
                     "private.safetensors": "0o600"}


# ---- 3. inputs named ---------------------------------------------------------------------------------
def test_a_prompts_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"prompt": "w1 w2 w3"}\n{"prompt": "w4 w5 \xff\xfe"}\n')
    with pytest.raises(ValueError, match=f"{p} line 2: not UTF-8 text .byte 0xff."):
        load_prompts(p)
    p.write_bytes('{"prompt": "caf\u00e9"}\n'.encode())
    assert load_prompts(p) == ["caf\u00e9"]


def test_self_distill_names_temperatures_that_are_not_numbers(tmp_path):
    res = cli("train", "self-distill", "--out", tmp_path / "s", "--temperatures", "0,abc", "--backend", "nope")
    assert res.exit_code == 2 and "--temperatures '0,abc': give comma-separated numbers" in res.output, res.output
    assert not (tmp_path / "s").exists()


def test_a_rewritten_file_keeps_its_mode_and_a_symlink_is_written_through(tmp_path):
    """``write_atomic`` over an existing file keeps its permissions (a 0600 config stays 0600) and
    writes through a symlink, as ``write_text_atomic`` and a plain write do."""
    from spec_plugins.files import write_atomic

    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_atomic(link, lambda tmp: tmp.write_text("new"))
    assert link.is_symlink() and real.read_text() == "new" and real.stat().st_mode & 0o777 == 0o600
