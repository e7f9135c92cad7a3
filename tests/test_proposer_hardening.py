"""Proposers at their edges: rows joining after undrafted rounds, a draft model with a shorter
context than the target's, hybrids of two feature drafters, heads trained for another target,
and configs that cannot draft (refused when built, not at the first draft)."""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import pytest
import torch
from helpers import hf_generate, plain_greedy, save_random_heads
from test_heads import eagle, medusa, run

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.heads import EagleConfig, EagleDrafter, MedusaHeads, save_head, target_lm_parts
from spec_plugins.heads.parallel import ParallelDrafter
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import FixedLength
from spec_plugins.policy.draft_policy import DraftPolicy
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.eagle import EagleProposer
from spec_plugins.proposers.hybrid import HybridProposer
from spec_plugins.proposers.medusa import MedusaProposer
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

GREEDY = LogitsPipeline(SamplingConfig(temperature=0.0))


def generate(model, prompt, n):
    """transformers' own greedy continuation of one prompt."""
    return hf_generate(model, [prompt], n, pad=0)[0]


class Driver:
    """A batch driven round by round: tokens emitted and draft nodes offered, per row key."""

    def __init__(self, batch: Batch) -> None:
        self.batch, self.outs, self.drafted, self.accepted = batch, {}, {}, {}

    def add(self, *requests: RowRequest) -> None:
        for em in self.batch.add(list(requests)):
            self.outs.setdefault(em.key, []).extend(em.tokens)

    def round(self, k: int) -> bool:
        record = run_round(self.batch, DraftPolicy.of(FixedLength(k)))
        if record is None:
            return False
        sizes = record.draft.row_sizes() if record.draft is not None else [0] * record.rows
        for b, key in enumerate(record.keys):
            self.drafted[key] = self.drafted.get(key, 0) + sizes[b]
            self.accepted[key] = self.accepted.get(key, 0) + len(record.accepted[b])
        for em in record.emissions:
            self.outs.setdefault(em.key, []).extend(em.tokens)
        return True

    def finish(self, k: int) -> None:
        for _ in range(200):
            if not self.round(k):
                return
        raise AssertionError("the batch did not finish")


# ---- draft model: rows joining after rounds without a draft -----------------------------------------

@pytest.mark.parametrize("joining", [[7], [8, 9], [9, 8, 9, 8, 9]])
def test_draft_model_row_joining_after_undrafted_rounds_equals_generate(joining):
    """A row shorter than what the running row lacks in the draft's cache joins: each row catches
    up by its own missing tokens, and every row's output is transformers' greedy output."""
    model = tiny_llama(seed=3, sharpness=6.0)
    target = TorchRuntime(model)
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4, sharpness=6.0)))
    drive = Driver(Batch(target, prop, ExactVerifier()))
    prompts, limits = {"B": [1, 2, 3, 1, 2, 3, 4, 5], "A": joining, "C": [4, 4, 2]}, {"B": 30, "A": 20, "C": 12}
    drive.add(RowRequest("B", prompts["B"], limits["B"]))
    for _ in range(6):
        drive.round(0)
    drive.add(RowRequest("A", prompts["A"], limits["A"]))
    drive.round(3)
    for _ in range(3):
        drive.round(0)
    drive.add(RowRequest("C", prompts["C"], limits["C"]))
    drive.finish(3)
    for key, prompt in prompts.items():
        assert drive.outs[key] == generate(model, prompt, limits[key]), key
    assert drive.drafted["A"] > 0


def test_draft_model_cache_holds_each_row_after_catching_up():
    """A draft with the target's own weights drafts the target's greedy tokens only if its cache
    holds each row's true prefix: every drafted token is accepted, also for rows caught up over
    several forwards."""
    model = tiny_llama(seed=3, sharpness=6.0)
    target = TorchRuntime(model)
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(copy.deepcopy(model)))
    drive = Driver(Batch(target, prop, ExactVerifier()))
    drive.add(RowRequest("B", [1, 2, 3, 1, 2, 3, 4, 5], 30))
    for _ in range(7):
        drive.round(0)
    drive.add(RowRequest("A", [7], 20))
    drive.finish(3)
    assert drive.drafted["A"] > 0 and drive.drafted["B"] > 0
    assert drive.accepted == drive.drafted


# ---- draft model with a shorter context than the target's -------------------------------------------

def short_draft(target):
    """A draft model of 32 positions beside a target of 256."""
    return DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4, sharpness=6.0, max_pos=32)))


def test_draft_with_shorter_context_stops_drafting_at_its_end():
    """Rows draft while the draft model's context holds them, then the target goes on alone."""
    model = tiny_llama(seed=3, sharpness=6.0, max_pos=256)
    target = TorchRuntime(model)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [5, 6, 7]]
    outs, stats = run(target, short_draft(target), prompts, 40, 4)
    assert outs == hf_generate(model, prompts, 40, pad=0)
    assert stats.draft_tokens > 0


def test_prompt_past_the_draft_context_is_decoded_undrafted():
    """A prompt longer than the draft model's context, in a fresh batch and joining a running
    one: the draft never holds it, it gets no draft, and the short row beside it still drafts."""
    model = tiny_llama(seed=3, sharpness=6.0, max_pos=256)
    target = TorchRuntime(model)
    long = list(range(1, 31)) + [1, 2, 3, 4, 5]
    outs, _ = run(target, short_draft(target), [long], 6, 4)
    assert outs == [generate(model, long, 6)]

    drive = Driver(Batch(target, short_draft(target), ExactVerifier()))
    drive.add(RowRequest("short", [5, 6, 7], 20))
    drive.round(4)
    drive.add(RowRequest("long", long, 8))
    drive.finish(4)
    assert drive.outs == {"short": generate(model, [5, 6, 7], 20), "long": generate(model, long, 8)}
    assert drive.drafted["long"] == 0 and drive.drafted["short"] > 0


def test_a_joining_row_the_draft_model_cannot_read_decodes_without_drafts():
    """A row joining a running batch with a token past the draft's vocabulary drafts nothing (the
    target goes on alone there) and the running row keeps drafting: both are the target's greedy."""
    model = tiny_llama(seed=3, sharpness=6.0, vocab=32)
    target = TorchRuntime(model)
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4, sharpness=6.0, vocab=24)))
    batch = Batch(target, prop, ExactVerifier())
    batch.add([RowRequest("a", [1, 2, 3, 4], 10)])
    batch.add([RowRequest("b", [1, 2, 28, 4], 10)])
    while not all(r.done for r in batch.rows):
        run_round(batch, DraftPolicy.of(FixedLength(3)))
    want = hf_generate(model, [[1, 2, 3, 4], [1, 2, 28, 4]], 10, pad=0)
    assert [r.tokens[r.prompt_len:] for r in batch.rows] == want


# ---- hybrids of two feature drafters -------------------------------------------------------------

def test_hybrid_of_eagle_and_parallel_on_a_device_drafter(tmp_path):
    """Two EAGLE-family children fetch their scores side by side on the device path (a drafter
    off the host: its device is not ``HOST``), each under a name of its own."""
    model = tiny_llama(seed=3, sharpness=6.0)
    target = TorchRuntime(model)
    heads = save_random_heads(model, tmp_path)
    cfg = HybridProposer.Config(proposers=[
        {"type": "eagle", "heads": str(heads["eagle"]), "top_k": 2, "tree_nodes": 10},
        {"type": "parallel", "heads": str(heads["parallel"]), "top_k": 2, "tree_nodes": 3}])
    prop = HybridProposer(cfg, target=target)
    for c in prop.children:
        c.device = torch.device("cpu", 0)  # what a CUDA drafter looks like to the host check
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 7]]
    outs, _ = run(target, prop, prompts, 20, 4)
    assert outs == [plain_greedy(model, p, 20) for p in prompts]
    assert all(c.means.means for c in prop.children)


def test_hybrid_refuses_children_reading_different_features(tmp_path):
    model = tiny_llama(seed=3, sharpness=6.0)
    target = TorchRuntime(model)
    for name, layers in (("last", ()), ("fused", (1, 2)), ("other", (2,))):
        h = eagle(model, layers=layers)
        save_head(h, h.config.to_dict(), tmp_path / name)
    for a, b, said in (("last", "fused", r"the last hidden state.*decoder layers \[1, 2\]"),
                       ("fused", "other", r"decoder layers \[1, 2\].*decoder layers \[2\]")):
        cfg = HybridProposer.Config(proposers=[
            {"type": "eagle", "heads": str(tmp_path / d), "top_k": 2, "tree_nodes": 6} for d in (a, b)])
        with pytest.raises(ValueError, match="different target features") as err:
            HybridProposer(cfg, target=target)
        assert re.search(said, str(err.value)) and str(tmp_path / a) in str(err.value)
    same = HybridProposer(HybridProposer.Config(proposers=[
        {"type": "eagle", "heads": str(tmp_path / "fused"), "top_k": 2, "tree_nodes": 6},
        {"type": "suffix", "tree_nodes": 6}]), target=target)
    assert same.feature_layers == (1, 2)


# ---- heads trained for another target -----------------------------------------------------------

LOADERS = {"eagle": EagleDrafter, "medusa": MedusaHeads, "parallel": ParallelDrafter}


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_head_of_another_hidden_size_is_refused_at_load(kind, tmp_path):
    heads = save_random_heads(tiny_llama(seed=3, vocab=64), tmp_path)
    other = tiny_llama(seed=3, vocab=64, hidden=48)
    with pytest.raises(ValueError, match="hidden size 32, this target's is 48") as err:
        LOADERS[kind].from_pretrained(str(heads[kind]), other)
    assert str(heads[kind]) in str(err.value)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_head_drafting_tokens_past_the_target_vocabulary_is_refused_at_load(kind, tmp_path):
    from safetensors.torch import load_file, save_file

    heads = save_random_heads(tiny_llama(seed=3, vocab=64), tmp_path)
    f = heads[kind] / "head.safetensors"
    state = load_file(str(f))
    state["vocab_ids"] = torch.cat([state["vocab_ids"][:-1], torch.tensor([60])])
    save_file(state, str(f), metadata={"kind": kind})
    with pytest.raises(ValueError, match="holds token 60, outside this target's vocabulary of 32") as err:
        LOADERS[kind].from_pretrained(str(heads[kind]), tiny_llama(seed=3, vocab=32))
    assert str(heads[kind]) in str(err.value)


@pytest.mark.parametrize("kind", ["eagle", "parallel"])
def test_head_reading_layers_the_target_lacks_is_refused_before_a_forward(kind, tmp_path):
    """Heads fused from layers 1 and 2 on a one-layer target of the same width: refused when the
    batch pairs them, not an IndexError inside the first forward's hidden states."""
    from spec_plugins.proposers.parallel import ParallelProposer

    two, one = tiny_llama(seed=3), tiny_llama(seed=3, layers=1)
    heads = save_random_heads(two, tmp_path)
    with torch.no_grad():  # the same LM head and embeddings: the heads' own target but for its depth
        one.lm_head.weight.copy_(two.lm_head.weight)
        one.model.embed_tokens.weight.copy_(two.model.embed_tokens.weight)
    target = TorchRuntime(one)
    cls = {"eagle": EagleProposer, "parallel": ParallelProposer}[kind]
    prop = cls(cls.Config(heads=str(heads[kind])), target=target)
    calls = []
    forward = target.forward
    target.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    with pytest.raises(ValueError, match=r"reads decoder layers \[1, 2\], but the target has layers 1..1"):
        run(target, prop, [[3, 7, 1]], 4, 3)
    assert calls == []


# ---- configs that could never draft --------------------------------------------------------------

def test_recycling_refuses_empty_paths():
    with pytest.raises(ValueError, match="paths is empty"):
        RecyclingProposer.Config(paths=[])


def test_tree_top_k_past_the_draft_vocabulary_is_refused_at_build():
    """Medusa and EAGLE trees take top_k of the heads' draft vocabulary (a chain does not)."""
    model = tiny_llama(seed=3, sharpness=6.0)
    lm, emb = target_lm_parts(model)
    small = torch.arange(2, 6)
    m = medusa(model)
    m = MedusaHeads(m.config, lm, small)
    with pytest.raises(ValueError, match="top_k=8 .* 4 tokens"):
        MedusaProposer(MedusaProposer.Config(heads="unused", top_k=8), heads=m)
    MedusaProposer(MedusaProposer.Config(heads="unused", mode="chain", top_k=8), heads=m)
    d = EagleDrafter(EagleConfig(lm.shape[1], num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=4),
                     lm, emb, small)
    with pytest.raises(ValueError, match="top_k=8 .* 4 tokens"):
        EagleProposer(EagleProposer.Config(heads="unused", top_k=8, tree_nodes=10), drafter=d)
    EagleProposer(EagleProposer.Config(heads="unused", mode="chain", top_k=8), drafter=d)


def test_docs_name_the_hybrid_probe_interval_the_policy_uses():
    """The hybrid's probe interval is no config field: the docs give the policy's fixed value."""
    docs = " ".join((Path(__file__).parents[1] / "docs" / "proposers.md").read_text().split())
    every = inspect.signature(DraftPolicy.__init__).parameters["probe_every"].default
    assert "`probe_every`" not in docs and "probe_every" not in HybridProposer.Config.model_fields
    assert f"probed every {every} rounds" in docs


# ---- a seeded row's drafts come from its own generator ---------------------------------------------
def _seeded_draft_run(batch_seed: int, neighbour: bool) -> list[int]:
    """A request with seed 123 sampled at temperature 1 through a draft model, on a batch whose own
    generator is ``batch_seed``, maybe beside an unseeded row (which draws from the batch's)."""
    hot = SamplingConfig(temperature=1.0)
    rt = TorchRuntime(tiny_llama(seed=3, sharpness=2.0))
    prop = DraftModelProposer(None, target=rt, runtime=TorchRuntime(tiny_llama(seed=4, sharpness=2.0)))
    batch = Batch(rt, prop, ExactVerifier(), seed=batch_seed)
    reqs = [RowRequest("s", [1, 2, 3, 1, 2], 30, hot, seed=123)]
    if neighbour:
        reqs.append(RowRequest("n", [5, 6, 5, 6, 7, 8], 30, hot))  # as long: the same draft width each round
    out = [t for e in batch.add(reqs) if e.key == "s" for t in e.tokens]
    policy = DraftPolicy.of(FixedLength(3))
    while (record := run_round(batch, policy)) is not None:
        out += [t for e in record.emissions if e.key == "s" for t in e.tokens]
    return out


def test_a_seeded_row_drafts_from_its_own_generator():
    """The draft model sampled every row's draft tokens from the batch's shared generator, so a
    seeded request's output followed whatever else had drawn from it (another batch seed, earlier
    traffic on a server's long-lived batch); it draws from the row's own, as its verdict does."""
    alone = _seeded_draft_run(0, False)
    assert len(alone) == 30
    assert _seeded_draft_run(1, False) == alone
    assert _seeded_draft_run(0, True) == alone


def test_a_short_draft_model_is_measured_drafting():
    """Measuring a draft model's cost on a context longer than its own timed calls that drafted
    nothing (it drafts no row past its context): drafting read as free to ``auto``. The
    measurement context fits the drafter, so every timed call drafts."""
    from spec_plugins.policy.cost import measure_draft

    target = TorchRuntime(tiny_llama(seed=3, max_pos=256))
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4, max_pos=64)))
    drafts, inner = [], prop.propose
    prop.propose = lambda ctx: drafts.append(inner(ctx)) or drafts[-1]
    measure_draft(prop, GREEDY, target, context=128)
    assert drafts and all(d is not None for d in drafts)
