"""One request never hurts another: a row whose sampling fails fails alone, admission is atomic,
the batch's invariants hold after every failure path, sampling values are safe by construction,
and every bad CLI call ends in one line naming the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import ConfigError, SamplingConfig, SpecConfig
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7], [9, 4, 9, 4], [7, 8, 9, 10, 7, 8]]


def nan_after(n: int):
    """A user logits processor that breaks after ``n`` calls (a buggy or hostile processor)."""
    calls = [0]

    def proc(ids, scores):
        calls[0] += 1
        return scores * float("nan") if calls[0] > n else scores

    return proc


def boom(ids, scores):
    raise RuntimeError("processor exploded")


def drive(batch: Batch, k: int = 4) -> dict:
    outs, errors = {}, {}
    while True:
        rec = run_round(batch, DraftPolicy.of(FixedLength(k)))
        batch.check()  # the invariants hold after every round, failed rows included
        if rec is None:
            return outs, errors
        for e in rec.emissions:
            outs.setdefault(e.key, []).extend(e.tokens)
            if e.error:
                errors[e.key] = e.error


@pytest.mark.parametrize("bad", ["nan", "raises"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_whose_sampling_fails_fails_alone(bad, temperature):
    model = tiny_llama(seed=3, sharpness=2.0)
    target = TorchRuntime(model)
    batch = Batch(target, NgramProposer(NgramProposer.Config()), ExactVerifier())
    hostile = [nan_after(3)] if bad == "nan" else [boom]
    s = SamplingConfig(temperature=temperature)
    reqs = [RowRequest(i, p, 20) for i, p in enumerate(PROMPTS)]
    reqs[1] = RowRequest(1, PROMPTS[1], 20, s, seed=5, processors=hostile)
    first = batch.add(reqs)
    outs = {e.key: e.tokens for e in first}
    more, errors = drive(batch)
    errors.update({e.key: e.error for e in first if e.error})
    for k, t in more.items():
        outs[k] = outs.get(k, []) + t
    assert list(errors) == [1] and ("not finite" in errors[1] or "processor exploded" in errors[1])
    for i in (0, 2, 3):
        assert outs[i] == plain_greedy(model, PROMPTS[i], 20), i  # the others, as if alone
    assert len(batch) == 0 and target.lengths() == []


class NoDeadEnds:
    """Bans token ``x`` and leaves no token at all after a prefix ending in it: a state plain
    decoding never reaches, which a drafted ``x`` puts in the verify forward."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __call__(self, ids, scores):
        scores = scores.clone()
        scores[:, self.x] = float("-inf")
        scores[ids[:, -1] == self.x] = float("-inf")
        return scores


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_a_node_after_a_drafted_token_the_processor_bans_does_not_fail_the_row(kind, tmp_path):
    """Processed logits with no token left at a drafted node the row's path never reaches are not
    the row's failure: the output is transformers' greedy under the same processor."""
    from helpers import every_proposer, save_random_heads
    from transformers import LogitsProcessorList

    model = tiny_llama(seed=3)
    x = 7
    prompt = [6, 19, 18, x, 19, 18, 6, 19, 18, x, 19]  # the n-gram and suffix proposers draft x
    target = TorchRuntime(model)
    batch = Batch(target, every_proposer(kind, target, save_random_heads(model, tmp_path)), ExactVerifier())
    first = batch.add([RowRequest(0, prompt, 12, processors=[NoDeadEnds(x)])])
    more, errors = drive(batch)
    assert not errors and not first[0].error
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              logits_processor=LogitsProcessorList([NoDeadEnds(x)]))[0, len(prompt):].tolist()
    assert first[0].tokens + more[0] == want


def test_admission_is_atomic_when_the_proposer_fails():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = NgramProposer(NgramProposer.Config())
    batch = Batch(target, prop, ExactVerifier())
    batch.add([RowRequest(0, PROMPTS[0], 25)])
    run_round(batch, DraftPolicy.of(FixedLength(3)))
    before = (target.lengths(), target.slots.pos.clone(), prop.num_rows())
    real, prop.admit = prop.admit, lambda prompts: (_ for _ in ()).throw(RuntimeError("admit failed"))
    with pytest.raises(RuntimeError, match="admit failed"):
        batch.add([RowRequest(1, PROMPTS[1], 10), RowRequest(2, PROMPTS[2], 10)])
    prop.admit = real
    assert target.lengths() == before[0] and torch.equal(target.slots.pos, before[1])
    assert prop.num_rows() == before[2] == len(batch)
    batch.check()
    batch.add([RowRequest(3, PROMPTS[3], 12)])  # the batch serves on, rows exact
    outs, _ = drive(batch)
    ref0 = plain_greedy(model, PROMPTS[0], 25)
    assert ref0[-len(outs[0]):] == outs[0]
    assert plain_greedy(model, PROMPTS[3], 12)[1:] == outs[3]


def test_admission_is_atomic_when_the_runtime_fails():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    batch = Batch(target, NgramProposer(NgramProposer.Config()), ExactVerifier())
    batch.add([RowRequest(0, PROMPTS[0], 25)])
    inner = target._call

    def failing(ids, pos, mask, want_hidden, prefill):  # the engine fails on the new row's prefill
        if prefill:
            raise RuntimeError("engine failed")
        return inner(ids, pos, mask, want_hidden, prefill)

    target._call = failing
    with pytest.raises(RuntimeError, match="engine failed"):
        batch.add([RowRequest(1, PROMPTS[1], 10)])
    target._call = inner
    batch.check()
    outs, _ = drive(batch)
    assert outs[0] == plain_greedy(model, PROMPTS[0], 25)[1:]


def test_check_catches_a_row_left_behind():
    target = TorchRuntime(tiny_llama(seed=3))
    batch = Batch(target, NgramProposer(NgramProposer.Config()), ExactVerifier())
    batch.add([RowRequest(0, PROMPTS[0], 5)])
    target.add_rows([PROMPTS[1]])  # what the old scheduler did on a failed admission
    with pytest.raises(AssertionError, match="the runtime holds 2 rows, the batch 1"):
        batch.check()


def test_sampling_values_are_safe_by_construction():
    assert SamplingConfig(temperature=1e-40).greedy and SamplingConfig(temperature=9e-6).greedy
    assert not SamplingConfig(temperature=1e-5).greedy
    for bad, field in (({"repetition_penalty": 1e-40}, "repetition_penalty"), ({"seed": -1}, "seed"),
                       ({"temperature": float("nan")}, "temperature"), ({"repetition_penalty": 1e9}, "repetition")):
        with pytest.raises(ValueError, match=field):
            SamplingConfig(**bad)
    model = tiny_llama(seed=3, sharpness=2.0)
    dec_cfg = {"target": {"backend": "torch", "model": "x"}, "proposer": {"type": "ngram"}}
    from spec_plugins.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder.from_config(dec_cfg, target=TorchRuntime(model))
    r = dec.generate(PROMPTS[0], max_new_tokens=12, temperature=1e-40, seed=3)
    assert r.token_ids == plain_greedy(model, PROMPTS[0], 12)  # an underflowing temperature is greedy


# ---- the CLI: one line, a non-zero code, before any model loads where it can ------------------
def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", "from spec_plugins.cli import app; app()", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def one_line_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert needle in res.stderr, res.stderr[-2000:]


def test_cli_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {backend: torch, model: [unclosed\n")
    for cmd in (["generate", "-p", "hi"], ["bench", "--prompts", "x.jsonl"], ["export", "onnx", "--out", str(tmp_path / "o")],
                ["serve", "--port", "0"]):
        one_line_error(cli(*cmd, "--config", str(bad)), f"config {bad} cannot be read (line 2, column 1)")
    one_line_error(cli("generate", "-p", "hi", "--config", str(tmp_path)), "is a directory")
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        SpecConfig.from_file(lst)


def test_cli_sampling_and_stop_arguments_match_the_server():
    one_line_error(cli("generate", "-p", "hi", "--seed", "-1"), "--seed")
    one_line_error(cli("generate", "-p", "hi", "--stop", ""), "stop strings must not be empty")


def test_cli_output_paths_and_ports_are_checked_before_the_model_loads(tmp_path):
    f = tmp_path / "taken"
    f.write_text("x")
    one_line_error(cli("bench", "--prompts", "examples/prompts/dev.jsonl", "--out", str(f)), "is an existing file")
    one_line_error(cli("train", "medusa", "--features", str(tmp_path), "--out", str(f)), "is an existing file")
    one_line_error(cli("train", "features", "--out", str(f)), "is an existing file")
    one_line_error(cli("export", "onnx", "--out", str(f)), "is an existing file")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        one_line_error(cli("serve", "--port", str(s.getsockname()[1])), "cannot listen there")


def test_cli_bad_prompt_files_and_manifests(tmp_path):
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    gen = ("train", "features", "--source", "prompts", "--responses", "self", "--out", str(tmp_path / "h"))
    one_line_error(cli(*gen, "--prompts", str(rows)), "line 2: expected an object with a non-empty string `prompt`")
    rows.write_text('{"prompt": 3}\n')
    one_line_error(cli(*gen, "--prompts", str(rows)), "line 1")
    d = tmp_path / "export"
    d.mkdir()
    (d / "manifest.json").write_text("[1, 2]")
    one_line_error(cli("export", "check", str(d)), "expected a JSON object")


def test_cli_bad_rtol_and_write_config_fail_in_one_line_and_help_keeps_brackets(tmp_path):
    """``--rtol nan`` failed every parity case and ``inf`` passed every one; ``--write-config`` into
    a missing folder ended in a traceback; rich read ``[train]`` in a help text as markup."""
    d = tmp_path / "export"
    d.mkdir()
    for bad in ("nan", "inf", "-1", "0"):
        one_line_error(cli("export", "check", str(d), "--rtol", bad), f"--rtol {float(bad)}")
    one_line_error(cli("serve", "--write-config", str(tmp_path / "missing" / "x.yaml")), "--write-config")
    one_line_error(cli("serve", "--write-config", str(tmp_path)), "--write-config")
    assert "[train]" in cli("train", "features", "--help").stdout


def test_corrupt_or_mismatched_heads_fail_in_one_line(tmp_path):
    from spec_plugins.heads import EagleDrafter, MedusaHeads
    from test_heads import medusa

    model = tiny_llama(seed=3)
    from spec_plugins.heads import save_head

    h = medusa(model)
    save_head(h, h.config.to_dict(), tmp_path / "m")
    with pytest.raises(ValueError, match="does not hold an eagle head"):
        EagleDrafter.from_pretrained(str(tmp_path / "m"), model)
    (tmp_path / "m" / "head.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        MedusaHeads.from_pretrained(str(tmp_path / "m"), model)
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a head config"):
        MedusaHeads.from_pretrained(str(tmp_path / "m"), model)
    # through the CLI, on a tiny local transformers model: one line, no traceback
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path / "tiny-model"
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w31").save_pretrained(str(d))
    model.save_pretrained(str(d))
    save_head(medusa(model), h.config.to_dict(), tmp_path / "good")
    for kind, heads, needle in (("medusa", tmp_path / "m", "is not a head config"),
                                ("eagle", tmp_path / "good", "does not hold an eagle head")):
        cfg = tmp_path / f"{kind}.yaml"
        cfg.write_text(json.dumps({"target": {"backend": "torch", "model": str(d)},
                                   "proposer": {"type": kind, "heads": str(heads)}}))
        one_line_error(cli("generate", "-p", "w1 w2", "--raw", "-n", "3", "--config", str(cfg)), needle)
