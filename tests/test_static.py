"""The static-cache torch path (``backends/torch_static.py``).

Token-identical to the dynamic path and to plain greedy decoding for every proposer (one row, a
batch with holes, rows joining a running batch), exact under sampling (chi-square), compiled with
``fullgraph=True`` on the CPU; the host-sync counter's own checks (the matrix of one sync per round
is ``tests/test_host_syncs.py``)."""

from __future__ import annotations

import pytest
import torch
from helpers import EVERY_PROPOSER, chi_square_pvalue, every_proposer, exact_joint, plain_greedy, save_random_heads

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.backends.torch_static import StaticTorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]]
GREEDY = LogitsPipeline(SamplingConfig())


def _outs(rt, proposer, prompts, n=16, pipe=GREEDY, gen=None, k=3):
    outs = [[] for _ in prompts]
    for step in decode(rt, proposer, ExactVerifier(), pipe, prompts, n, (), gen, None, FixedLength(k)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", EVERY_PROPOSER)
def test_static_path_is_token_identical_to_the_dynamic_path(kind, rows, tmp_path):
    model = tiny_llama(seed=3, sharpness=2.0)
    heads = save_random_heads(model, tmp_path)
    prompts = PROMPTS[:rows]
    got = {}
    for name, make in (("dynamic", lambda: TorchRuntime(model, matmul="native")),
                       ("static", lambda: StaticTorchRuntime(model))):
        rt = make()
        draft = lambda: make()  # noqa: E731 - the draft model runs on the same kind of runtime
        got[name] = _outs(rt, every_proposer(kind, rt, heads, draft=draft), prompts)
    assert got["static"] == got["dynamic"] == [plain_greedy(model, p, 16) for p in prompts]


@pytest.mark.parametrize("kind", EVERY_PROPOSER)
def test_rows_joining_a_running_static_batch_equal_their_solo_output(kind, tmp_path):
    """The server's batch (``loop.Batch``) over the static cache: rows join a running batch
    (prefilled apart and copied into the buffers) and leave it; each row's output is plain greedy
    decoding's, for every proposer."""
    from test_batch import drive

    from spec_plugins.loop import Batch
    from spec_plugins.types import RowRequest

    model = tiny_llama(seed=3, sharpness=2.0)
    heads = save_random_heads(model, tmp_path)
    rt = StaticTorchRuntime(model)
    batch = Batch(rt, every_proposer(kind, rt, heads, draft=lambda: StaticTorchRuntime(model)), ExactVerifier())
    reqs = [RowRequest(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS * 2, [20, 7, 30, 12, 9, 25]))]
    outs = drive(batch, FixedLength(4), {0: reqs[:1], 2: reqs[1:3], 5: reqs[3:5], 9: reqs[5:]})
    for r in reqs:
        assert outs[r.key] == plain_greedy(model, r.prompt, r.max_new_tokens), (kind, r.key)
    assert len(batch) == 0 and rt.lengths() == []


def test_the_compiled_step_is_one_graph_and_equal_to_eager():
    """``torch.compile(fullgraph=True)`` of the verify step: a graph break would raise; rows and
    positions padded to their buckets give the eager step's tokens."""
    from spec_plugins.proposers.ngram import NgramProposer

    model = tiny_llama(seed=3, sharpness=2.0)
    rt = StaticTorchRuntime(model, compile=True)
    out = _outs(rt, NgramProposer(NgramProposer.Config()), PROMPTS, n=12)
    assert out == [plain_greedy(model, p, 12) for p in PROMPTS]
    assert any(s.used for s in rt._steps.values())  # the compiled step ran
    eager = StaticTorchRuntime(model)
    assert _outs(eager, NgramProposer(NgramProposer.Config()), PROMPTS, n=12) == out


def test_the_buffers_grow_a_few_times_up_to_the_context_end(monkeypatch):
    """A long row keeping one node per round beside a short row keeping five leaves holes, squeezed
    out only past ``compact_holes`` of the slot axis, so near the context end the axis passes
    ``max_context``: the buffers are sized for the longest axis compaction allows, so they grow a
    few times in a generation (each growth drops every compiled or captured step), not on every
    forward, and every kept node's greedy token is plain greedy decoding's."""
    from spec_plugins.backends import torch_static

    sizes = []

    class Counted(torch_static.SlotCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sizes.append(self.capacity)

    monkeypatch.setattr(torch_static, "SlotCache", Counted)
    model = tiny_llama(seed=3, sharpness=2.0, max_pos=512)
    long, short = [1, 2, 3, 4] * 110, [5, 6, 7]
    rounds, width = 512 - len(long), 5
    ref_long, ref_short = plain_greedy(model, long, rounds), plain_greedy(model, short, (rounds - 1) * width + 1)
    rt = StaticTorchRuntime(model)
    first = rt.prefill([long, short]).logits[:, -1].argmax(-1).tolist()
    assert first == [ref_long[0], ref_short[0]]
    got_long, got_short = [ref_long[0]], [ref_short[0]]
    for r in range(rounds - 1):
        # the long row: its pending token and nodes it rejects; the short row: plain greedy's next tokens
        fed_short = ref_short[r * width: (r + 1) * width]
        tokens = torch.tensor([[got_long[-1]] + [0] * (width - 1), fed_short])
        greedy = rt.forward(tokens).logits.argmax(-1)
        rt.commit([[0], list(range(width))])
        got_long.append(int(greedy[0, 0]))
        got_short.extend(greedy[1].tolist())
    assert max(rt.lengths()) == 511 and got_long == ref_long
    assert got_short == ref_short[:len(got_short)]
    assert len(sizes) <= 3 and sizes == sorted(sizes), f"the buffers were allocated {len(sizes)} times: {sizes}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile: graphs captures CUDA graphs; no CUDA device "
                    "here (scripts/gpu_check.sh runs it on a lent GPU)")
@pytest.mark.parametrize("kind", ["ngram", "eagle-tree"])
def test_captured_cuda_graphs_equal_plain_greedy(kind, tmp_path):
    """``compile: graphs``: the eager step captured per bucket (no compiler) gives plain greedy
    decoding's tokens, one row and a batch with holes."""
    model = tiny_llama(seed=3, sharpness=2.0)
    heads = save_random_heads(model, tmp_path)
    model = model.to("cuda")
    rt = StaticTorchRuntime(model, graphs=True)
    for prompts in ([PROMPTS[0]], PROMPTS):
        assert _outs(rt, every_proposer(kind, rt, heads), prompts, n=12) == [plain_greedy(model, p, 12) for p in prompts]
    assert any(s.used for s in rt._steps.values())  # the captured path ran


def test_graphs_are_refused_where_there_is_no_cuda():
    """``compile: graphs`` needs CUDA: refused by name on a CPU (nothing falls back silently)."""
    from pydantic import ValidationError

    with pytest.raises(ValueError, match="graphs"):
        StaticTorchRuntime(tiny_llama(seed=3), graphs=True)
    with pytest.raises(ValidationError, match="compile: graphs needs kv: static"):
        TorchRuntime.Config(model="x", kv="dynamic", compile="graphs")
    cfg = TorchRuntime.Config(model="smollm2-135m-instruct", device="cpu", compile="graphs")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StaticTorchRuntime.from_config(cfg)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_sampling_through_the_static_cache_is_exact(kind):
    from test_exact_sampling import PROMPT, V, _draft, speculative_samples

    from spec_plugins.proposers.ngram import NgramProposer

    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    pipe = LogitsPipeline(SamplingConfig(temperature=1.0))
    exact = exact_joint(model, PROMPT, 3, pipe)
    make = _draft if kind == "draft" else (lambda t: NgramProposer(NgramProposer.Config(max_ngram=2)))
    samples = speculative_samples(model, make, pipe, ExactVerifier(), k=2, runtime=StaticTorchRuntime)
    assert chi_square_pvalue(samples, exact) > 1e-3


# ---- host syncs (the whole matrix: tests/test_host_syncs.py) -----------------------------------------
def test_the_sync_counter_sees_a_read_of_device_data():
    from spec_plugins.device_audit import HostSyncs

    dev = torch.device("cpu", 0)
    with HostSyncs(dev) as syncs:
        x = torch.ones(3, device=dev)
        y = (x * 2).sum()
        host = torch.ones(3, device="cpu").tolist()  # host data: free
        _ = y.item()
        _ = bool(x[0] > 0)
        _ = x.to("cpu")
    assert host and syncs.count == 3
    # uploads that wait (a blocking copy synchronizes a CUDA stream) count; transfer.upload's do not
    from spec_plugins.transfer import upload, upload_tensor

    with HostSyncs(dev) as syncs:
        _ = torch.tensor([1, 2], device=dev)
        _ = torch.ones(2, device="cpu").to(dev)
        _ = torch.ones(2, device=dev) + 1  # made there: no transfer
        _ = upload(torch.ones(2, device="cpu"), dev), upload_tensor([[1, 2]], dev)
    assert syncs.count == 2, syncs.where


def test_the_static_settings_are_checked_where_they_are_read():
    """``kv``/``compile``/``matmul`` combinations that cannot run are refused by name (nothing is
    ignored), and ``auto`` keeps the CPU on the growing cache, where compiling was measured slower."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="compile: on needs kv: static"):
        TorchRuntime.Config(model="x", kv="dynamic", compile="on")
    with pytest.raises(ValidationError, match="auto_transposed needs kv: dynamic"):
        TorchRuntime.Config(model="x", kv="static", matmul="auto_transposed")
    cfg = TorchRuntime.Config(model="x")
    assert (cfg.kv, cfg.compile, cfg.dtype) == ("auto", "auto", "auto")


def test_auto_keeps_the_cpu_on_the_growing_eager_path():
    """On a CPU ``kv: auto`` is the growing cache and ``compile: auto`` stays off on a static one
    (compiling was measured slower here: docs/runtimes/torch.md); forcing either is honoured, and
    ``compile: on`` alone implies the static cache (never ignored)."""
    from spec_plugins.backends import build_runtime

    def build(**kw):
        return build_runtime(TorchRuntime.Config(model="smollm2-135m-instruct", device="cpu", **kw))

    rt = build(matmul="native")
    assert type(rt) is TorchRuntime and rt.dtype == torch.float32
    static = build(kv="static")
    assert isinstance(static, StaticTorchRuntime) and not static.compile
    for forced in (build(kv="static", compile="on"), build(compile="on")):
        assert isinstance(forced, StaticTorchRuntime) and forced.compile
    with pytest.raises(ValueError, match="selects the static cache"):
        TorchRuntime.from_config(TorchRuntime.Config(model="smollm2-135m-instruct", device="cpu", compile="on"))


def _drafted(ranked) -> list:
    """What a tree drafter offered: its device-built tree's tokens, or its host rows' tokens."""
    if ranked.shaped:
        return ranked.shaped[0].draft.tokens.tolist()
    return [[list(r.tokens) for r in alts] for alts in ranked.rows]


def test_the_eagle_draft_step_compiles_as_one_graph_and_drafts_as_eager(tmp_path):
    """The EAGLE draft step as a function of tensors over the cache padded to its capacity bucket,
    compiled with ``torch.compile(fullgraph=True)`` (a graph break would raise): the same drafts as
    the eager step, and greedy output equal to plain decoding."""
    from spec_plugins.proposers.eagle import EagleProposer

    model = tiny_llama(seed=3, sharpness=2.0)
    heads = save_random_heads(model, tmp_path)
    drafts = {}
    for mode in ("eager", "compile"):
        rt = TorchRuntime(model, matmul="native")
        prop = EagleProposer(EagleProposer.Config(heads=str(heads["eagle"]), tree_nodes=6, top_k=2), target=rt,
                             step_mode=mode)
        seen = drafts[mode] = []
        propose = prop.propose
        prop.propose = lambda ctx, p=propose, seen=seen: (r := p(ctx), seen.append(_drafted(r)))[0]
        assert _outs(rt, prop, PROMPTS, n=10) == [plain_greedy(model, p, 10) for p in PROMPTS]
        assert prop._draft_step.used == (mode == "compile")
    assert drafts["compile"] == drafts["eager"] and drafts["eager"]


# ---- hardening: what the prefill computes, models a graph cannot hold, the buffers' capacity ---------
def test_a_static_prefill_asks_the_model_for_the_last_logits_only():
    """A prefill reads each row's last logits only, so the model computes those only (a large
    vocabulary over a long prompt would be GiBs of float logits), as the growing cache asks; the
    hidden states a feature drafter reads still come back for every position, equal to the
    growing cache's, and decoding equals transformers' ``generate``."""
    from helpers import hf_generate

    from spec_plugins.proposers.ngram import NgramProposer

    model = tiny_llama(seed=3, sharpness=2.0)
    shapes = []
    hook = model.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.logits.shape)))
    try:
        for want in (False, True, (1, 2)):
            shapes.clear()
            out = StaticTorchRuntime(model).prefill(PROMPTS, want_hidden=want)
            assert shapes == [(3, 1, 32)] and out.logits.shape == (3, 1, 32), want
            if want:
                ref = TorchRuntime(model, matmul="native").prefill(PROMPTS, want_hidden=want)
                assert out.hidden.shape[:2] == (3, 9)
                torch.testing.assert_close(out.hidden, ref.hidden)
    finally:
        hook.remove()
    got = _outs(StaticTorchRuntime(model), NgramProposer(NgramProposer.Config()), PROMPTS, n=12)
    assert got == hf_generate(model, PROMPTS, 12, pad=0)


def _dynamic_rope_llama():
    """conftest's tiny llama with a dynamic-NTK rope (``rope_parameters``, transformers 5.x's spelling)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20.0)
    return model


def test_a_model_whose_forward_is_no_one_graph_is_decided_at_build(monkeypatch):
    """A dynamic-NTK rope branches on each forward's largest position (no fullgraph compile, no
    CUDA graph capture): ``compile: on`` is refused when the runtime is built, naming the rope type
    and the settings that run it (not by the compiler on the first verify, mid-round), ``compile:
    auto`` on CUDA keeps its step eager, and the eager static cache decodes it as plain greedy."""
    from spec_plugins.backends import torch_static

    from spec_plugins.proposers.ngram import NgramProposer

    model = _dynamic_rope_llama()
    with pytest.raises(ValueError, match=r"rope_type 'dynamic'.*compile: off.*kv: dynamic"):
        StaticTorchRuntime(model, compile=True)
    monkeypatch.setattr(torch_static, "load_for", lambda config: (model, None))
    with pytest.raises(ValueError, match=r"rope_type 'dynamic'.*compile: off"):
        StaticTorchRuntime.from_config(TorchRuntime.Config(model="x", device="cpu", compile="on"))
    rt = StaticTorchRuntime.from_config(TorchRuntime.Config(model="x", device="cpu", kv="static"))
    assert not rt.compile and rt.step_mode == "eager"
    plain = StaticTorchRuntime(tiny_llama(seed=3))
    for r in (rt, plain):
        r.device = torch.device("cuda")  # what compile: auto reads (this machine has no CUDA device)
    assert rt._compiles("auto", False) is False and plain._compiles("auto", False) is True
    rt.device = torch.device("cpu")
    out = _outs(rt, NgramProposer(NgramProposer.Config()), PROMPTS, n=12)
    assert out == [plain_greedy(model, p, 12) for p in PROMPTS]


def test_a_joining_row_never_shrinks_the_buffers_capacity(monkeypatch):
    """A row joining a long one grows the buffers' rows: the reallocation keeps the capacity they
    had (each one copies the KV and drops every compiled step; sizing it for the slots held now
    shrank 128 to 64, and the next round grew it back), and both rows decode as plain greedy."""
    from spec_plugins.backends import torch_static

    from spec_plugins.loop import Batch, run_round
    from spec_plugins.policy import DraftPolicy
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.types import RowRequest

    allocs = []

    class Counted(torch_static.SlotCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            allocs.append((self.rows, self.capacity))

    monkeypatch.setattr(torch_static, "SlotCache", Counted)
    model = tiny_llama(seed=3, sharpness=2.0)
    rt = StaticTorchRuntime(model)
    batch, policy = Batch(rt, NgramProposer(NgramProposer.Config()), ExactVerifier()), DraftPolicy.of(FixedLength(3))
    reqs = [RowRequest(0, [1, 2, 3, 4] * 14, 60), RowRequest(1, [9, 4], 20)]
    outs: dict = {}

    def emit(emissions):
        for em in emissions:
            outs.setdefault(em.key, []).extend(em.tokens)

    emit(batch.add(reqs[:1]))
    while rt.lengths()[0] < 61:  # past 64 slots with one row, then the second row joins
        emit(run_round(batch, policy).emissions)
    emit(batch.add(reqs[1:]))
    while len(batch):
        record = run_round(batch, policy)
        emit(record.emissions if record is not None else [])
    caps = [c for _, c in allocs]
    assert caps == sorted(caps) and allocs[-1] == (2, 128), allocs
    for r in reqs:
        assert outs[r.key] == plain_greedy(model, r.prompt, r.max_new_tokens), r.key


@pytest.mark.parametrize("n", [400, 440])
def test_a_wider_new_batch_gets_the_capacity_its_prompts_need_once(n):
    """A new batch with more rows than the buffers: capacity for its prompts plus one widest
    forward (the headroom counted once: twice doubled 512 to 1024 for 400-token prompts, and
    attention reads the whole capacity every forward)."""
    from spec_plugins.backends.torch_static import HEADROOM

    rt = StaticTorchRuntime(tiny_llama(seed=3, max_pos=2048))
    rt.prefill([[1, 2, 3]])
    rt.prefill([[5] * n, [6] * n])
    assert rt.cache.rows == 2 and n + HEADROOM <= rt.cache.capacity == 512
