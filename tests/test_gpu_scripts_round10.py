"""Round 10 of the prepared GPU scripts, on the CPU: a measured cost curve carries its device and only
a GPU's captured bf16 curve is priced as one (``gpu_prediction --measured``), and ``gpu_check``'s
exactness matrix runs the captured-step cases before its budget can run out, counting what it skipped."""

from __future__ import annotations

import json

import pytest
from test_gpu_scripts import FakeClock, _script, stored_curves

H100 = "NVIDIA H100 80GB HBM3"


def _curve(**changes) -> dict:
    """A cost curve as ``gpu_check`` writes it on a CUDA device (``changes`` replace its fields)."""
    curve = {"shape": "llama1b", "kv": "graphs", "dtype": "bfloat16", "context": 512, "device": H100,
             "ms": {n: 2.0 + 0.25 * (n - 1) for n in range(1, 18)}}
    return {k: v for k, v in {**curve, **changes}.items() if v is not None}


def _rows_file(tmp_path, curve: dict):
    """``gpu_check.jsonl`` holding one finished cost-curve row, written by gpu_check's own ``Rows``."""
    gpu_check = _script("gpu_check")
    path = tmp_path / "gpu_check.jsonl"
    rows = gpu_check.Rows(path)
    row = rows.add(gpu_check.Row(f"cost curve {curve['shape']}-shape {curve['kv']} 1 row", "ok"))
    row.curve = curve
    rows.finish(row)
    return path


def test_gpu_check_records_the_device_its_cost_curve_was_measured_on(monkeypatch, tmp_path):
    """The curve row says where it was measured: ``cpu`` for ``gpu_check --cpu``, the CUDA
    device's name on a GPU (so the prediction can refuse a CPU curve)."""
    import torch
    from conftest import tiny_llama

    gpu_check = _script("gpu_check")
    rows = gpu_check.Rows(tmp_path / "rows.jsonl")
    gpu_check.cost_curve(rows, "smollm2", tiny_llama(vocab=64, layers=2, hidden=32), "cpu", float("inf"))
    written = json.loads((tmp_path / "rows.jsonl").read_text())
    assert written["result"] == "ok", written
    assert written["curve"]["device"] == "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: H100)
    assert gpu_check.device_name("cuda") == H100 and gpu_check.device_name("cpu") == "cpu"


@pytest.mark.parametrize("changes, named", [
    ({"kv": "static", "dtype": "float32", "context": 32, "device": "cpu", "ms": {1: 40.0, 2: 55.0, 3: 70.0}},
     (r"kv=static, dtype=float32, context=32, device=cpu, widths=\[1, 2, 3\]\) cannot be priced: "
      r"kv, dtype, context, device, widths wrong")),  # exactly what `gpu_check --cpu` writes
    ({"device": None}, r"device=not recorded.*: device wrong"),  # a row from before devices were recorded
    ({"kv": "static"}, r"kv=static.*: kv wrong"),
    ({"dtype": "float32"}, r"dtype=float32.*: dtype wrong"),
    ({"ms": {n: 1.0 for n in range(1, 9)}}, r"widths=\[1, 2, 3, 4, 5, 6, 7, 8\]\) cannot be priced: widths wrong"),
])
def test_gpu_prediction_refuses_a_curve_that_is_not_a_gpus_captured_bf16_curve(tmp_path, changes, named):
    """Only a CUDA device's captured bf16 step at context 512 over widths 1..17 is priced as a GPU's
    curve; anything else is refused naming its kv, dtype, context, device and widths."""
    gpu_prediction = _script("gpu_prediction")
    with pytest.raises(ValueError, match=named):
        gpu_prediction.measured_curves(_rows_file(tmp_path, _curve(**changes)))


def test_gpu_prediction_names_the_measuring_device_and_divides_no_curve_by_another_devices(tmp_path):
    """The measured curve's label and summary keys carry its device; its plain is divided by the
    stored (H200) eager plain only when it was measured on an H200 too, and a line says why not."""
    gpu_prediction = _script("gpu_prediction")
    measured = gpu_prediction.measured_curves(_rows_file(tmp_path, _curve()))
    name = f"measured-graphs on {H100}"
    got = gpu_prediction.curves(stored_curves(tmp_path), "llama1b", measured)
    assert set(got) == {"eager", "graphed-rel", "graphed-linear", name}
    assert got[name][0] == pytest.approx(2.0e-3)
    assert H100 in gpu_prediction.headline(measured, 3, 1e-3)

    def sim(plain: float) -> dict:  # tokens/s per policy under one curve
        return {"plain": {"all": plain}, "ngram-auto": {"all": 2 * plain}, "suffix-auto": {"all": 3 * plain}}

    res = {"eager": sim(10.0), "graphed-rel": sim(40.0), "graphed-linear": sim(30.0), name: sim(50.0)}
    line, notes = gpu_prediction.summary(res, measured["llama1b"])
    assert not [k for k in line if "over_eager_plain" in k and "measured" in k], line
    assert line[f"ngram-auto_over_compiled_plain[{name}]"] == pytest.approx(2.0)  # within the H100's curve
    assert line["compiled_plain_over_eager_plain"] == pytest.approx(4.0)  # both stored H200 curves
    assert len(notes) == 1 and H100 in notes[0] and "left out" in notes[0]
    h200 = {**measured["llama1b"], "device": "NVIDIA H200"}
    res = {**{k: v for k, v in res.items() if k != name}, "measured-graphs on NVIDIA H200": sim(50.0)}
    line, notes = gpu_prediction.summary(res, h200)
    assert line["measured-graphs on NVIDIA H200_plain_over_eager_plain"] == pytest.approx(5.0) and not notes


def test_gpu_check_runs_the_captured_step_cases_before_its_budget_runs_out(monkeypatch):
    """A CUDA run's exactness matrix (driven on the fake clock, each case 10 s and failing fast):
    a budget of 8 rows runs the ``graphs`` rows of both dtypes, skips the rest (the compiled step
    last), and the line under the table counts the skipped rows."""
    from types import SimpleNamespace

    import conftest
    from helpers import EVERY_PROPOSER

    gpu_check = _script("gpu_check")
    clock, met, real = FakeClock(), [], conftest.tiny_llama

    class OnHost:  # a CUDA run's models, kept on this CPU (only the reference runs them)
        def __init__(self, **kw) -> None:
            self.model = real(**kw)

        def to(self, dev, dtype):
            return self.model.to(dtype)

    def runtime(kv, model):
        clock.t += 10.0
        met.append((str(model.dtype).removeprefix("torch."), kv))
        raise RuntimeError("no CUDA here (the test's runtime)")

    monkeypatch.setattr(conftest, "tiny_llama", OnHost)
    monkeypatch.setattr(gpu_check, "runtime", runtime)
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(monotonic=clock))
    rows = gpu_check.Rows(None)
    gpu_check._exactness(rows, "cuda", 4, 75.0, True, None)  # rows start at 0, 10, ..., 70 s: 8 run
    assert met == [("float32", "graphs")] * 4 + [("bfloat16", "graphs")] * 4
    assert all(r.result == "FAIL" and "no CUDA here" in r.note for r in rows[:8])
    assert all(r.result == "skip" and r.note == gpu_check.BUDGET_SPENT for r in rows[8:])
    assert [r.check for r in rows[-4:]] == ["ngram float32 compiled 1 row", "ngram float32 compiled batch of 3",
                                            "ngram bfloat16 compiled 1 row", "ngram bfloat16 compiled batch of 3"]
    assert len(rows) == 2 * 2 * (2 + 2 * len(EVERY_PROPOSER) + 1)  # dtypes x layouts x (graphs, both caches, compiled)
    assert f"{len(rows) - 8} of {len(rows)} rows SKIPPED" in gpu_check.skipped_line(rows, 75.0)
    assert "no row skipped" in gpu_check.skipped_line(rows[:8], 75.0)
