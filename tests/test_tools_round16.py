"""Round 16: the replay's input checks and its cross-request memory, the bench summary's matmul
setting, the vLLM adapter's row recognition and config path, and the static runtime's regrowth."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_bench import word_tokenizer

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench import BenchOptions, BenchPrompt, run_bench
from spec_plugins.config import SpecConfig
from spec_plugins.decoder import SpeculativeDecoder

SAME = "w3 w9 w1 w4 w1 w5 w9 w2 w6"
SUFFIX = {"type": "suffix", "scope": "global", "num_draft_tokens": 8, "tree_nodes": 8, "min_token_prob": 0.0,
          "max_spec_factor": 4}


@pytest.fixture(scope="module")
def sequence_bench(tmp_path_factory):
    """A greedy bench of suffix (``scope: global``) with ``--memory sequence`` over two identical
    prompts in two categories, on a runtime measured with ``matmul: auto_transposed``: the decoder,
    its report (saved with its config and prompts file) and the paths."""
    d = tmp_path_factory.mktemp("seq")
    cfg = d / "c.yaml"
    cfg.write_text(f"target: {{backend: torch, model: tiny-test-model}}\nproposer: {json.dumps(SUFFIX)}\n")
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": q, "category": q, "turns": [SAME]}) + "\n" for q in "ab"))
    dec = SpeculativeDecoder.from_config(SpecConfig.from_file(cfg), target=TorchRuntime(
        tiny_llama(seed=3), word_tokenizer(), matmul="auto_transposed"))
    opts = BenchOptions(max_new_tokens=24, runs=1, gammas=[4], auto=False, progress=False, cost_positions=4,
                        baselines=[], memory="sequence")
    prompt_list = [BenchPrompt(q, q, (SAME,)) for q in "ab"]
    rep = run_bench(dec, prompt_list, opts, meta={"config": str(cfg), "memory": "sequence"})
    report = d / "report.json"
    report.write_text(json.dumps(rep))
    return SimpleNamespace(dec=dec, report=rep, report_path=report, prompts=prompts, dir=d)


def _no_load(*a, **k):
    raise AssertionError("a model loaded before the replay's inputs were checked")


# ---- 1. a prompts file that is not the bench's -----------------------------------------------------------------
def test_replay_names_a_prompts_file_lacking_a_recorded_question_id(sequence_bench, tmp_path, monkeypatch, capsys):
    from spec_plugins.bench import replay

    monkeypatch.setattr(SpeculativeDecoder, "from_config", _no_load)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question_id": "a", "category": "a", "turns": [SAME]}) + "\n")
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"question_id": q, "category": q, "turns": [SAME, SAME]}) + "\n" for q in "ab"))
    for prompts, named in ((other, f"--prompts: {other} lacks question_id 'b' recorded in the report"),
                           (two, f"--prompts: {two}: question_id 'a' has 2 turns, the report recorded 1"),
                           (tmp_path / "none.jsonl", "--prompts: prompt file not found")):
        with pytest.raises(SystemExit) as exc:
            replay.main(["--report", str(sequence_bench.report_path), "--prompts", str(prompts), "--gammas", "4"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and named in err, err


# ---- 2. a report that cannot be read -------------------------------------------------------------------------
@pytest.mark.parametrize("content, named", [
    (None, "cannot read it"),
    ("{not json", "not a JSON file"),
    ("[1, 2]", "not a bench report.json (it lacks meta, prompts"),
    ('{"meta": {"greedy": true}}', "not a bench report.json (it lacks prompts, methods, summary, cost_model)"),
    (b"\xff\xfe{", "not a JSON file"),
])
def test_replay_refuses_a_report_it_cannot_read(tmp_path, monkeypatch, capsys, content, named):
    from spec_plugins.bench import replay

    monkeypatch.setattr(SpeculativeDecoder, "from_config", _no_load)
    path = tmp_path / "report.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1"}\n')
    with pytest.raises(SystemExit) as exc:
        replay.main(["--report", str(path), "--prompts", str(prompts), "--gammas", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--report {path}: {named}" in err, err


# ---- 3. the bench's cross-request memory ----------------------------------------------------------------------
def test_replay_keeps_the_cross_request_memory_the_bench_kept(sequence_bench):
    """With ``--memory sequence`` the second identical prompt drafts from the first in the bench;
    the replay decodes it with the same memory (one proposer over the run, ``memory_spans``), so it
    replays faster, where a fresh proposer per turn replays both alike."""
    from spec_plugins.bench.replay import fixed, memory_spans, replay_report, turns_from_report
    from spec_plugins.policy import ForwardCost
    from spec_plugins.proposers.suffix import SuffixProposer

    rep, dec = sequence_bench.report, sequence_bench.dec
    acc = {p["question_id"]: p["methods"]["ours_k4"]["stats"]["mean_accepted_tokens"] for p in rep["prompts"]}
    assert acc["b"] > acc["a"] + 1.0  # the bench: b drafted from a's finished request
    turns = turns_from_report(rep, str(sequence_bench.prompts), dec)
    cost = ForwardCost.from_curve([0.01 + 0.001 * i for i in range(40)])
    limits = {"max_new": rep["meta"]["max_new_tokens"], "eos_ids": list(dec.eos_ids())}
    make = lambda: SuffixProposer(dec.config.proposer)  # noqa: E731
    assert memory_spans(rep) == [2]
    kept = replay_report(turns, make, {"k4": fixed(4)}, cost, 0.0, spans=memory_spans(rep), **limits)
    assert kept["k4"]["b"] > 1.2 * kept["k4"]["a"]
    fresh = replay_report(turns, make, {"k4": fixed(4)}, cost, 0.0, **limits)
    assert fresh["k4"]["b"] == pytest.approx(fresh["k4"]["a"]) == pytest.approx(kept["k4"]["a"])
    independent = {**rep, "meta": {**rep["meta"], "memory": "independent"}}
    assert memory_spans(independent) == [1, 1] and memory_spans({**rep, "meta": {}}) == [1, 1]
    with pytest.raises(ValueError, match=r"memory spans \[1\] do not cover the 2 turns"):
        replay_report(turns, make, {}, cost, 0.0, spans=[1], **limits)


def test_replay_cli_replays_with_the_reports_memory(sequence_bench, monkeypatch, capsys):
    from spec_plugins.bench import recorded, replay

    seen = []
    real = replay.replay_report

    def spy(*a, **k):
        seen.append(k.get("spans"))
        return real(*a, **k)

    monkeypatch.setattr(SpeculativeDecoder, "from_config", lambda cfg: sequence_bench.dec)
    monkeypatch.setattr(replay, "replay_report", spy)
    replay.main(["--report", str(sequence_bench.report_path), "--prompts", str(sequence_bench.prompts),
                 "--gammas", "4"])
    assert seen == [[2]] and "auto/best" in capsys.readouterr().out
    assert "meta.memory is 'forever'" in recorded.not_replayable({"greedy": True, "max_new_tokens": 4,
                                                                  "memory": "forever"})


# ---- 4. the summary's matmul setting -----------------------------------------------------------------------
def test_summary_names_the_matmul_setting_the_run_measured_with(sequence_bench):
    from spec_plugins.bench.report import markdown

    rep = sequence_bench.report
    assert "transposed_1row_ms" in rep["target_kernels"]
    assert "Target matmul kernels (measured at load, `matmul: auto_transposed`)" in markdown(rep)
    plain = copy.deepcopy(rep)
    for key in ("transposed_1row_ms", "use_transposed"):
        del plain["target_kernels"][key]
    assert "Target matmul kernels (measured at load, `matmul: auto`)" in markdown(plain)


# ---- 5. vLLM: a row is recognised by its head, tail and middle; a mistyped config path ------------------------------
def _vllm_call(drafter, histories, sampled):
    ids = np.zeros((4, max([512, *map(len, histories)])), dtype=np.int32)
    lens = np.zeros(4, dtype=np.int32)
    for i, h in enumerate(histories):
        ids[i, : len(h)] = h
        lens[i] = len(h)
    return drafter.propose(sampled, lens, ids)


def _cfg(k=4):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k))


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_vllm_a_new_request_sharing_head_and_tail_is_not_the_finished_one(kind):
    """X finishes; Y, sharing X's first and last 40 tokens but not its middle, takes X's row: Y gets
    an index of its own history and X enters the global index."""
    from spec_plugins.integrations.vllm import NgramDrafter, SuffixDrafter

    head, tail = list(range(100, 140)), list(range(200, 240))
    x = head + [1, 2, 3, 4, 5, 6, 7, 8] + tail + [300]
    y = head + [9, 9, 9, 9, 9, 9, 9, 9] + tail + [300]
    d = (SuffixDrafter(_cfg(), {"type": "suffix", "scope": "global", "min_token_prob": 0.0}) if kind == "suffix"
         else NgramDrafter(_cfg(), {"type": "ngram"}))
    _vllm_call(d, [x], [[300]])
    first = d.rows.held[0]
    _vllm_call(d, [y], [[300]])
    assert d.rows.held[0] is not first and d.rows.held[0].tokens == y
    if kind == "suffix":
        assert d.index.stats.requests == 1  # X, finished
    # the same request continued: its index kept and extended
    held = d.rows.held[0]
    _vllm_call(d, [y + [5, 6]], [[5, 6]])
    assert d.rows.held[0] is held and held.tokens == y + [5, 6]


def test_vllm_a_long_request_differing_only_in_its_middle_is_not_the_finished_one():
    """Past 2 x 32 + 127 tokens the middle is read at a stride (14 at 1,000 tokens): a 20-token
    difference there is still seen, and the same request continuing is still recognised."""
    from spec_plugins.integrations.vllm import NgramDrafter

    x = [int(t) for t in np.random.default_rng(3).integers(0, 500, size=1000)]
    y = x[:500] + [t + 1 for t in x[500:520]] + x[520:]
    d = NgramDrafter(_cfg(), {"type": "ngram"})
    _vllm_call(d, [x], [[x[-1]]])
    first = d.rows.held[0]
    _vllm_call(d, [y], [[y[-1]]])
    assert d.rows.held[0] is not first and d.rows.held[0].tokens == y
    _vllm_call(d, [y + [5]], [[5]])
    assert d.rows.held[0].tokens == y + [5]


def test_vllm_a_config_path_that_is_not_there_is_named(tmp_path, monkeypatch):
    from spec_plugins.integrations.vllm import ENV, SuffixDrafter

    for missing in (str(tmp_path / "suffix.yaml"), "configs/suffix", "suffix.json"):
        monkeypatch.setenv(ENV, missing)
        with pytest.raises(FileNotFoundError, match=f"{ENV}={missing!r}: file not found"):
            SuffixDrafter(_cfg())
    real = tmp_path / "s.yaml"
    real.write_text("proposer: {type: suffix, min_token_prob: 0.2}\n")
    for value in (str(real), "{type: suffix, min_token_prob: 0.2}", "type: suffix\nmin_token_prob: 0.2\n"):
        monkeypatch.setenv(ENV, value)
        assert SuffixDrafter(_cfg()).config.min_token_prob == 0.2


# ---- 6. the static runtime's regrowth clears the steps it drops ---------------------------------------------
def test_static_regrowth_clears_every_step_it_drops():
    """A reallocation drops the compiled steps; each is cleared first (``FixedSteps.clear`` empties
    Dynamo's cache of its code, which would otherwise keep the old graphs alive)."""
    from spec_plugins.backends.torch_static import StaticTorchRuntime
    from spec_plugins.fixed_steps import FixedSteps

    cleared = []

    class Recorded(FixedSteps):
        def clear(self) -> None:
            cleared.append(self)
            super().clear()

    rt = StaticTorchRuntime(tiny_llama(seed=3))
    rt._ensure(1, 8)
    steps = {False: Recorded(lambda x: x), True: Recorded(lambda x: x)}
    rt._steps.update(steps)
    rt._ensure(1, 8)  # fits: nothing dropped
    assert cleared == [] and rt._steps == steps
    rt._ensure(64, 8)  # more rows: new buffers
    assert rt._steps == {} and sorted(map(id, cleared)) == sorted(map(id, steps.values()))
    assert isinstance(rt.cache.keys[0], torch.Tensor)
