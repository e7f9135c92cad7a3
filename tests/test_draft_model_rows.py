"""A draft model's rows stay apart: one row's tokens, budget or broken logits never fail or change
the rows beside it (``proposers/draft_model.py``), nor does one request's failed admission end the
requests admitted with it (``server/scheduler.py``)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from conftest import tiny_llama
from helpers import full_logits, hf_generate
from spec_plugins.backends.torch_runtime import TorchRuntime

from spec_plugins.config import SamplingConfig
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.processors import LogitBias
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.server.scheduler import Job, Scheduler
from spec_plugins.types import ProposeContext, RowRequest
from spec_plugins.verifiers import ExactVerifier

TARGET_VOCAB, DRAFT_VOCAB, OUTSIDE = 32, 24, 28  # OUTSIDE: a target token the draft has no embedding for


def _batch(target: torch.nn.Module, draft: torch.nn.Module) -> Batch:
    rt = TorchRuntime(target)
    return Batch(rt, DraftModelProposer(None, target=rt, runtime=TorchRuntime(draft)), ExactVerifier())


def _decode(batch: Batch, requests: list[RowRequest], joining: list[RowRequest] = ()) -> tuple[dict, dict, int]:
    """Every row's tokens and finish reason, and how many drafted tokens the rows accepted;
    ``joining`` rows join the running batch after its first round."""
    out: dict = {r.key: [] for r in [*requests, *joining]}
    reasons: dict = {}
    accepted = 0

    def take(ems: list) -> None:
        for em in ems:
            out[em.key].extend(em.tokens)
            if em.finish_reason is not None:
                reasons[em.key] = em.finish_reason

    take(batch.add(requests))
    while (rec := run_round(batch, DraftPolicy.of(FixedLength(3)))) is not None:
        accepted += sum(len(a) for a in rec.accepted)
        take(rec.emissions)
        if joining:
            take(batch.add(joining))
            joining = ()
    return out, reasons, accepted


@torch.no_grad()
def _cropped(model: torch.nn.Module, vocab: int) -> torch.nn.Module:
    """``model`` with only its first ``vocab`` tokens' embeddings and LM-head rows: a draft that
    agrees with it wherever its argmax is one of those tokens."""
    small = tiny_llama(vocab=vocab)
    weights = {k: v[:vocab] if k in ("model.embed_tokens.weight", "lm_head.weight") else v
               for k, v in model.state_dict().items()}
    small.load_state_dict(weights)
    return small


@torch.no_grad()
def _plain_biased(model: torch.nn.Module, prompt: list[int], n: int, bias: LogitBias) -> list[int]:
    """Plain greedy decoding with ``bias`` applied to each step's logits (full forwards, no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(bias(torch.tensor([seq]), full_logits(model, seq)[None]).argmax()))
    return seq[len(prompt):]


def test_a_row_reaching_a_token_the_smaller_draft_cannot_read_stops_drafting_alone():
    """A draft with a smaller vocabulary than the target's (its logits padded): once a row emits a
    token outside it (forced with logit_bias, as OpenAI allows), that row goes on without drafts
    and every row still gives exactly its plain greedy output; the other row keeps drafting."""
    model = tiny_llama(seed=3, vocab=TARGET_VOCAB)
    batch = _batch(model, _cropped(model, DRAFT_VOCAB))
    good, hostile = [1, 2, 3, 1, 2, 3, 1], [5, 6, 7]
    bias = LogitBias({OUTSIDE: 100.0}, TARGET_VOCAB)
    out, reasons, accepted = _decode(batch, [RowRequest("good", good, 40), RowRequest("hostile", hostile, 10,
                                                                                      processors=(bias,))])
    assert reasons == {"good": "length", "hostile": "length"}
    assert out["good"] == hf_generate(model, [good], 40, pad=0)[0]
    assert out["hostile"] == _plain_biased(model, hostile, 10, bias) and OUTSIDE in out["hostile"]
    assert accepted > 0  # the draft model did draft


def test_a_prompt_holding_a_token_the_smaller_draft_cannot_read_is_admitted_and_decoded():
    """Such prompts (token ids given directly), admitted beside another row or joining the running
    batch: none is refused, and every row gives exactly its greedy output (transformers' generate)."""
    model = tiny_llama(seed=3, vocab=TARGET_VOCAB)
    batch = _batch(model, _cropped(model, DRAFT_VOCAB))
    prompts = {"good": [1, 2, 3, 4], "outside": [1, OUTSIDE, 3, 4], "first": [OUTSIDE, 2], "joins": [5, OUTSIDE, 7]}
    out, reasons, accepted = _decode(batch, [RowRequest(k, prompts[k], 20) for k in ("good", "outside", "first")],
                                     [RowRequest("joins", prompts["joins"], 20)])
    assert reasons == {k: "length" for k in prompts}
    assert out == {k: hf_generate(model, [p], 20, pad=0)[0] for k, p in prompts.items()}
    assert accepted > 0  # the good row drafted


def test_a_seeded_row_draws_for_its_own_budget_alone():
    """The draft model draws from a seeded row's generator only for the tokens of that row's own
    budget: drafting beside a row with a larger budget leaves its drafted tokens and its
    generator exactly as drafting alone does."""
    model, dmodel = tiny_llama(seed=3, sharpness=2.0), tiny_llama(seed=4, sharpness=2.0)
    own, other = [1, 2, 3, 1, 2, 3, 1, 4], [5, 6, 5, 6, 7, 5, 6, 9]  # equal lengths: no padding
    pipeline = LogitsPipeline(SamplingConfig(temperature=1.0))

    def draft(seqs: list[list[int]], budgets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rt = TorchRuntime(model)
        prop = DraftModelProposer(None, target=rt, runtime=TorchRuntime(dmodel))
        prop.admit([s[:-1] for s in seqs])
        gens = [torch.Generator().manual_seed(11 + b) for b in range(len(seqs))]
        d = prop.propose(ProposeContext(seqs, budgets, pipeline, torch.Generator().manual_seed(0), generators=gens))
        return d.tokens[0, :budgets[0]], gens[0].get_state()

    alone_tokens, alone_state = draft([own], [2])
    company_tokens, company_state = draft([own, other], [2, 4])
    assert company_tokens.tolist() == alone_tokens.tolist()
    assert torch.equal(company_state, alone_state)


@pytest.mark.parametrize("broken", [math.nan, -math.inf])
def test_a_sampled_row_whose_logits_break_fails_alone_beside_a_draft_model(broken):
    """A sampled row whose processor returns no distribution a few tokens in (NaN, or every token
    banned) ends with finish_reason "error"; the greedy row beside it completes with exactly its
    greedy output (transformers' generate), drafted by the draft model throughout."""
    model = tiny_llama(vocab=64, seed=0, sharpness=8.0)
    batch = _batch(model, model)  # the target drafting for itself: every greedy draft is accepted
    good, bad = [1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 8]

    def breaks(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.full_like(scores, broken) if ids.shape[1] >= len(bad) + 3 else scores

    out, reasons, accepted = _decode(batch, [
        RowRequest("good", good, 20),
        RowRequest("bad", bad, 20, SamplingConfig(temperature=0.8), seed=0, processors=(breaks,))])
    assert reasons == {"good": "length", "bad": "error"}
    assert out["good"] == hf_generate(model, [good], 20, pad=0)[0]
    assert len(out["bad"]) <= 3 and accepted > 0


def test_a_failed_admission_fails_only_the_request_it_fails_for():
    """Two requests admitted in the same scheduler iteration, one the batch refuses (its output
    would pass the context): only that one gets the error; the other runs to its greedy output."""
    model = tiny_llama(seed=3)
    sched = Scheduler(_batch(model, tiny_llama(seed=4)), max_batch=4, policy=DraftPolicy.of(FixedLength(3)))

    async def run() -> tuple[list, list]:
        loop = asyncio.get_running_loop()
        good = Job(RowRequest(sched.new_key(), [1, 2, 3], 12), loop)
        bad = Job(RowRequest(sched.new_key(), [1, 2, 3], 10_000), loop)  # the context holds 256
        sched.submit([good])
        sched.submit([bad])  # both wait: one iteration takes them together
        sched.start()
        events: dict[int, list] = {0: [], 1: []}
        for i, job in enumerate((good, bad)):
            while not events[i] or (events[i][-1][0] == "tokens" and events[i][-1][3] is None):
                events[i].append(await asyncio.wait_for(job.queue.get(), 30))
        return events[0], events[1]

    try:
        good, bad = asyncio.run(run())
    finally:
        sched.stop(0)
    assert bad == [bad[0]] and bad[0][0] == "error" and bad[0][1].startswith("could not start this request")
    assert good[-1][0] == "tokens" and good[-1][3] == "length", good[-1]
    assert [t for e in good for t in e[1]] == hf_generate(model, [[1, 2, 3]], 12, pad=0)[0]
