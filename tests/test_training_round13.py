"""Round 13: the GPU script's device step refuses bad options before it loads anything (a
``--block-size`` of 0 trained an EAGLE head saved as the parallel one, 1 failed only after the
target loaded and self-distillation ran), and a token run that keeps no conversation is refused
with the earlier run's shards left as they were (it deleted them and wrote an empty store)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_train_gpu_script import DRIVER, tiny_bundle
from test_training_hardening import cli, examples, feature_dir, save_model

from conftest import tiny_llama
from spec_plugins.training.features import FeatureStore
from spec_plugins.training.tokens import TokenStore, write_token_shards
from spec_plugins.training.trainer import TrainConfig

CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---- the device step's options ---------------------------------------------------------------
@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("bundle"))


BAD = [(["--heads", "parallel", "--block-size", "0"], "block_size must be at least 2 (depth 0 and one block query), got 0"),
       (["--heads", "eagle,parallel", "--block-size", "1"], "block_size must be at least 2"),
       (["--heads", "parallel", "--block-size", "16", "--window", "8"], "--block-size 16 drafts depths up to 15"),
       (["--heads", "parallel", "--block-size", "4", "--anchors", "0"], "anchors must be a positive integer, got 0"),
       (["--gen-rows", "0"], "gen_rows must be a positive integer, got 0"),
       (["--gen-max-new", "-1"], "gen_max_new must be a positive integer, got -1"),
       (["--gen-max-seq", "0"], "gen_max_seq must be a positive integer, got 0"),
       (["--temperatures", "0,-0.5"], "temperatures must be >= 0"),
       (["--temperatures", "0,warm"], "--temperatures '0,warm': give comma-separated numbers")]


@pytest.mark.parametrize("extra,says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_the_device_step_refuses_bad_options_by_name_before_anything_loads_or_is_written(extra, says, bundle, tmp_path,
                                                                                       monkeypatch):
    spec = importlib.util.spec_from_file_location("train_heads_gpu", DRIVER)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # type: ignore[union-attr]
    argv = ["train_heads_gpu.py", "device", "--bundle", str(bundle), "--out", str(tmp_path / "out"), "--work",
            str(tmp_path / "work"), "--device", "cpu", "--dtype", "float32", "--batch-size", "2", "--window", "32",
            "--draft-vocab", "32", "--max-steps", "1", "--prefill-tokens", "512", "--no-medusa", "--reserve-s", "0"]
    monkeypatch.setattr("sys.argv", argv + extra)
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert isinstance(exc.value.code, str) and says in exc.value.code, exc.value.code  # sys.exit(message): status 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no out, no work


def test_run_options_refuse_a_parallel_block_size_below_2_and_keep_it_unused_for_eagle():
    from spec_plugins.training.device_run import RunOptions

    for size in (0, 1):
        with pytest.raises(ValueError, match=f"block_size must be at least 2 .*got {size}"):
            RunOptions(heads=("eagle", "parallel"), block_size=size)
    assert RunOptions(heads=("eagle",), block_size=0).block_size == 0  # no parallel head: not read
    with pytest.raises(ValueError, match=r"heads \['medusa'\]: expected one or more of \['eagle', 'parallel'\]"):
        RunOptions(heads=("medusa",))


def test_train_eagle_refuses_an_explicit_block_size_of_0_or_1_before_writing(tmp_path):
    """0 trained (and saved) a plain EAGLE head: a falsy block size read as "not parallel"."""
    from spec_plugins.training.eagle_train import train_eagle

    model = tiny_llama(seed=0, sharpness=8.0)
    store = FeatureStore(feature_dir(model, tmp_path / "feat", "tiny"))
    cfg = TrainConfig(epochs=1, batch_size=2, window=16, max_steps=1)
    for size in (0, 1):
        with pytest.raises(ValueError, match=f"block_size must be at least 2 .*got {size}"):
            train_eagle(store, model, cfg, tmp_path / f"head{size}", vocab_size=24, progress=False, block_size=size)
        assert not (tmp_path / f"head{size}").exists()


# ---- a token run with no conversation --------------------------------------------------------
def test_write_token_shards_refuses_an_empty_run_and_leaves_out_as_it_was(tmp_path):
    write_token_shards(examples(n=4), tmp_path / "t", {"target": "tiny"}, 32, 10_000)
    before = files(tmp_path / "t")
    no_answer = [([1, 2, 3], [False, False, False])]
    for rows, budget in (([], 10_000), (no_answer, 10_000), (examples(n=2), 1)):  # nothing; no answer; budget of 1
        with pytest.raises(ValueError, match="no conversation to write"):
            write_token_shards(rows, tmp_path / "t", {"target": "tiny"}, 32, budget)
        assert files(tmp_path / "t") == before and sorted(p.name for p in (tmp_path / "t").iterdir()) == sorted(before)
    assert TokenStore(tmp_path / "t").tokens == sum(len(ids) for ids, _ in examples(n=4))
    with pytest.raises(ValueError, match="no conversation to write"):
        write_token_shards([], tmp_path / "new" / "deeper", {"target": "tiny"}, 32, 10_000)
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="outside the vocabulary"):  # another model's tokens: nothing left either
        write_token_shards(examples(n=2), tmp_path / "other" / "tok", {"target": "tiny"}, 3, 10_000)
    assert not (tmp_path / "other").exists()
    state = write_token_shards([], tmp_path / "empty", {}, 32, 10_000, allow_empty=True)  # the device run's distill
    assert state["conversations"] == 0 and json.loads((tmp_path / "empty" / "meta.json").read_text())["shards"] == []


def test_self_distill_with_no_data_fails_and_keeps_the_earlier_shards(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import spec_plugins.training.sources as sources

    d = save_model(tmp_path / "m", seed=4)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = CHAT
    tok.save_pretrained(d)
    args = ("train", "self-distill", "--target", d, "--backend", "torch", "--max-tokens", "200",
            "--max-new-tokens", "4", "--temperatures", "0")
    monkeypatch.setattr(sources, "sharegpt_examples", lambda *a, **k: iter(examples(n=4)))
    first = cli(*args, "--out", tmp_path / "s")
    assert first.exit_code == 0, first.output
    before = files(tmp_path / "s")
    monkeypatch.setattr(sources, "sharegpt_examples", lambda *a, **k: iter([]))  # a split or filter keeping nothing
    res = cli(*args, "--out", tmp_path / "s")
    assert res.exit_code == 2 and "error: no conversation to write: 0 read" in res.output, res.output
    assert files(tmp_path / "s") == before
    assert TokenStore(tmp_path / "s").tokens == json.loads(before["meta.json"])["tokens"] > 0
    res = cli(*args, "--out", tmp_path / "fresh")
    assert res.exit_code == 2 and not (tmp_path / "fresh").exists(), res.output


def test_a_self_distillation_with_no_tokens_reports_no_rate(tmp_path):
    """The rate divided by max(tokens, 1): a number for no tokens at all."""
    from spec_plugins.training.device_run import RunOptions, run

    b = tiny_bundle(tmp_path / "b")
    opts = RunOptions(device="cpu", dtype="float32", batch_size=2, window=32, draft_vocab=32, max_steps=1,
                      prefill_tokens=512, reserve_s=0.0, medusa=False, distill_s=1e-9,  # due before any answer
                      temperatures=(0.0,), gen_rows=8, gen_max_new=8, gen_max_seq=64)
    sd = run(b, tmp_path / "out", tmp_path / "work", opts)["self_distill"]
    assert sd["tokens"] == 0 and sd["seconds_per_million_tokens"] is None
    assert json.loads((tmp_path / "out" / "run.json").read_text())["self_distill"]["seconds_per_million_tokens"] is None
