"""``gpu_check``'s last stage: the CUDA cases of the device tests, run as a pytest process group that
is killed whole at its time limit or on an interrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_rows import Row, Rows

ROOT = Path(__file__).resolve().parents[1]

# the CUDA cases only: "cuda" is the device id of test_devices' parametrized cases, "gpu_trt" names the
# TensorRT engine tests (a bare "gpu" also selected the CPU-only TensorRT checks); a CPU test in
# these files must not name "cuda" (this script's own CPU run is in tests/test_gpu_scripts.py)
DEVICE_TESTS = ("tests/test_devices.py", "tests/test_tensorrt.py", "-k", "cuda or gpu_trt")
DEVICE_STAGE = "pytest test_devices + test_tensorrt (cuda)"  # its row's name
LEAST_TEST_S = 30.0  # the pytest stage's timeout when less of the budget is left


def run_group(cmd: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own process group: (exit status, stdout, stderr), status None when it ran
    past ``timeout``. The whole group is killed then, and when this process is interrupted, so no
    test process outlives the run."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return None, out, err
    finally:
        kill_group(proc)  # KeyboardInterrupt: the group too; a no-op once it has ended


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def device_tests(rows: Rows, deadline: float) -> None:
    row = rows.add(Row(DEVICE_STAGE))
    left = max(LEAST_TEST_S, deadline - time.monotonic())
    rc, out, err = run_group([sys.executable, "-m", "pytest", "-q", *DEVICE_TESTS], left)
    print(out[-4000:], err[-2000:], flush=True)
    last = (out.strip().splitlines() or ["(no output)"])[-1]
    row.result = "ok" if rc == 0 else "FAIL"
    row.note = last if rc is not None else f"timed out after {left:.0f} s, killed; last line: {last}"
    rows.finish(row)
