"""Hardening round 17, training: the GPU training run's reports (``train_report.json`` of a
snapshot, ``run.json``, the machine stamp) are written whole or not at all, as every other report
is, through the one atomic writer."""

from __future__ import annotations

import json

import pytest
from test_training_round16 import _full_disk_on


def test_stamping_a_report_onto_a_full_disk_keeps_the_report_whole(tmp_path, monkeypatch):
    from spec_plugins.training.device_run import _stamp

    report = tmp_path / "train_report.json"
    report.write_text(json.dumps({"kind": "eagle", "finished": True, "steps": 12}, indent=2) + "\n")
    _full_disk_on(monkeypatch, "train_report.json")
    with pytest.raises(OSError):
        _stamp(report, {"type": "cuda", "name": "H100", "torch": "2.13", "transformers": "5.17"})
    assert json.loads(report.read_text()) == {"kind": "eagle", "finished": True, "steps": 12}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_report.json"]


def test_a_stamp_names_the_machine(tmp_path):
    from spec_plugins.training.device_run import _stamp

    report = tmp_path / "train_report.json"
    report.write_text(json.dumps({"kind": "parallel"}) + "\n")
    _stamp(report, {"type": "cuda", "name": "NVIDIA H100", "torch": "2.13", "transformers": "5.17"})
    assert json.loads(report.read_text())["trained_on"] == "NVIDIA H100 (torch 2.13, transformers 5.17)"
