"""Bad input: clear errors or correct empty results, never a half-written output."""

from __future__ import annotations

import pytest

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.models import ModelNotFound, resolve_model
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.verifiers import ExactVerifier
from spec_plugins.vocab import VocabMismatch, check_vocab_compatible, fit_vocab


def _decoder(max_pos=64):
    return SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, max_pos=max_pos)),
                              NgramProposer(NgramProposer.Config()), ExactVerifier())


def test_empty_prompt_is_refused():
    dec = _decoder()
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], max_new_tokens=4)


def test_prompt_longer_than_context_is_refused():
    dec = _decoder(max_pos=16)
    with pytest.raises(ValueError, match="context"):
        dec.generate(list(range(20)), max_new_tokens=4)


def test_generation_runs_to_the_context_end_and_no_further():
    """A limit that fills the context runs to it; one past it is refused (it was cut at the
    context without a word: ``test_context_limit``)."""
    dec = _decoder(max_pos=16)
    r = dec.generate([1, 2, 3, 1, 2, 3, 1, 2, 3, 1], max_new_tokens=6)
    assert len(r.token_ids) == 6 and r.finish_reason == "length"
    with pytest.raises(ValueError, match="runs past the context of 16"):
        dec.generate([1, 2, 3, 1, 2, 3, 1, 2, 3, 1], max_new_tokens=50)


def test_max_new_tokens_zero_and_negative():
    dec = _decoder()
    r = dec.generate([1, 2, 3], max_new_tokens=0)
    assert r.token_ids == [] and r.stats.target_forwards == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([1, 2, 3], max_new_tokens=-1)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")),
                                 dict(temperature=float("inf")), dict(seed=-3), dict(seed=2 ** 80)])
def test_generate_checks_its_sampling_options_as_a_config_does(bad):
    """``generate``'s temperature and seed are checked as ``SamplingConfig`` checks them (a negative
    temperature ran greedy, NaN failed the row, a huge seed overflowed)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=next(iter(bad))):
        _decoder().generate([1, 2, 3], max_new_tokens=4, **bad)


def test_generate_batch_needs_one_max_new_tokens_per_prompt_and_integers():
    dec = _decoder()
    with pytest.raises(ValueError, match=r"one entry per prompt \(2\), got 1"):
        dec.generate_batch([[1, 2], [3, 4]], max_new_tokens=[5])
    with pytest.raises(ValueError, match=r"one entry per prompt \(2\), got 3"):
        dec.generate_batch([[1, 2], [3, 4]], max_new_tokens=[5, 6, 7])
    with pytest.raises(ValueError, match="must be an integer"):
        dec.generate([1, 2], max_new_tokens=2.0)


class _Tok:
    def __init__(self, vocab):
        self._v = vocab

    def get_vocab(self):
        return dict(self._v)


def test_vocab_mismatch_is_refused_with_details():
    a = _Tok({"a": 0, "b": 1, "c": 2})
    with pytest.raises(VocabMismatch, match="'b': target id 1, draft id 2"):
        check_vocab_compatible(a, _Tok({"a": 0, "b": 2, "c": 1}))
    check_vocab_compatible(a, _Tok({"a": 0, "b": 1, "c": 2}))  # identical: fine


def test_draft_model_proposer_refuses_mismatched_tokenizer():
    target = TorchRuntime(tiny_llama(seed=3), tokenizer=_Tok({"a": 0, "b": 1}))
    draft = TorchRuntime(tiny_llama(seed=4), tokenizer=_Tok({"a": 1, "b": 0}))
    with pytest.raises(VocabMismatch):
        DraftModelProposer(None, target=target, tokenizer=target.tokenizer, runtime=draft)


def test_padded_vocab_widths_are_reconciled():
    import torch

    x = torch.randn(2, 5)
    assert fit_vocab(x, 7).shape == (2, 7) and torch.isinf(fit_vocab(x, 7)[:, 5:]).all()
    assert torch.equal(fit_vocab(x, 3), x[:, :3])


def test_unknown_model_name_lists_builtins(tmp_path):
    with pytest.raises(ModelNotFound, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFound, match="not found"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_cli_invalid_config_exits_with_message(tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {backend: torch, model: x}\nproposer: {type: ngram, max_ngram: 0}\n")
    res = CliRunner().invoke(app, ["generate", "--config", str(bad), "--prompt", "hi"])
    assert res.exit_code == 2
    assert "max_ngram" in res.output


@pytest.mark.parametrize("kind", ["ngram", "lookahead", "medusa-tree", "eagle-tree", "parallel-tree"])
def test_rows_at_the_context_end_decode_beside_rows_that_draft_deeper(kind, tmp_path):
    """A row a few positions from the context's end, alone and beside a row with room to draft deep:
    the batch's draft is padded to its deepest row (and a static tree keeps its depths), so nodes
    past the short row's end reach the forward; they are never valid, and the output is plain
    greedy up to the context (a forward used to refuse the whole round)."""
    from helpers import every_proposer, plain_greedy, save_random_heads

    model = tiny_llama(seed=3, sharpness=2.0, max_pos=40)
    heads = save_random_heads(model, tmp_path)
    short = [5, 6, 5, 6, 5, 6, 7, 5, 6]
    for prompts in ([([4, 7] * 20)[:37]], [short + plain_greedy(model, short, 12), [7, 3, 9, 12, 30, 2] * 6]):
        rt = TorchRuntime(model)
        dec = SpeculativeDecoder(rt, every_proposer(kind, rt, heads), ExactVerifier())
        limits = [min(20, 40 - len(p)) for p in prompts]  # the short rows fill the context
        got = dec.generate_batch(prompts, max_new_tokens=limits)
        assert [g.token_ids for g in got] == [plain_greedy(model, p, n) for p, n in zip(prompts, limits)]
        assert [g.finish_reason for g in got] == ["length"] * len(prompts)


# ---- API inputs read as something else, or dropped ---------------------------------------------------
@pytest.mark.parametrize("prompt", [b"\x01\x02\x03", bytearray(b"\x01\x02\x03")])
def test_a_bytes_prompt_is_refused_not_read_as_token_ids(prompt):
    """Bytes iterate as integers: ``generate(b"...")`` decoded them as token ids."""
    dec = _decoder()
    with pytest.raises(TypeError, match=rf"got {type(prompt).__name__}: decode it to a str"):
        dec.generate(prompt, max_new_tokens=3)
    with pytest.raises(TypeError, match=rf"got {type(prompt).__name__}: decode it to a str"):
        dec.generate_batch([prompt], max_new_tokens=3)
    with pytest.raises(TypeError, match=rf"list of prompts, got one {type(prompt).__name__}"):
        dec.generate_batch(prompt, max_new_tokens=3)


def test_numpy_and_torch_integer_token_limits_are_taken():
    import numpy as np
    import torch

    dec = _decoder()
    want = dec.generate([1, 2, 3], max_new_tokens=3).token_ids
    assert dec.generate([1, 2, 3], max_new_tokens=np.int64(3)).token_ids == want
    assert dec.generate([1, 2, 3], max_new_tokens=torch.tensor(3)).token_ids == want
    got = dec.generate_batch([[1, 2, 3], [1, 2, 3]], max_new_tokens=[np.int32(3), 2])
    assert [g.token_ids for g in got] == [want, want[:2]]
    with pytest.raises(ValueError, match="must be an integer"):
        dec.generate([1, 2], max_new_tokens=np.bool_(True))


def test_generate_batch_refuses_temperature_beside_per_row_sampling():
    """``temperature`` was dropped silently where ``sampling`` set each row's."""
    with pytest.raises(ValueError, match="temperature or sampling, not both"):
        _decoder().generate_batch([[1, 2, 3]], 3, temperature=0.5, sampling=[{"temperature": 1.0}])


@pytest.mark.parametrize("stop", ["", ["ab", ""]])
def test_an_empty_stop_string_is_refused_as_the_cli_refuses_it(stop):
    from grammar_helpers import tiny_tokenizer

    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3)), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        dec.generate("abc", 5, stop=stop)
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        dec.generate_batch(["abc"], 5, stop=stop)


def _ban(ids, scores):
    out = scores.clone()
    out[:, [4, 9]] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
@pytest.mark.parametrize("proposer", [False, True])
def test_a_processor_returning_another_float_dtype_is_taken_in_the_logits_dtype(dtype, proposer):
    """transformers takes a processor returning float64 or float16 scores; the row failed ("Index
    put requires the source and destination dtypes match")."""
    import torch

    other = lambda ids, scores: _ban(ids, scores).to(getattr(torch, dtype))  # noqa: E731
    dec = _decoder() if proposer else SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3)))
    want = dec.generate([1, 2, 3, 1, 2, 3], max_new_tokens=8, processors=[_ban])
    got = dec.generate([1, 2, 3, 1, 2, 3], max_new_tokens=8, processors=[other])
    assert got.error is None and got.token_ids == want.token_ids and not {4, 9} & set(got.token_ids)


def test_a_processor_returning_another_shape_fails_its_row_by_name():
    """A processor returning [V] for [1, V] scores was broadcast silently into one row's logits."""
    def first_row(ids, scores):
        return _ban(ids, scores)[0]

    r = _decoder().generate([1, 2, 3], max_new_tokens=4, processors=[first_row])
    assert r.finish_reason == "error" and "logits processor" in r.error and "first_row returned [32]" in r.error
