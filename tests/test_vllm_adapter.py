"""Our proposers as vLLM v1 ``custom_class`` proposers, called exactly as vLLM 0.22-0.33 calls
them (``cls(vllm_config)``, then ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)`` with numpy arrays, drafts returned by row position). When
vLLM is installed the test also reads its source, so the adapter fails loudly if vLLM's call
drifts; the end-to-end engine run is skipped here (no vLLM in this environment) with the reason."""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from spec_plugins.integrations.vllm import ENV, NgramDrafter, SuffixDrafter, register
from spec_plugins.proposers.ngram import NgramProposer

K = 4


def vllm_config(k=K):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k))


def call(drafter, histories, sampled):
    """vLLM's call: a [max_num_reqs, max_model_len] int32 array and per-row lengths."""
    ids = np.zeros((8, 256), dtype=np.int32)
    lens = np.zeros(8, dtype=np.int32)
    for i, h in enumerate(histories):
        ids[i, : len(h)] = h
        lens[i] = len(h)
    return drafter.propose(sampled, lens, ids, slot_mappings=None)


def ours(seq):
    """What our own ngram proposer drafts for this sequence."""
    ref = NgramProposer(NgramProposer.Config(max_ngram=3))
    ref.admit([seq])
    return ref.free_drafts([seq], K)[0]


def test_ngram_drafter_drafts_what_our_ngram_drafts_as_rows_move():
    d = NgramDrafter(vllm_config(), {"type": "ngram", "max_ngram": 3})
    a = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    b = [7, 8, 9, 7, 8, 9, 7]
    assert call(d, [a, b], [[2], [7]]) == [ours(a), ours(b)]
    a2, b2 = a + [3, 4], b + [8]
    # b moved to position 0 (a row before it left), a is at 1, a prefill row at 2
    got = call(d, [b2, a2, [5, 5, 5]], [[8], [3, 4], []])
    assert got == [ours(b2), ours(a2), []]
    assert d.rows.held[0].length == len(b2)  # b's index was extended, not rebuilt


def test_suffix_drafter_learns_finished_requests_in_global_scope():
    sec = {"type": "suffix", "scope": "global", "min_token_prob": 0.0, "max_spec_factor": 4}
    d = SuffixDrafter(vllm_config(), sec)
    first = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    call(d, [first], [[7]])
    call(d, [], [])  # the request finished: it leaves the batch
    assert d.index.stats.requests == 1
    again = first[:6]  # a new request repeating the first one's text
    assert call(d, [again], [[9]]) == [first[6: 6 + K]]
    own = SuffixDrafter(vllm_config(), {**sec, "scope": "request"})
    call(own, [first], [[7]])
    call(own, [], [])
    assert call(own, [again], [[9]]) == [[]] and own.index.stats.requests == 0


def test_settings_come_from_our_yaml(monkeypatch, tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("proposer: {type: ngram, max_ngram: 2, min_ngram: 2}\n")
    monkeypatch.setenv(ENV, str(f))
    d = NgramDrafter(vllm_config(3))
    assert d.config.max_ngram == 2 and d.k == 3
    monkeypatch.setenv(ENV, "{type: suffix}")
    with pytest.raises(ValueError, match="must hold a `ngram` proposer section"):
        NgramDrafter(vllm_config())
    register()
    register()  # re-entrant, as vLLM requires of general plugins


def test_entry_point_is_declared():
    import tomllib
    from pathlib import Path

    proj = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    eps = proj["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"spec_plugins": "spec_plugins.integrations.vllm:register"}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed here (CPU wheels need their own torch); the adapter is checked "
                           "against vLLM's documented call above")
def test_installed_vllm_calls_the_adapter_as_we_assume():
    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    src = inspect.getsource(runner)
    assert 'method == "custom_class"' in src
    assert "self.input_batch.num_tokens_no_spec" in src and "self.input_batch.token_ids_cpu" in src
    factory = importlib.import_module("vllm.v1.spec_decode.custom_class_proposer")
    assert "user_class(vllm_config)" in inspect.getsource(factory)


def test_ngram_drafter_keeps_each_requests_index_over_steps_short_and_long():
    """Over steps where rows grow, move, join from prefill and leave, each row drafts what our
    ngram proposer drafts on its whole history, and each request keeps its one index (a history
    shorter than the key tokens included: it is extended, not rebuilt and reported finished)."""
    d = NgramDrafter(vllm_config(), {"type": "ngram", "max_ngram": 3})
    seqs = {"long": [1, 2, 3, 4, 5] * 9, "short": [7, 8, 9, 7, 8, 9, 7], "late": [4, 4, 6, 4, 4]}
    steps = [  # (request per row, tokens each row accepted this step; "late" is in prefill at first)
        (["long", "short", "late"], {"long": [1], "short": [8], "late": []}),
        (["long", "short", "late"], {"long": [2, 3], "short": [9], "late": [6]}),
        (["late", "long", "short"], {"late": [4, 4], "long": [4], "short": [7, 8]}),
        (["short", "late"], {"short": [9], "late": [6, 4]}),
    ]
    index_of = {}
    for rows, sampled in steps:
        for name in rows:
            seqs[name] = seqs[name] + sampled[name]
        got = call(d, [seqs[n] for n in rows], [sampled[n] for n in rows])
        assert got == [ours(seqs[n]) if sampled[n] else [] for n in rows]
        live = [n for n in rows if sampled[n]]
        for name, idx in zip(live, d.rows.held):
            assert index_of.setdefault(name, idx) is idx, name
            assert idx.tokens == seqs[name]


class CountingTokens:
    """vLLM's ``token_ids_cpu`` array, counting the history tokens the adapter reads from it."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids, self.read = ids, 0

    def __getitem__(self, key):
        return _CountedRow(self, self.ids[key])


class _CountedRow:
    def __init__(self, owner: CountingTokens, row: np.ndarray) -> None:
        self.owner, self.row = owner, row

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, key):
        part = self.row[key]
        self.owner.read += int(np.size(part))
        return part

    def __iter__(self):
        self.owner.read += len(self.row)
        return iter(self.row)


def test_a_step_reads_the_new_tokens_of_each_history_not_the_whole_history():
    from spec_plugins.integrations.vllm import KEY_TOKENS, SPREAD

    rng = np.random.default_rng(0)
    rows, context = 3, 2000
    ids = rng.integers(0, 50, size=(rows, context + 16), dtype=np.int32)
    lens = np.full(rows, context, dtype=np.int32)
    tokens = CountingTokens(ids)
    d = NgramDrafter(vllm_config(), {"type": "ngram", "max_ngram": 3})
    d.propose([[1]] * rows, lens, tokens)  # the first step reads every history once
    for new in (1, 2, 1):
        lens += new
        tokens.read = 0
        drafts = d.propose([[1] * new] * rows, lens, tokens)
        assert drafts == [ours(ids[i, : lens[i]].tolist()) for i in range(rows)]
        # per row: the new tokens, and the key and spread tokens of the indexes it is compared with
        assert tokens.read <= rows * (new + 2 * (KEY_TOKENS + SPREAD) * rows), tokens.read


def test_suffix_drafter_keeps_the_node_cap_of_its_config():
    """``global_max_nodes`` bounds vLLM's global index as it bounds ours: a request whose trie is
    over the cap alone is evicted at once, not kept."""
    sec = {"type": "suffix", "scope": "global", "min_token_prob": 0.0, "max_spec_factor": 4, "global_max_nodes": 5}
    d = SuffixDrafter(vllm_config(), sec)
    assert d.index.max_nodes == 5
    call(d, [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]], [[7]])
    call(d, [], [])
    assert d.index.stats.requests == 0 and d.index.stats.tokens == 0


@pytest.mark.parametrize("drafter, section, named", [
    (SuffixDrafter, {"type": "suffix", "scope": "tenant", "max_tenants": 3}, "scope: 'tenant' (vLLM's call carries no tenant"),
    (SuffixDrafter, {"type": "suffix", "num_draft_tokens": 8}, "num_draft_tokens: 8 (vLLM drafts num_speculative_tokens (4)"),
    (SuffixDrafter, {"type": "suffix", "tree_nodes": 64}, "tree_nodes: 64 (vLLM verifies one chain per row"),
    (NgramDrafter, {"type": "ngram", "num_draft_tokens": 2}, "num_draft_tokens: 2 (vLLM drafts num_speculative_tokens (4)"),
])
def test_section_fields_vllm_decides_itself_are_refused_by_name(drafter, section, named):
    """``scope: tenant`` kept no cross-request memory under vLLM (its call carries no tenant) and
    ``num_draft_tokens`` / ``tree_nodes`` were silently unused (vLLM drafts its own
    ``num_speculative_tokens`` as one chain): each is refused, naming the field and what vLLM does."""
    with pytest.raises(ValueError) as err:
        drafter(vllm_config(), section)
    assert named in str(err.value)


def test_section_fields_that_agree_with_vllm_are_kept():
    """Defaults (a dumped config carries every field) and a draft length equal to vLLM's pass."""
    assert NgramDrafter(vllm_config(), {"type": "ngram", "num_draft_tokens": K}).k == K
    d = SuffixDrafter(vllm_config(), {"type": "suffix", "num_draft_tokens": K, "tree_nodes": "auto", "scope": "global"})
    assert d.k == K and d.config.scope == "global"
    assert SuffixDrafter(vllm_config(), {"type": "suffix", "num_draft_tokens": 16}).k == K  # its default
