"""The llama.cpp runtime, round 11: the bench baselines' context, threads under CPU affinity, a failed
prefill, config fields llama.cpp reads as 32-bit integers, and ``verbose: false`` hiding warnings."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch
from test_llamacpp import HAVE_LLAMA, _cfg, _model_test

from spec_plugins.config import ConfigError, SpecConfig

INT32_MAX = 2**31 - 1


def _build(**target):
    from spec_plugins.backends import build_runtime

    return build_runtime(SpecConfig.parse(_cfg(**target)).target)


@pytest.fixture(scope="module")
def rt():
    r = _build(n_ctx=256)
    yield r
    r.close()


# ---- config fields llama.cpp reads as 32-bit integers ------------------------------------------
@pytest.mark.parametrize("field", ["n_ctx", "n_batch"])  # threads: at most MAX_THREADS (test_llamacpp_round14.py)
def test_values_past_int32_are_refused_naming_the_field(field):
    with pytest.raises(ConfigError, match=rf"{field}.*less than or equal to {INT32_MAX}"):
        SpecConfig.parse(_cfg(**{field: 2**32 + 256}))  # uint32 would wrap this n_ctx to 256
    assert getattr(SpecConfig.parse(_cfg(**{field: INT32_MAX})).target, field) == INT32_MAX


# ---- threads follow the CPU affinity -----------------------------------------------------------
def test_unset_threads_are_the_usable_cores_not_the_machine_s(monkeypatch):
    from spec_plugins.backends.llamacpp_threads import thread_counts, usable_cores

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    if hasattr(os, "process_cpu_count"):
        monkeypatch.setattr(os, "process_cpu_count", lambda: 3)
    else:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9}, raising=False)
    assert usable_cores() == 3
    assert thread_counts(None, None) == (3, 3) and thread_counts(None, 7) == (3, 7) and thread_counts(2, None) == (2, 2)
    monkeypatch.delattr(os, "process_cpu_count", raising=False)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert usable_cores() == 64  # no affinity API: the machine's count


@_model_test
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity control and two usable cores")
def test_a_runtime_under_taskset_uses_only_its_allowed_core():
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # as `taskset -c N` would
    try:
        r = _build(n_ctx=64, threads=None)
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        assert (r.threads, r.threads_batch) == (1, 1)
    finally:
        r.close()


# ---- a failed prefill, bad token ids -----------------------------------------------------------
def test_the_invalid_batch_message_names_a_bad_token_id():
    from spec_plugins.backends.llamacpp_runtime import _decode_error

    assert "token id outside the vocabulary" in _decode_error(-1, 256)


@_model_test
def test_a_bad_token_id_is_refused_and_a_failed_prefill_leaves_no_rows(rt):
    V = rt.vocab_size
    rt.prefill([[1, 2, 3]])
    want = rt.forward(torch.tensor([[4]])).logits
    rt.commit([[0]])
    rt.prefill([[1, 2, 3]])
    with pytest.raises(ValueError, match=rf"token id {V + 5} is outside the model's vocabulary"):
        rt.forward(torch.tensor([[V + 5]]))
    assert rt.lengths() == [3]  # a refused forward leaves the row as it was
    assert torch.equal(rt.forward(torch.tensor([[4]])).logits, want)
    rt.commit([[0]])
    for bad in (V + 5, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            rt.prefill([[1, bad]])
        assert rt.lengths() == []  # its cache was cleared: no row claims cells that are gone
        with pytest.raises(ValueError, match="holds 0"):
            rt.forward(torch.tensor([[5]]))
    rt.prefill([[1, 2, 3]])  # the runtime recovers: same logits as before the failures
    assert torch.equal(rt.forward(torch.tensor([[4]])).logits, want)
    rt.commit([[0]])


# ---- verbose: false prints llama.cpp's errors only ---------------------------------------------
def _llama_log():
    """llama.cpp's own log entry, ``llama_log_internal(level, fmt, ...)`` (C++ name), through which its
    WARN/ERROR lines reach the callback ``llama_log_set`` installed; skips where it is not exported."""
    from llama_cpp import llama_cpp as lib

    fn = getattr(lib._lib, "_Z18llama_log_internal14ggml_log_levelPKcz", None)
    if fn is None:
        pytest.skip("this llama-cpp-python's libllama exports no llama_log_internal")
    return lambda level, text: fn(ctypes.c_int(level), b"%s", text.encode())


@_model_test
def test_verbose_false_drops_warnings_and_keeps_errors(rt, capfd):
    log = _llama_log()  # ggml.h: WARN = 3, ERROR = 4, CONT = 5 (continues the previous line)
    gc.collect()  # the installed callback must outlive any collection
    capfd.readouterr()
    log(3, "round11 warning line\n")
    log(5, "round11 warning tail\n")
    log(4, "round11 error line\n")
    log(5, "round11 error tail\n")
    err = capfd.readouterr().err
    assert "round11 warning" not in err
    assert "round11 error line" in err and "round11 error tail" in err


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python not installed (the [llamacpp] extra)")
def test_verbose_true_still_prints_every_level_and_the_callback_is_installed_once(capfd):
    import llama_cpp
    from llama_cpp._logger import set_verbose
    from spec_plugins.backends import llamacpp_logs

    log = _llama_log()
    llamacpp_logs.set_log_verbosity(llama_cpp, True)
    first = llamacpp_logs._callback
    llamacpp_logs.set_log_verbosity(llama_cpp, True)
    assert first is not None and llamacpp_logs._callback is first
    try:
        capfd.readouterr()
        for level in (1, 2, 3, 4):
            log(level, f"round11 level {level}\n")
        err = capfd.readouterr().err
        assert all(f"round11 level {level}" in err for level in (1, 2, 3, 4))
    finally:
        set_verbose(False)


# ---- bench baselines: plain llama-cpp-python gets the target's context -------------------------
@_model_test
def test_plain_baseline_runs_a_turn_past_2048_tokens_and_prompt_lookup_names_its_cap():
    from spec_plugins import SpeculativeDecoder
    from spec_plugins.bench.baselines import BASELINES, BaselineContext

    dec = SpeculativeDecoder.from_config(_cfg(n_ctx=4096))
    ids = [1] + [28, 216, 33] * 683  # 2050 tokens: fits the target's 4096 cells, not 2048
    ours = dec.without_speculation().generate(ids, max_new_tokens=3).token_ids
    ctx = BaselineContext(dec, 4, tuple(dec.eos_ids()))
    assert BASELINES.get("llamacpp")(ctx)(ids, 3).tokens == ours
    with pytest.raises(ValueError, match=r"n_ctx=2048 \(capped at 2048.*draft model"):
        BASELINES.get("llamacpp_prompt_lookup")(ctx)(ids, 3)
    dec.target.close()
