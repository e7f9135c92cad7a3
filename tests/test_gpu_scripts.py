"""The prepared GPU scripts (``scripts/gpu_check.py``, ``gpu_speed.py``, ``gpu_prediction.py``), run
or driven on the CPU, so what a lent GPU runs is known to work before its device time is spent.
``gpu_check``'s pytest stage runs the ``cuda`` cases of ``test_devices.py``, never this file."""

from __future__ import annotations

import json

import pytest
from helpers import Built, stop_at_build


def test_gpu_check_runs_its_whole_matrix_on_the_cpu():
    """``scripts/gpu_check.sh --cpu``: the GPU acceptance check's matrix (every proposer, fp32 and
    bf16, one row and a batch with holes, against transformers' generate()) on this machine, so
    the script a lent GPU runs is known to work before the device time is spent."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers import EVERY_PROPOSER

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--max-new", "12", "--speed-tokens", "4"],
                         cwd=root, capture_output=True, text=True, timeout=600, env={
                             **__import__("os").environ, "PYTHON": sys.executable})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    for kind in EVERY_PROPOSER:
        for dtype in ("float32", "bfloat16"):
            for kv in ("dynamic", "static"):
                for layout in ("1 row", "batch of 3"):
                    row = next(r for r in rows if r.startswith(f"| {kind} {dtype} {kv} {layout} "))
                    assert "| exact " in row or "| near-tie " in row, row
    assert sum("speed smollm2-shape" in r and "| ok " in r for r in rows) == 4
    assert any(r.startswith("| cost curve smollm2-shape static 1 row ") and "| ok " in r for r in rows), rows[-3:]


# ---- the GPU scripts' own logic, cheap on the CPU ------------------------------------------------------
def _script(name: str):
    """scripts/<name>.py imported as a module (the scripts folder is not a package)."""
    import importlib
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)


def _plugin_env(monkeypatch, tmp_path, source: str, addopts: str) -> None:
    """A pytest plugin module in ``tmp_path`` that the pytest run of ``gpu_check`` loads."""
    import os

    (tmp_path / "gpu_check_fake_plugin.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PYTEST_ADDOPTS", f"-p gpu_check_fake_plugin {addopts}")


def test_gpu_check_selects_only_the_device_cases_of_the_device_tests(monkeypatch, tmp_path, capsys):
    """Collected as on a CUDA machine: the pytest stage selects the ``cuda`` cases and the TensorRT
    engine tests, never the CPU matrix (``test_gpu_scripts.py``'s ``gpu_check --cpu`` test, minutes on the device)."""
    import time

    gpu_check = _script("gpu_check")
    _plugin_env(monkeypatch, tmp_path, "import torch\ntorch.cuda.is_available = lambda: True\n", "--collect-only")
    rows = gpu_check.Rows(None)
    gpu_check.device_tests(rows, time.monotonic() + 300)
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tests/")]
    assert "test_gpu_check_runs_its_whole_matrix_on_the_cpu" not in "\n".join(listed)
    assert all(line.endswith("-cuda]") or "[cuda]" in line for line in listed if "test_devices.py" in line)
    assert sum("-cuda]" in line for line in listed) >= 20 and any("test_gpu_trt_" in line for line in listed)
    assert rows[0].result == "ok"


HANG_PLUGIN = """import os, subprocess, time
child = subprocess.Popen(["sleep", "300"])
open(os.environ["GPU_CHECK_HANG"], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(300)
"""


def test_gpu_check_kills_a_pytest_stage_that_runs_past_its_time_and_says_so(monkeypatch, tmp_path):
    """A pytest stage that outlives its timeout is a FAIL row, not an exception that loses the table,
    and neither it nor a process it started outlives the check."""
    import time

    gpu_check = _script("gpu_check")
    pids = tmp_path / "pids"
    monkeypatch.setenv("GPU_CHECK_HANG", str(pids))
    _plugin_env(monkeypatch, tmp_path, HANG_PLUGIN, "")
    monkeypatch.setattr(_script("gpu_device_tests"), "LEAST_TEST_S", 8.0)  # the whole budget is spent
    rows = gpu_check.Rows(tmp_path / "rows.jsonl")
    gpu_check.device_tests(rows, time.monotonic())
    assert rows[0].result == "FAIL" and "timed out" in rows[0].note
    assert json.loads((tmp_path / "rows.jsonl").read_text())["result"] == "FAIL"

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    assert pids.is_file(), "the hanging pytest run never started"
    for _ in range(100):  # SIGKILL is sent; the kernel ends them at once, reaping may lag
        if not any(alive(int(p)) for p in pids.read_text().split()):
            break
        time.sleep(0.05)
    assert not any(alive(int(p)) for p in pids.read_text().split()), "a test process outlived gpu_check"


def test_gpu_check_writes_each_finished_row_and_prints_the_table_when_interrupted(monkeypatch, tmp_path, capsys):
    """SIGINT (gpu_check.sh's time limit) in the middle of a row: the rows finished by then are in
    $OUT/gpu_check.jsonl, the running one is marked cut off, and the table is still printed."""
    import sys

    gpu_check = _script("gpu_check")
    real, calls = gpu_check.decode_rows, []

    def decode_rows(*a, **kw):
        calls.append(1)
        if len(calls) == 5:  # row 1: one call per prompt (3), row 2: one batch, row 3: interrupted
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(gpu_check, "decode_rows", decode_rows)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--cpu", "--max-new", "4", "--speed-tokens", "0"])
    try:
        rc = gpu_check.main()
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped gpu_check.main(): no table, nothing written")
    written = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["check"] for r in written] == ["ngram float32 dynamic 1 row", "ngram float32 dynamic batch of 3",
                                            "ngram float32 static 1 row"]
    assert [r["result"] for r in written[:2]] == ["exact", "exact"] and written[2]["result"] == "cut off"
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 4 and "| cut off " in table[-1] and rc == 130


class FakeClock:
    """The seconds gpu_speed reads (``time.monotonic`` and ``time.perf_counter``), advanced by the fakes."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeMethod:
    """A method as gpu_speed calls it: the first generate on a prompt it has not met compiles (100 s
    on the fake clock), any other takes 1 s; call number ``fail_on`` raises."""

    def __init__(self, clock: FakeClock, fail_on: int | None = None) -> None:
        self.clock, self.fail_on, self.calls, self.met = clock, fail_on, 0, set()

    def encode(self, messages) -> list[int]:
        return [ord(c) for c in messages[0]["content"][:24]]

    def generate(self, ids, max_new_tokens):
        from types import SimpleNamespace

        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("operation not permitted when stream is capturing (injected)")
        self.clock.t += 1.0 if tuple(ids) in self.met else 100.0
        self.met.add(tuple(ids))
        return SimpleNamespace(token_ids=[7] * max_new_tokens,
                               stats=SimpleNamespace(tokens_per_forward=2.0, target_forwards=1))


def _speed_run(monkeypatch, tmp_path, methods: dict, clock: FakeClock) -> dict:
    """gpu_speed.main over the first 3 dev prompts with ``methods`` as its decoders, on the fake clock."""
    import sys
    from types import SimpleNamespace

    gpu_speed = _script("gpu_speed")
    monkeypatch.setattr(gpu_speed, "decoders", lambda args: dict(methods))
    monkeypatch.setattr(gpu_speed, "time", SimpleNamespace(monotonic=clock, perf_counter=clock))
    monkeypatch.setattr(sys, "argv", ["gpu_speed.py", "--device", "cpu", "--no-ttft", "--limit", "3", "--max-new", "4",
                                      "--out", str(tmp_path / "speed.json")])
    assert gpu_speed.main() == 0
    return json.loads((tmp_path / "speed.json").read_text())


def test_gpu_speed_compiles_nothing_inside_a_timed_run(monkeypatch, tmp_path):
    """transformers' static cache is sized per prompt and our drafts differ per prompt: every method
    meets each prompt untimed first, so each timed run costs its 1 s and never a 100 s compile."""
    clock = FakeClock()
    names = ("plain eager", "plain compiled", "transformers static compile")
    rep = _speed_run(monkeypatch, tmp_path, {n: FakeMethod(clock) for n in names}, clock)
    for name in names:
        assert rep["methods"][name]["seconds"] == [1.0, 1.0, 1.0], name
        assert rep["methods"][name]["warmup_s"] == 300.0  # three prompts met, each compiled once, untimed


def test_gpu_speed_records_a_failing_method_and_runs_the_others(monkeypatch, tmp_path, capsys):
    clock = FakeClock()
    methods = {"plain eager": FakeMethod(clock), "plain compiled": FakeMethod(clock),
               "suffix auto compiled": FakeMethod(clock, fail_on=1),  # its warm-up
               "ngram auto compiled": FakeMethod(clock, fail_on=4)}  # the second prompt
    rep = _speed_run(monkeypatch, tmp_path, methods, clock)["methods"]
    assert len(rep["plain eager"]["tps"]) == len(rep["plain compiled"]["tps"]) == 3
    assert "warm-up: RuntimeError" in rep["suffix auto compiled"]["error"] and not rep["suffix auto compiled"]["tps"]
    assert "RuntimeError" in rep["ngram auto compiled"]["error"] and len(rep["ngram auto compiled"]["tps"]) < 3
    assert methods["suffix auto compiled"].calls == 1 and methods["ngram auto compiled"].calls == 4  # dropped
    out = capsys.readouterr().out
    assert "| plain compiled |" in out and "suffix auto compiled FAILED" in out and "ngram auto compiled FAILED" in out


def test_gpu_speed_times_the_first_decode_step_token_where_the_compiled_step_is_built(monkeypatch):
    """max_new_tokens=1 ends at the eager prefill's token: the compiled step (what ``compile: auto``
    makes a user wait for) is built in the first decode step, so that token is timed too."""
    from types import SimpleNamespace

    from spec_plugins.decoder import SpeculativeDecoder

    gpu_speed = _script("gpu_speed")
    clock, built = FakeClock(), []

    class Default:  # construction 1 s, prefill 2 s, the first decode step 0.5 s, +30 s where it builds the step
        def __init__(self) -> None:
            clock.t += 1.0

        def stream(self, prompt, max_new_tokens):
            clock.t += 2.0
            yield SimpleNamespace(token_ids=[5])
            for _ in range(max_new_tokens - 1):
                clock.t += 0.5 + (0.0 if built else 30.0)
                built.append(1)
                yield SimpleNamespace(token_ids=[6])

        def generate(self, prompt, max_new_tokens):
            return SimpleNamespace(token_ids=[t for ev in self.stream(prompt, max_new_tokens) for t in ev.token_ids])

    monkeypatch.setattr(SpeculativeDecoder, "from_config", staticmethod(lambda cfg: Default()))
    monkeypatch.setattr(gpu_speed, "time", SimpleNamespace(monotonic=clock, perf_counter=clock))
    got = gpu_speed.first_token(SimpleNamespace(model="m", device="cpu", dtype="float32"))
    assert got == {"prefill": {"cold": 3.0, "warm": 3.0}, "decode_step": {"cold": 33.5, "warm": 3.5}}


def test_gpu_prediction_reads_a_report_of_the_bench_default_config(monkeypatch, tmp_path):
    """``spec-plugins bench`` without --config records meta.config "built-in default": the prediction
    replays it with that default's target (not a file of that name), and names a missing config."""
    import sys
    from pathlib import Path

    import spec_plugins.backends
    from spec_plugins.config import ConfigError, default_config

    gpu_prediction = _script("gpu_prediction")
    seen = stop_at_build(monkeypatch, spec_plugins.backends, "build_runtime")
    report, dev = tmp_path / "report.json", "examples/prompts/dev.jsonl"
    answered = [{"question_id": "chat-1"}]
    greedy = {"greedy": True, "max_new_tokens": 8}  # a replayable run's meta
    report.write_text(json.dumps({"meta": {"config": "built-in default", **greedy}, "prompts": answered}))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "argv", ["gpu_prediction.py", "--report", str(report), "--prompts", dev])
    with pytest.raises(Built):
        gpu_prediction.main()
    assert seen == [default_config().target]
    report.write_text(json.dumps({"meta": {"config": str(tmp_path / "gone.yaml"), **greedy}, "prompts": answered}))
    with pytest.raises((ConfigError, FileNotFoundError), match="gone.yaml"):
        gpu_prediction.main()
    report.write_text(json.dumps({"meta": {"config": "built-in default"}, "prompts": [{"question_id": "0"}]}))
    with pytest.raises(ValueError, match=r"prompts \['0'\] of the report are not in examples/prompts/dev.jsonl"):
        gpu_prediction.main()


def stored_curves(tmp_path):
    """The H200 files' format (../shared/gpu), for both shapes."""
    shared = tmp_path / "h200"
    shared.mkdir()
    rel = {"1": 1.0, "2": 1.1, "128": 1.2}
    (shared / "h200-verify-curve.jsonl").write_text("".join(
        json.dumps({"shape": sh, "dtype": "bfloat16", "ctx": 512, "t1_ms": 9.0, "rel": rel}) + "\n"
        for sh in ("smollm2", "llama1b")))
    (shared / "h200-cuda-graphs.jsonl").write_text("".join(
        json.dumps({"shape": sh, "dtype": "bfloat16", "ctx": 512, "graph_static": {"1": 2.5, "2": 2.8}}) + "\n"
        for sh in ("smollm2", "llama1b")))
    return shared


def test_gpu_prediction_prices_the_replay_with_the_curve_gpu_check_measured(tmp_path):
    """Issue 45 item 3: the cost-curve rows ``gpu_check`` writes on the device become a curve of
    their own (``measured-<kv> on <device>``), their widths as measured and wider ones along the last step;
    a file with no such row, or a curve with a gap, is refused (no silent fallback to the
    assumed curves)."""
    gpu_check, gpu_prediction = _script("gpu_check"), _script("gpu_prediction")
    rows_file = tmp_path / "gpu_check.jsonl"
    rows = gpu_check.Rows(rows_file)
    rows.finish(rows.add(gpu_check.Row("speed llama1b-shape plain graphs 1 row", "ok", tps="400.0")))
    curve = rows.add(gpu_check.Row("cost curve llama1b-shape graphs 1 row", "ok"))
    curve.curve = {"shape": "llama1b", "kv": "graphs", "dtype": "bfloat16", "context": 512,
                   "device": "NVIDIA H200", "ms": {n: 2.0 + 0.25 * (n - 1) for n in range(1, 18)}}
    rows.finish(curve)
    measured = gpu_prediction.measured_curves(rows_file)
    shared = stored_curves(tmp_path)
    got = gpu_prediction.curves(shared, "llama1b", measured)
    secs = got["measured-graphs on NVIDIA H200"]
    assert len(secs) == 128 and set(got) >= {"eager", "graphed-rel", "graphed-linear"}
    assert secs[0] == pytest.approx(2.0e-3) and secs[16] == pytest.approx(6.0e-3)
    assert secs[20] == pytest.approx(7.0e-3)  # width 21: the 16 -> 17 step, four more times
    assert "measured-graphs on NVIDIA H200" not in gpu_prediction.curves(shared, "smollm2", measured)
    empty = tmp_path / "none.jsonl"
    gpu_check.Rows(empty).finish(gpu_check.Row("speed x", "ok"))
    with pytest.raises(ValueError, match="no finished `cost curve` row"):
        gpu_prediction.measured_curves(empty)
    with pytest.raises(ValueError, match="widths 1..N without gaps"):
        gpu_prediction._extended({1: 1.0, 3: 2.0})
