"""``speculative_generate`` against plain ``model.generate()`` where a batch's layout used to leak
into row-free processing (transformers' ``encoder_*`` processors, the pad-aware repetition penalty
with pads of any value), where a call that raised mid-decode left its rows on the model, where the
kept runtime outlived a resized model, where stopping criteria ended rows unlike plain
``generate()``, and where a mask or streamer transformers handles was refused or dropped obscurely."""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits
from test_transformers_integration import PAD, PROMPTS, Recorder, both, left_padded
from transformers import MaxTimeCriteria, StoppingCriteria, StoppingCriteriaList

from conftest import tiny_llama
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.proposers.ngram import NgramProposer

NGRAM = {"spec_config": {"proposer": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 2}}}


@pytest.mark.parametrize("option", [{"encoder_repetition_penalty": 0.3}, {"encoder_no_repeat_ngram_size": 2}])
@pytest.mark.parametrize("draft", ["ngram", "draft_model"])
def test_encoder_processors_in_a_left_padded_batch_equal_plain_generate(option, draft):
    """transformers builds these from the padded prompt batch, indexed by row, also for
    decoder-only models: a batch > 1 failed with a tensor size error (or ZeroDivisionError)."""
    model = tiny_llama(seed=3)
    inputs = left_padded([*PROMPTS[:3], [11, 12, 13, 11, 8, 14]])  # row 3 ends in a pair the model repeats
    spec_kw = NGRAM if draft == "ngram" else {"draft_model": tiny_llama(seed=4)}
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    plain, spec = both(model, inputs, spec_kw, **kw, **option)
    assert torch.equal(spec, plain)
    assert not torch.equal(plain, model.generate(**inputs, **kw))  # the option changes the output


def test_encoder_ngram_processor_is_built_once_per_prompt_not_per_call(monkeypatch):
    """Its n-gram table is built in Python from the whole prompt: it was rebuilt from every row's
    prompt on every processor call (every depth group of every round). Now: generate()'s own
    build, then one per distinct padded prompt, per speculative_generate call."""
    from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor as Proc

    model = tiny_llama(seed=3)
    prompts = [*PROMPTS, PROMPTS[1]]  # five rows, four distinct padded prompts
    inputs = left_padded(prompts)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD, encoder_no_repeat_ngram_size=2)
    plain = model.generate(**inputs, **kw)
    built = []
    init = Proc.__init__
    monkeypatch.setattr(Proc, "__init__", lambda self, n, enc: (built.append(enc.shape), init(self, n, enc))[1])
    spec = model.generate(**inputs, **kw, custom_generate=speculative_generate, **NGRAM)
    assert torch.equal(spec, plain)
    L = inputs["input_ids"].shape[1]
    assert built == [(5, L)] + [(1, L)] * 4


@pytest.mark.parametrize("pad_token_id", [None, 5])
def test_repetition_penalty_skips_pads_of_any_token_like_plain_generate(pad_token_id):
    """The pads are the attention mask's zeros, whatever token fills them: pads other than
    pad_token_id (or than EOS, which transformers puts there when none is given) were refused,
    and so was a prompt starting with the pads' token."""
    model = tiny_llama(seed=3)
    prompts = [*PROMPTS, [9, 3, 9]]
    pad = int(full_logits(model, prompts[1]).argmax())  # a token the short row wants: penalising pads bites
    prompts[-1][0] = pad  # a prompt that starts with the pads' token
    inputs = left_padded(prompts, pad)
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=31, pad_token_id=pad_token_id)
    plain, spec = both(model, inputs, NGRAM, repetition_penalty=3.0, **kw)
    assert torch.equal(spec, plain)
    # meaningful only because penalising the pads would change plain generate()'s output
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    blind = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0)])
    assert not torch.equal(plain, model.generate(**inputs, **kw, logits_processor=blind))


def test_repetition_penalty_refuses_identical_prompts_with_different_pads():
    """Rows regrouped per drafted node are told apart by their padded prompt: two equal ones
    that skip different numbers of tokens cannot be, and are refused by name."""
    model = tiny_llama(seed=3)
    inputs = {"input_ids": torch.tensor([[PAD, 5, 6], [PAD, 5, 6]]), "attention_mask": torch.tensor([[1, 1, 1],
                                                                                                      [0, 1, 1]])}
    with pytest.raises(ValueError, match="rows 0 and 1 have identical input_ids but skip 0 and 1 leading tokens"):
        model.generate(**inputs, max_new_tokens=4, pad_token_id=PAD, repetition_penalty=1.3,
                       custom_generate=speculative_generate)


class RaiseAt(StoppingCriteria):
    """Raises once it has been asked ``n`` times (a user criterion that fails mid-decode)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        self.n -= 1
        if self.n == 0:
            raise OSError("client went away")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_call_that_raises_mid_decode_leaves_no_rows_on_the_model():
    """The kept runtime holds no KV between calls: the release ran on the normal path only, so a
    raising criterion (streamer, Ctrl-C) left the failed call's cache on the model."""
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    proposer = NgramProposer(NgramProposer.Config())
    kw = dict(max_new_tokens=24, pad_token_id=PAD, custom_generate=speculative_generate, proposer=proposer)
    with pytest.raises(OSError, match="client went away"):
        model.generate(**inputs, **kw, stopping_criteria=StoppingCriteriaList([RaiseAt(20)]))
    runtime = model.__dict__["_spec_plugins"].runtime
    assert runtime.lengths() == [] and sum(t.numel() for t in runtime.kv) == 0
    assert proposer.num_rows() == 0
    assert torch.equal(model.generate(**inputs, **kw), model.generate(**inputs, max_new_tokens=24, pad_token_id=PAD))


def test_a_resized_vocabulary_rebuilds_the_kept_runtime():
    """The kept runtime was rebuilt on a device, dtype or attention change only: after
    ``resize_token_embeddings`` it kept the old vocabulary size and refused the new tokens
    ("token id 44 is outside the target's vocabulary (0..31)") where plain generate() emits them."""
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    kw = {"max_new_tokens": 10, "pad_token_id": PAD}
    plain, spec = both(model, inputs, NGRAM, **kw)
    assert torch.equal(spec, plain)
    model.resize_token_embeddings(48, mean_resizing=False)
    with torch.no_grad():
        model.lm_head.weight[32:] = model.lm_head.weight[:16] * 3  # the new tokens win
    plain, spec = both(model, inputs, NGRAM, **kw)
    assert torch.equal(spec, plain)
    assert (plain >= 32).any()  # the new tokens are emitted


def test_a_longer_context_rebuilds_the_kept_runtime():
    """The kept runtime kept the context it read first: a call past it was refused after
    ``max_position_embeddings`` grew (a call the runtime of a fresh load accepts)."""
    model = tiny_llama(seed=3, max_pos=16)
    inputs = {"input_ids": torch.tensor([PROMPTS[0]])}
    both(model, inputs, NGRAM, max_new_tokens=4)
    model.config.max_position_embeddings = 64
    plain, spec = both(model, inputs, NGRAM, max_new_tokens=20)
    assert torch.equal(spec, plain)


class StopOn(StoppingCriteria):
    """Stops a row whose last token is ``token`` (a per-row user criterion)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("pad_token_id", [None, PAD])
@pytest.mark.parametrize("spec_kw", [NGRAM, "same_draft"])
def test_rows_a_criterion_stops_keep_their_real_tokens_without_an_eos(pad_token_id, spec_kw):
    """With no EOS criterion plain generate() keeps appending a stopped row's real tokens until
    every row has stopped: without a pad id this raised after the whole decode ("rows finished at
    different lengths"), with one the rows were padded."""
    model = tiny_llama(seed=3)
    spec_kw = {"draft_model": model} if spec_kw == "same_draft" else spec_kw  # long rounds: stops inside them
    inputs = left_padded(PROMPTS)
    kw = {"max_new_tokens": 12, "pad_token_id": pad_token_id, "stopping_criteria": StoppingCriteriaList([StopOn(8)])}
    plain, spec = both(model, inputs, spec_kw, **kw)
    assert torch.equal(spec, plain)
    full = model.generate(**inputs, max_new_tokens=12, pad_token_id=pad_token_id)
    new = plain[:, inputs["input_ids"].shape[1]:].tolist()
    assert plain.shape[1] < full.shape[1]  # the criterion ended the batch early
    assert sum(8 in row[:-1] for row in new) >= 2  # rows that stopped early went on with real tokens


class TimeUpAfter(MaxTimeCriteria):
    """``max_time`` with a clock that runs out after ``n`` checks: one answer for the whole batch."""

    def __init__(self, n: int) -> None:
        super().__init__(max_time=1.0)
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        self.n -= 1
        return torch.full((input_ids.shape[0],), self.n < 0, dtype=torch.bool)


@pytest.mark.parametrize("pad_token_id", [None, PAD])
def test_max_time_ends_every_row_at_one_step(pad_token_id):
    """Plain generate() stops every row at the step time runs out: rows were ended at different
    lengths (raising without a pad id, padded with one). Now all rows end together, each the
    start of its plain greedy output. Checks are per token of each row, so time runs out inside a
    round of long drafts (the model drafting for itself), with rows at different lengths."""
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    full = model.generate(**inputs, max_new_tokens=16, pad_token_id=pad_token_id)
    spec = model.generate(**inputs, max_new_tokens=16, pad_token_id=pad_token_id, custom_generate=speculative_generate,
                          stopping_criteria=StoppingCriteriaList([TimeUpAfter(13)]), draft_model=model)
    assert inputs["input_ids"].shape[1] < spec.shape[1] < full.shape[1]
    assert torch.equal(spec, full[:, :spec.shape[1]])


def test_a_pad_id_inside_a_prompt_without_a_mask_is_refused_by_its_cause():
    """generate() infers the mask from pad_token_id when none is passed, masking a pad id inside the
    prompt: the refusal said the mask was not left-padded (and to set padding_side), though no
    mask was passed. An explicit mask makes the same prompt run as in plain generate()."""
    model = tiny_llama(seed=3)
    ids = torch.tensor([[3, 4, PAD, 5, 6]])
    with pytest.raises(ValueError, match=r"if you passed no attention_mask, generate\(\) inferred it from "
                                         r"pad_token_id=0.*pass an explicit attention_mask"):
        model.generate(input_ids=ids, max_new_tokens=8, pad_token_id=PAD, custom_generate=speculative_generate)
    plain, spec = both(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, NGRAM,
                       max_new_tokens=8, pad_token_id=PAD)
    assert torch.equal(spec, plain)


def test_a_streamer_given_to_the_callable_is_refused_and_ended():
    """transformers puts the prompt into generate(streamer=) and calls a callable custom_generate
    without it: the streamer got the prompt only and never end(), so a TextIteratorStreamer's
    reader waited forever. Refused by name, the streamer ended first."""
    model = tiny_llama(seed=3)
    streamer = Recorder()
    with pytest.raises(ValueError, match="pass it as spec_streamer="):
        model.generate(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=4, streamer=streamer,
                       custom_generate=speculative_generate)
    assert streamer.ended
