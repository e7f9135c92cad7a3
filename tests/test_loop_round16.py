"""Round 16: a temperature above float32's range (1e39, 1e300) samples as the uniform limit with
the logits' order kept, so ``top_k: 1`` is the greedy token and top-p drops the least likely
first (logits / T in float32 used to be all zero: top-k kept everything, top-p dropped in
arbitrary order, a banned -inf became NaN); float16 logits are warped in float32. And a stop
string the EOS token itself completes (its text spelled, as TGI's routes do) leaves the finish
reason ``eos_token``, as TGI checks EOS first; a stop completed before the EOS still wins."""

from __future__ import annotations

import pytest
import torch
from grammar_helpers import EOS, tiny_tokenizer

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.types import RowRequest
from spec_plugins.loop.batch import Batch
from spec_plugins.loop.round import run_round
from spec_plugins.policy.draft_policy import build_policy
from spec_plugins.loop.rows import Row
from spec_plugins.sampling import LogitsPipeline, RowPipelines
from spec_plugins.text import StopStrings, TextStream
from spec_plugins.verifiers import ExactVerifier

torch.set_num_threads(1)

HUGE = (1e31, 2.0 ** 100, 1e38, 1e39, 1e300)


def _pipe(temperature: float, **kw) -> LogitsPipeline:
    return LogitsPipeline(SamplingConfig(temperature=temperature, **kw))


def _kept(z: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in z]


@pytest.mark.parametrize("temperature", HUGE)
def test_top_k_1_is_the_greedy_token_at_any_temperature(temperature):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 4
    z = _pipe(temperature, top_k=1).warp(logits)
    assert _kept(z) == [{i} for i in logits.argmax(-1).tolist()]
    three = _pipe(temperature, top_k=3).warp(logits)
    assert _kept(three) == [set(r) for r in logits.topk(3, -1).indices.tolist()]


@pytest.mark.parametrize("temperature", (1e39, 1e300))
def test_top_p_at_a_huge_temperature_is_the_uniform_limit(temperature):
    # uniform over 8 tokens, top_p 0.6: the 3 whose mass (1/8 each) stays <= 0.4 go, the least likely
    V, p = 8, 0.6
    dropped = int((torch.full((V,), 1 / V).cumsum(-1) <= 1 - p).sum())
    logits = torch.tensor([[7.0, 6.5, 5.0, 4.0, 3.5, 2.0, 1.0, 0.5], [0.1, 0.9, 0.3, 0.7, 0.5, 0.2, 0.8, 0.4]])
    z = _pipe(temperature, top_p=p).warp(logits)
    assert _kept(z) == [set(r) for r in logits.topk(V - dropped, -1).indices.tolist()]
    assert torch.allclose(z.softmax(-1)[torch.isfinite(z)], torch.tensor(1 / (V - dropped)))


def test_a_banned_token_stays_banned_at_a_huge_temperature():
    logits = torch.tensor([[3.0, float("-inf"), 1.0, 2.0]])
    z = _pipe(1e39, top_p=0.9).warp(logits)
    assert not z.isnan().any()
    assert z[0, 1] == float("-inf") and _kept(z) == [{0, 2, 3}]


@pytest.mark.parametrize("temperature", (0.7, 1.0, 3.0, 1e29))
def test_ordinary_temperatures_warp_as_transformers(temperature):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    ids = torch.zeros(4, 1, dtype=torch.long)
    want = TopPLogitsWarper(0.8)(ids, TopKLogitsWarper(20)(ids, TemperatureLogitsWarper(temperature)(ids, logits)))
    assert torch.equal(_pipe(temperature, top_k=20, top_p=0.8).warp(logits), want)


@pytest.mark.parametrize("dtype,temperature", [(torch.float16, 1e-4), (torch.float16, 1e9), (torch.bfloat16, 1e39)])
def test_low_precision_logits_are_warped_in_float32(dtype, temperature):
    logits = (torch.randn(3, 40, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    z = _pipe(temperature, top_k=1).warp(logits)
    assert _kept(z) == [{i} for i in logits.float().argmax(-1).tolist()] and z.dtype == torch.float32
    # a batch of two sampling settings keeps float32 too (its buffer is not the logits' dtype)
    mixed = RowPipelines([_pipe(temperature, top_k=1), _pipe(0.0), _pipe(temperature, top_k=1)])
    z = mixed.process_rows(logits, [[0]] * 3)
    assert _kept(z) == [{i} for i in logits.float().argmax(-1).tolist()] and z.dtype == torch.float32


# ---- stop strings and EOS -------------------------------------------------------------------
A, B = 7, 8  # "a", "b" in grammar_helpers' tokenizer; EOS (0) spells "<eos>" with special tokens kept


def _row(stops: list[str]) -> Row:
    stream = TextStream(tiny_tokenizer(), stops, skip_special_tokens=False)  # as TGI's routes
    return Row("r", [A], 1, 10, _pipe(0.0), None, stop=StopStrings(stream))


@pytest.mark.parametrize("stop", ["<eos>", "b<eos>", "eos>"])
def test_a_stop_the_eos_token_completes_leaves_eos_token(stop):
    row = _row([stop])
    em = row.emit([A, B, EOS], {EOS}, {}, 0)
    assert (em.finish_reason, em.tokens, row.tokens) == ("eos_token", [A, B, EOS], [A, A, B, EOS])


def test_a_stop_completed_before_the_eos_still_wins():
    row = _row(["ab", "<eos>"])
    em = row.emit([A, B, EOS], {EOS}, {}, 0)  # "ab" completes at the 2nd new token, before the EOS
    assert (em.finish_reason, em.tokens, row.tokens) == ("stop", [A, B], [A, A, B])
    row = _row(["a"])
    em = row.emit([B, A, EOS], {EOS}, {}, 0)
    assert (em.finish_reason, em.tokens) == ("stop", [B, A])


def test_eos_alone_in_a_round_after_the_stop_text_keeps_eos_token():
    row = _row(["<eos>"])
    assert row.emit([B], {EOS}, {}, 0).finish_reason is None
    em = row.emit([EOS], {EOS}, {}, 0)
    assert (em.finish_reason, em.tokens) == ("eos_token", [EOS])


class Script:
    """A user processor that forces ``tokens`` one by one after the prompt (``start`` tokens)."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, float("-inf"))
        for r, row in enumerate(input_ids.tolist()):
            out[r, self.tokens[min(len(row) - self.start, len(self.tokens) - 1)]] = 0.0
        return out


def test_where_the_text_shows_the_eos_a_stop_it_completes_stands():
    """The Python API's and OpenAI's text skips special tokens, so an EOS that completes a stop
    there is an ordinary token's text (``eos_token_id`` listing "b"): the text is cut before the
    stop, and the finish reason says so ("stop"), not "eos_token" over a cut text."""
    stream = TextStream(tiny_tokenizer(), ["ab"], skip_special_tokens=True)
    row = Row("r", [A], 1, 10, _pipe(0.0), None, stop=StopStrings(stream))
    em = row.emit([A, B], {B}, {}, 0)
    assert (em.finish_reason, em.tokens, stream.visible) == ("stop", [A, B], "")


def test_decode_with_the_eos_text_as_stop_finishes_on_eos():
    """The engine's path under TGI's routes: a stop spelling the EOS token, the row ending on EOS."""
    tok = tiny_tokenizer()
    stream = TextStream(tok, ["<eos>"], skip_special_tokens=False)
    pipe = LogitsPipeline(SamplingConfig(temperature=0.0), [Script(2, [A, B, EOS])])
    batch = Batch(TorchRuntime(tiny_llama(seed=0), tok), None, ExactVerifier(), [EOS], seed=None)
    emitted = list(batch.add([RowRequest(0, [A, B], 8, pipeline=pipe, stop=StopStrings(stream))]))
    policy = build_policy(None, None)
    while not batch.rows[0].done and (record := run_round(batch, policy)) is not None:
        emitted += record.emissions
    assert emitted[-1].finish_reason == "eos_token" and stream.text == "ab<eos>"


def _raises(ids, scores):
    raise RuntimeError("this row's processor fails")


def test_a_neighbours_failing_processor_leaves_half_precision_rows_their_float32_distribution():
    """Where one row's processor raises, each row is processed alone (``loop.processing._apart`` for
    the tree, ``process_rows_apart`` for plain rows): those buffers were the logits' float16, so a
    healthy row's warped logits (T = 1e-4) were cast back to float16 and all became +-inf."""
    from spec_plugins.loop import processing
    from spec_plugins.sampling import process_rows_apart

    logits = (torch.randn(2, 1, 40, generator=torch.Generator().manual_seed(2)) * 4).to(torch.float16)
    good = LogitsPipeline(SamplingConfig(temperature=1e-4, top_k=3))
    bad = LogitsPipeline(SamplingConfig(temperature=1e-4, top_k=3), [_raises])
    rows = [Row(i, [1], 1, 5, p, None) for i, p in enumerate([good, bad])]
    seen = [torch.tensor([1]), torch.tensor([1])]
    z, raised = processing.process(RowPipelines([good, bad]), rows, logits, seen,
                                   torch.zeros(2, 1, dtype=torch.long), (-1,))
    assert raised is not None and z.dtype == torch.float32 and int(torch.isfinite(z[0, 0]).sum()) == 3
    z, failed = process_rows_apart(RowPipelines([good, bad]), logits[:, 0], seen)
    assert failed == [1] and z.dtype == torch.float32 and int(torch.isfinite(z[0]).sum()) == 3
