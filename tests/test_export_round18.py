"""Export round 18: a SIGTERM during an export left its hidden temporary directory for good (and
no later export removed it); a head directory of another kind exported fine and only the runtime
refused it (a Medusa load of an EAGLE head read like a model mismatch); ``export check --gamma``
past the graph's context failed on a position, never naming --gamma; ``export tensorrt`` with a
bad --max-context or --graph only said to install TensorRT."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.graphs.manifest import Manifest  # noqa: E402
from test_onnx_runtime import tiny_model_dir  # noqa: E402, F401  (the fixture)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _temps(directory: Path, out: str = "out") -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(f".{out}.tmp-"))


# ---- 1. SIGTERM unwinds; killed exports' leftovers are removed ----------------------------------
_EXPORT_THEN_WAIT = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import tiny_llama
from spec_plugins.exporters.onnx_export import export_models

out = Path(sys.argv[1])

def log(msg):
    if msg.startswith("exporting verify"):  # the temporary directory exists: stay inside the export
        (out.parent / "ready").write_text("")
        time.sleep(300)

{run}
"""
_EXPORT = 'export_models(out, (tiny_llama(), None, "t"), log=log)'
# a caller that catches SystemExit (pytest, a notebook, a program that goes on with other work)
_EXPORT_CAUGHT = f"""
try:
    {_EXPORT}
except SystemExit:
    (out.parent / "went_on").write_text("")
"""


def _terminated_export(tmp_path: Path, run: str) -> tuple[int, str]:
    """Run ``run`` (an export) in a new process, SIGTERM it once its temporary directory exists;
    its returncode and stderr."""
    script = _EXPORT_THEN_WAIT.format(tests=str(TESTS), run=run)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out")], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.1)
        assert len(_temps(tmp_path)) == 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_sigterm_during_an_export_leaves_no_temporary_directory(tmp_path):
    """A real export process, terminated while its temporary directory exists, removes it (and
    writes no output), then dies by the signal (-15 here, 143 in a shell); before, SIGTERM ended
    Python where it stood and the directory stayed."""
    rc, err = _terminated_export(tmp_path, _EXPORT)
    assert _temps(tmp_path) == [] and not (tmp_path / "out").exists(), err
    assert rc == -signal.SIGTERM, err


def test_sigterm_during_an_export_ends_a_process_that_catches_systemexit(tmp_path):
    """The cleanup's SystemExit(143) was the end of it: a caller catching it (pytest failed one
    test and ran the next; a program with a non-daemon thread stayed alive) went on after a
    SIGTERM. The signal is delivered again once the directory is removed."""
    rc, err = _terminated_export(tmp_path, _EXPORT_CAUGHT)
    assert not (tmp_path / "went_on").exists(), err
    assert rc == -signal.SIGTERM, err
    assert _temps(tmp_path) == [] and not (tmp_path / "out").exists(), err


def test_a_sigterm_handler_installed_during_an_export_is_kept(tmp_path):
    """Leaving the export set SIGTERM back to the default whatever was there: a handler the
    program installed meanwhile (a callback, a lazy import) was dropped."""
    from spec_plugins.exporters.staging import staged

    def mine(signum: int, frame: object) -> None:
        pass

    try:
        with staged(tmp_path / "out"):
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, mine)  # the export's own
            signal.signal(signal.SIGTERM, mine)
        assert signal.getsignal(signal.SIGTERM) is mine
        with staged(tmp_path / "out2"):
            pass
        assert signal.getsignal(signal.SIGTERM) is mine  # a program's handler is left alone
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_killed_exports_temporary_directory_is_removed_by_the_next_export(tmp_path):
    """Leftovers named for a dead process of this host go (its renamed-aside previous output too);
    a running process's, another host's and one named without a pid stay. The handler the export
    installs for SIGTERM is gone afterwards."""
    from spec_plugins.exporters.staging import staging_prefix

    out = tmp_path / "out"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{staging_prefix(out, gone.pid)}abcd1234"
    dead_old = tmp_path / f"{dead.name}-old"
    live = tmp_path / f"{staging_prefix(out, os.getpid())}efgh5678"
    other_host = tmp_path / f".out.tmp-{gone.pid}@elsewhere-ijkl9012"
    unnamed = tmp_path / ".out.tmp-mnop3456"
    for d in (dead, dead_old, live, other_host, unnamed):
        d.mkdir()
        (d / "verify.onnx").write_bytes(b"half")
    export_models(out, (tiny_llama(), None, "t"))
    assert Manifest.read(out).graph("verify")
    assert _temps(tmp_path) == sorted(p.name for p in (live, other_host, unnamed))
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_temporary_directory_of_another_boot_is_kept(tmp_path, monkeypatch):
    """A directory's tag was host name + pid namespace, and every host's initial pid namespace has
    the same inode: an export on another host of the same name (a shared cache on NFS, containers
    with a fixed host name) looked like a dead process of this one and was deleted while it ran.
    The tag names this boot; where the system has no boot id, nothing is removed."""
    from spec_plugins.exporters import staging
    from spec_plugins.exporters.staging import remove_stale, staging_prefix

    boot = Path("/proc/sys/kernel/random/boot_id")
    if not boot.exists():
        pytest.skip("no boot id on this system")
    mine = re.sub(r"[^0-9a-f]", "", boot.read_text())[:16]
    out = tmp_path / "out"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    prefix = staging_prefix(out, gone.pid)
    assert f".{mine}" in prefix
    elsewhere = f".{int(mine[0], 16) ^ 1:x}{mine[1:]}"  # same host name and namespace, another boot
    ours, theirs = tmp_path / f"{prefix}abcd1234", tmp_path / f"{prefix.replace(f'.{mine}', elsewhere)}efgh5678"
    for d in (ours, theirs):
        d.mkdir()
    assert remove_stale(out) == [ours] and _temps(tmp_path) == [theirs.name]
    ours.mkdir()
    monkeypatch.setattr(staging, "BOOT_ID", tmp_path / "no-boot-id")  # as on a system without one
    assert remove_stale(out) == [] and _temps(tmp_path) == sorted(p.name for p in (ours, theirs))


# ---- 2. a head directory of another kind ---------------------------------------------------------
@pytest.fixture
def heads(tiny_model_dir, tmp_path):  # noqa: F811
    """A tiny local model and an EAGLE and a parallel head made for it (random weights)."""
    from test_heads import eagle
    from test_parallel import drafter
    from transformers import AutoModelForCausalLM

    from spec_plugins.heads import save_head

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    for name, head in (("eagle", eagle(model)), ("parallel", drafter(model))):
        save_head(head, head.config.to_dict(), tmp_path / "heads" / name)
    return model, tiny_model_dir, tmp_path / "heads"


@pytest.mark.parametrize("kind,directory,says", [
    ("parallel", "eagle", "does not hold a parallel head: it holds an eagle head"),
    ("eagle", "parallel", "does not hold an eagle head: it holds a parallel head"),
])
def test_export_refuses_a_head_of_another_kind_as_the_runtime_does(heads, tmp_path, kind, directory, says):
    """``type: parallel`` with an EAGLE head (and back) exported the whole graph set, which the
    runtime then refused; the export now refuses it first, with the runtime's own message."""
    from spec_plugins import SpecConfig
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.exporters.onnx_export import export_config
    from spec_plugins.registry import PROPOSERS

    model, model_dir, root = heads
    section = {"type": kind, "heads": str(root / directory)}
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": str(model_dir)}, "proposer": section})
    with pytest.raises(ValueError) as exported:
        export_config(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _temps(tmp_path) == []
    cls = PROPOSERS.get(kind)
    with pytest.raises(ValueError) as runtime:
        cls(cls.Config(**section), target=TorchRuntime(model))
    assert str(exported.value) == str(runtime.value)
    assert says in str(exported.value)


def test_a_medusa_load_of_an_eagle_head_names_the_kind_it_holds(heads):
    """Was ``does not hold a medusa head for this model (KeyError: 'num_layers')`` (then "it holds
    a eagle head")."""
    from spec_plugins.heads import MedusaHeads

    model, _, root = heads
    with pytest.raises(ValueError, match=r"does not hold a medusa head: it holds an eagle head \(its config.json "
                                         r"says kind 'eagle'\); load it with proposer type eagle"):
        MedusaHeads.from_pretrained(str(root / "eagle"), model)


# ---- 3 and 4: a 64-position export ------------------------------------------------------------------
@pytest.fixture(scope="module")
def short(tmp_path_factory):
    model = tiny_llama(vocab=32, seed=2, sharpness=3.0, max_pos=64)
    d = tmp_path_factory.mktemp("short") / "onnx"
    export_models(d, (model, None, "t"))
    return model, d


def test_export_check_refuses_a_gamma_past_the_context_naming_it(short):
    """--gamma 20 on 64 positions failed on ``position N exceeds the context of 64``. It is
    refused before anything runs, naming --gamma, the positions needed and the largest gamma that
    fits, which runs through (and one more is refused)."""
    from spec_plugins.exporters.parity import check_export

    model, d = short
    with pytest.raises(ValueError, match=r"--gamma 20: .* need \d+ positions, but it holds 64 positions of context; "
                                         r"use --gamma \d+ or less") as exc:
        check_export(d, gamma=20, max_new_tokens=4, models={"t": model})
    fits = int(re.search(r"use --gamma (\d+)", str(exc.value)).group(1))
    assert 1 <= fits < 20
    report = check_export(d, gamma=fits, max_new_tokens=4, models={"t": model})
    assert report.ok, report.format()
    with pytest.raises(ValueError, match=f"--gamma {fits + 1}: "):
        check_export(d, gamma=fits + 1, max_new_tokens=4, models={"t": model})


# What HEAD's check_runtimes fed the torch runtime at --gamma 3 on this export (the 24-token prompt
# 1..24, seed 0): each forward's tokens (and a tree's parents), each commit, the rollback.
_HEAD_STEPS = [
    ("forward", [[2], [15]], None), ("commit", [[0], [0]]),
    ("forward", [[3, 4], [3, 7]], None), ("commit", [[0, 1], [0, 1]]),
    ("forward", [[4, 5, 6], [23, 6, 24]], None), ("commit", [[0], [0]]),
    ("forward", [[5, 6, 7, 8], [23, 14, 24, 17]], None), ("commit", [[0, 1], [0, 1]]),
    ("forward", [[20, 19, 16, 19], [5, 30, 15, 15]], (-1, 0, 0, 1)), ("commit", [[0, 1, 3], [0]]),
    ("rollback", [30, 16]),
    ("forward", [[0, 18], [3, 24]], None),
]


class _Noting:
    """The runtime it wraps, every call passed on; notes the arguments of the steps that change its
    state (forward, commit, rollback)."""

    def __init__(self, runtime: object) -> None:
        self.runtime, self.steps = runtime, []

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.runtime, name)
        if name not in ("forward", "commit", "rollback"):
            return call

        def noted(first: Any, *args: Any, **kwargs: Any) -> Any:
            tree = kwargs.get("tree")
            self.steps.append((name, first.tolist(), tree and tree.parents) if name == "forward" else (name, first))
            return call(first, *args, **kwargs)
        return noted


def _runtimes(short: tuple) -> tuple:
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime, create_session
    from spec_plugins.backends.torch_runtime import TorchRuntime

    model, d = short
    g = Manifest.read(d).graph("verify")
    return _Noting(TorchRuntime(model)), OnnxRuntime(create_session(d / g.file, "cpu", threads=1), g)


def test_export_check_runs_the_real_input_steps_it_ran_before(short):
    """The plan drawn up front for the gamma check took its commits from a generator of its own
    before the steps' tokens: every commit and token after the first changed, so a seed's cases
    were no longer those of earlier checks. It draws in the order the steps always did."""
    from spec_plugins.exporters.parity import check_runtimes

    torch_rt, ort_rt = _runtimes(short)
    cases = check_runtimes("verify", torch_rt, ort_rt, list(range(1, 25)), 3, 1e-3)
    assert cases and all(c.ok for c in cases), [c for c in cases if not c.ok]
    assert torch_rt.steps == _HEAD_STEPS


def test_export_check_refuses_the_gammas_the_runtimes_refuse_and_no_other(short):
    """The gamma check held every node of every step below the context, but the runtimes refuse
    only a step that starts at or past it (a node past it is clamped to its last position, as in
    decoding): gammas whose steps ran were refused. A gamma is refused exactly where the real-input
    steps stop on a position."""
    from spec_plugins.exporters.parity import check_runtimes
    from spec_plugins.exporters.parity_plan import check_gamma

    verdicts = []
    for gamma in range(1, 13):
        try:
            check_gamma("verify", gamma, 24, 64, vocab=32)
            refused = False
        except ValueError:
            refused = True
        try:
            check_runtimes("verify", *_runtimes(short), list(range(1, 25)), gamma, 1e-3)
            ran = True
        except ValueError as exc:
            assert "exceeds the context of 64" in str(exc)
            ran = False
        verdicts.append((gamma, refused, ran))
    assert [v for v in verdicts if v[1] == v[2]] == []
    assert {refused for _, refused, _ in verdicts} == {True, False}


@pytest.mark.parametrize("args,needle", [
    (["--max-context", "100000"], "--max-context 100000 exceeds the 64 positions of graph 'verify'"),
    (["--graph", "nope"], "no decoder graph to build in"),
])
def test_export_tensorrt_names_a_bad_argument_before_asking_for_tensorrt(short, tmp_path, args, needle):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    _, d = short
    res = CliRunner().invoke(app, ["export", "tensorrt", "--onnx", str(d), "--out", str(tmp_path / "e"), *args])
    assert res.exit_code != 0 and needle in res.output and "spec-plugins[tensorrt]" not in res.output, res.output
    assert not (tmp_path / "e").exists()
    json.loads((d / "manifest.json").read_text())  # the export it read is untouched
