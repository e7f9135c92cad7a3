"""One device-to-host sync per round, for every proposer and every kind of batch, on both caches.

Counted without a GPU (``device_audit.HostSyncs``): the target runtime (and the draft model's) is
given ``torch.device("cpu", 0)``, a device unequal to the host's, so what it computes is "on the
device" and reading it back (or a blocking upload to it) counts. The model's weights are marked as
device data and everything else (proposer, heads, batch, rows) is built inside the counter, so
every device tensor is marked; only the rounds (``run_round`` calls after the rows' admission) are
counted. While the counter runs a device tensor *says* it is on the device, as on a GPU (see
``HostSyncs``)."""

from __future__ import annotations

import pytest
import torch
from helpers import EVERY_PROPOSER, every_proposer, plain_greedy, save_random_heads

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.backends.torch_static import StaticTorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.device_audit import HostSyncs
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

DEV = torch.device("cpu", 0)  # the same memory, a device unequal to the host's: see HostSyncs
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]]  # lengths 7, 9, 2: holes
N = 12
HOT = SamplingConfig(temperature=0.9, top_k=8)
WARM = SamplingConfig(temperature=0.7)
REP = SamplingConfig(repetition_penalty=1.3)


def nudge(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A user logits processor reading the prefix (transformers' signature), all on the device."""
    return scores - 0.1 * (ids[:, -1:] % 3).to(scores.dtype)


def fails_late(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A user processor that raises once the prefix reaches 10 tokens: its nodes are processed apart."""
    if ids.shape[1] >= 10:
        raise RuntimeError("a processor failing mid-decode")
    return scores


# cell -> (rows as (prompt, sampling, seed, logprobs[, processors]), the batch's top_logprobs)
CELLS = {
    "one-greedy": ([(PROMPTS[0], None, None, False)], 0),
    "holes-greedy": ([(p, None, None, False) for p in PROMPTS], 0),
    "seeded-sampled": ([(p, HOT, 10 + i, False) for i, p in enumerate(PROMPTS)], 0),
    "mixed": ([(PROMPTS[0], None, None, False), (PROMPTS[1], HOT, 11, False), (PROMPTS[2], WARM, 12, False)], 0),
    "rep-penalty": ([(PROMPTS[0], REP, None, False)], 0),
    # each row its own pipeline: processed per pipeline and per (row length, depth) group
    "rep-and-processor": ([(PROMPTS[0], REP, None, False, (nudge,)), (PROMPTS[2], REP, None, False, (nudge,))], 0),
    "logprobs": ([(PROMPTS[0], None, None, True)], 5),
    "processor-raises": ([(PROMPTS[0], None, None, False, (fails_late,)), (PROMPTS[1], None, None, False),
                          (PROMPTS[2], HOT, 12, False)], 0),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_llama(seed=3, sharpness=2.0)
    return model, save_random_heads(model, tmp_path_factory.mktemp("heads"))


def _runtime(model, cache: str = "static") -> TorchRuntime:
    """The static cache (``StaticTorchRuntime``) or the growing one (``TorchRuntime``), on ``DEV``."""
    rt = StaticTorchRuntime(model) if cache == "static" else TorchRuntime(model, matmul="native")
    rt.device = DEV
    return rt


def syncs_per_round(model, heads, kind: str, cell: str, grammar=None, cache: str = "static"
                    ) -> tuple[list[int], list[str], dict[int, list[int]]]:
    """Host syncs of each round of ``cell`` decoded with ``kind`` on ``cache`` (the last entry: the
    call that finds every row finished), where the rounds' syncs happened, and each row's tokens;
    ``grammar()``: a ``RowGrammar`` for each row."""
    rows, top = CELLS[cell]
    policy = DraftPolicy.of(FixedLength(3))
    outs: dict[int, list[int]] = {}
    with HostSyncs(DEV) as syncs:
        for t in (*model.parameters(), *model.buffers()):
            syncs.mark(t)  # the weights live on the device too
        rt = _runtime(model, cache)
        batch = Batch(rt, every_proposer(kind, rt, heads, draft=lambda: _runtime(model, cache)), ExactVerifier())
        batch.top_logprobs = top
        emitted = batch.add([RowRequest(i, list(p), N, sampling=s, seed=seed, logprobs=lp,
                                        processors=procs[0] if procs else (), grammar=grammar() if grammar else None)
                             for i, (p, s, seed, lp, *procs) in enumerate(rows)])
        start, per_round = len(syncs.where), []
        while len(batch):
            before = syncs.count
            record = run_round(batch, policy)
            per_round.append(syncs.count - before)
            # the counter sees the round's logits as device data (else every read would be free)
            assert record is None or syncs._on_dev(record.target_logits), "device tensors are not marked"
            emitted += record.emissions if record is not None else []
        for em in emitted:
            outs.setdefault(em.key, []).extend(em.tokens)
        return per_round, syncs.where[start:], outs


@pytest.mark.parametrize("cache", ["static", "growing"])
@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("kind", EVERY_PROPOSER)
def test_at_most_one_host_sync_per_round(target, kind, cell, cache):
    """On the growing cache too: per-row trees drafted on the device (EAGLE, parallel) go into its
    mask where they are, not read back; greedy rows' tokens are plain greedy decoding's."""
    per_round, where, outs = syncs_per_round(*target, kind, cell, cache=cache)
    assert len(per_round) > 1 and max(per_round) <= 1, \
        f"{kind}/{cell}/{cache}: syncs per round {per_round}, where: {where}"
    rows, _ = CELLS[cell]
    if all(s is None for _, s, *_ in rows):
        assert outs == {i: plain_greedy(target[0], p, N) for i, (p, *_) in enumerate(rows)}


# proposers whose drafts start on the host: a grammar's masks are built where their tokens are
HOST_DRAFTED = ("ngram", "suffix")


@pytest.mark.parametrize("kind", EVERY_PROPOSER)
def test_grammar_rows_keep_one_sync_for_host_drafts_and_two_for_device_trees(target, kind):
    """Rows under a grammar: host-drafted rounds keep their one read (the masks go up with the
    draft); a draft built on the device is read once more for its tokens (the grammar runs on the
    CPU): at most 2 (docs/structured-outputs.md)."""
    from grammar_helpers import REGEX, tiny_tokenizer

    from spec_plugins.grammar import GrammarSpec, RowGrammar, compile_grammar, ll_tokenizer

    compiled = compile_grammar(GrammarSpec.regex(REGEX), ll_tokenizer(tiny_tokenizer(), 32, [0]))
    per_round, where, _ = syncs_per_round(*target, kind, "holes-greedy", lambda: RowGrammar(compiled, [0], 32))
    limit = 1 if kind in HOST_DRAFTED else 2
    assert len(per_round) > 1 and max(per_round) <= limit, f"{kind}: syncs per round {per_round}, where: {where}"
