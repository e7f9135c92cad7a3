"""EAGLE / parallel drafters: the catch-up runs rows in groups by backlog, so a long joining prompt
never pads the running rows to its length (same drafts, greedy output unchanged); a head's
config.json is checked when it loads, every refusal naming the head directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from helpers import plain_greedy, save_random_heads
from spec_plugins.backends.torch_runtime import TorchRuntime
from test_batch import drive
from test_heads import eagle
from test_parallel import drafter

from spec_plugins.heads import EagleConfig
from spec_plugins.heads.parallel import ParallelConfig
from spec_plugins.loop import Batch
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.eagle import EagleProposer
from spec_plugins.proposers.parallel import ParallelProposer
from spec_plugins.types import ProposeContext, RowRequest
from spec_plugins.verifiers import ExactVerifier

RUNNING = [[3, 7, 1], [5, 5, 2, 9, 4, 4], [8, 1, 6, 2, 7], [2, 2, 2, 2, 2, 2, 2, 9]]
COMMITTED = [[4], [6, 1], [9, 9, 3], [1, 2, 3, 4]]  # tokens each running row committed since its first draft
LONG = 300  # a joining prompt far longer than the running rows' backlogs (1..4 pairs)


def make(kind: str, model) -> EagleProposer:
    """A tree proposer over a random drafter of ``kind`` (EAGLE-3 or parallel with context)."""
    if kind == "eagle":
        return EagleProposer(EagleProposer.Config(heads="unused", tree_nodes=6, top_k=2), drafter=eagle(model, layers=(1, 2)))
    return ParallelProposer(ParallelProposer.Config(heads="unused", tree_nodes=6, top_k=2),
                            drafter=drafter(model, block_layers=1, context=True))


def features(row: int, n: int) -> torch.Tensor:
    """Row ``row``'s target features (random, fixed per row: the same alone or in a batch)."""
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(100 + row))  # 2 fused layers x hidden 32


def joiner(length: int) -> list[int]:
    return [(7 * i + 3) % 32 for i in range(length)]


def two_rounds(prop: EagleProposer, rows: list[int], join: int | None) -> list[list[tuple]]:
    """Round 1 drafts the running ``rows``; each then commits its COMMITTED tokens and a prompt of
    ``join`` tokens joins (None: none); returns round 2's drafts per row (tokens, estimates)."""
    seqs = [list(RUNNING[r]) for r in rows]
    ids = list(rows)
    if seqs:
        prop.admit([s[:-1] for s in seqs])
        prop.propose(ProposeContext(seqs, [3] * len(seqs), None, tree_ok=True,
                                    hidden=[features(r, len(s))[: len(s) - 1] for r, s in zip(rows, seqs)]))
    hid = []
    for r, s in zip(rows, seqs):
        s += COMMITTED[r]
        hid.append(features(r, len(s))[len(s) - 1 - len(COMMITTED[r]): len(s) - 1])
    if join is not None:
        prop.admit([joiner(join)[:-1]])
        seqs.append(joiner(join))
        hid.append(features(99, join)[: join - 1])
        ids.append(99)
    ranked = prop.propose(ProposeContext(seqs, [3] * len(seqs), None, tree_ok=True, hidden=hid))
    return [[(list(c.tokens), list(c.estimates)) for c in alts] for alts in ranked.rows]


def assert_same_drafts(got: list[list[tuple]], want: list[list[tuple]], exact: bool) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        for (_, eg), (_, ew) in zip(g, w):
            if exact:
                assert eg == ew
            else:
                torch.testing.assert_close(torch.tensor(eg), torch.tensor(ew), rtol=1e-5, atol=1e-6)


def spy_layer(prop: EagleProposer) -> list[tuple[int, int]]:
    """Record (rows, queries) of every call of the drafter layer (catch-up and draft steps)."""
    calls: list[tuple[int, int]] = []
    layer = prop.layer

    def spy(feat, tok, *rest):
        calls.append(tuple(tok.shape))
        return layer(feat, tok, *rest)

    prop.layer = spy
    return calls


def test_backlog_groups_keep_a_long_backlog_apart():
    from spec_plugins.proposers.eagle import backlog_groups

    assert backlog_groups([1, 2, 4, 3]) == [([0, 1, 2, 3], 4)]  # running rows: one forward, as before
    assert backlog_groups([1, 2, 4000, 3, 0]) == [([2], 4000), ([0, 1, 3, 4], 3)]
    assert backlog_groups([4000, 3990, 1]) == [([0, 1], 4000), ([2], 1)]
    assert backlog_groups([1, 200, 1], forward_cost=10 ** 9) == [([0, 1, 2], 200)]
    assert backlog_groups([0, 0]) == [([0, 1], 1)]
    steady = [1 + r % 7 for r in range(128)]  # running rows at a server's batch sizes: backlogs 1..7
    for rows in (8, 32, 64, 128):
        assert len(backlog_groups(steady[:rows])) == 1, rows
    assert len(backlog_groups([7] * 64 + [1] * 64)) == 1


@pytest.mark.parametrize("kind", ["eagle", "parallel"])
def test_long_joiner_never_widens_the_running_rows_forward(kind):
    """(b) The running rows catch up over their own backlog's width; only the joiner's forward is
    as wide as its prompt (the one-forward catch-up ran every row over LONG - 1 queries)."""
    prop = make(kind, tiny_llama(seed=3, sharpness=2.0))
    calls = spy_layer(prop)
    two_rounds(prop, [0, 1, 2, 3], LONG)
    wide = [c for c in calls if c[1] >= LONG - 1]
    assert wide == [(1, LONG - 1)], calls
    assert (4, max(map(len, COMMITTED))) in calls


@pytest.mark.parametrize("kind", ["eagle", "parallel"])
def test_grouped_catch_up_drafts_as_one_forward_and_as_each_row_alone(kind):
    """(a) Without a long joiner the catch-up is one forward (the same drafts as with grouping
    off); with one, each row drafts what it drafts alone (tokens equal; scores to float rounding:
    alone a row's cache has no hole slots, so attention sums over other lengths), and what the
    one-forward catch-up drafts."""
    model = tiny_llama(seed=3, sharpness=2.0)
    one = make(kind, model)
    one.catch_up_forward_cost = 10 ** 9  # a single forward over every row: the one-forward catch-up
    assert_same_drafts(two_rounds(make(kind, model), [0, 1, 2, 3], 9), two_rounds(one, [0, 1, 2, 3], 9), exact=True)

    batch = two_rounds(make(kind, model), [0, 1, 2, 3], LONG)
    alone = [two_rounds(make(kind, model), [r], None)[0] for r in range(4)] + [two_rounds(make(kind, model), [], LONG)[0]]
    assert_same_drafts(batch, alone, exact=False)
    one = make(kind, model)
    one.catch_up_forward_cost = 10 ** 9
    assert_same_drafts(batch, two_rounds(one, [0, 1, 2, 3], LONG), exact=False)


@pytest.mark.parametrize("kind", ["eagle", "parallel"])
def test_rows_a_long_prompt_joins_decode_as_plain_greedy(tmp_path, kind):
    """(c) Greedy identity for running rows that a long prompt joins mid-decode (grouped catch-ups)."""
    model = tiny_llama(seed=3, sharpness=2.0, max_pos=512)  # room for the LONG joiner
    heads = save_random_heads(model, tmp_path)
    target = TorchRuntime(model)
    cls = EagleProposer if kind == "eagle" else ParallelProposer
    prop = cls(cls.Config(heads=str(heads[kind]), tree_nodes=6, top_k=2), target=target)
    calls = spy_layer(prop)
    prompts, limits = RUNNING[:3] + [joiner(LONG)], [14, 10, 12, 8]
    reqs = [RowRequest(i, p, n) for i, (p, n) in enumerate(zip(prompts, limits))]
    outs = drive(Batch(target, prop, ExactVerifier()), FixedLength(3), {0: reqs[:3], 2: [reqs[3]]})
    for i, (p, n) in enumerate(zip(prompts, limits)):
        assert outs[i] == plain_greedy(model, p, n), i
    wide = [c for c in calls if c[1] >= LONG - 1]
    assert wide and all(rows == 1 for rows, _ in wide), calls  # the joiner caught up on its own


def build_from(tmp_path: Path, kind: str, field: str, value) -> None:
    """Load a random ``kind`` head whose config.json sets ``field`` to ``value``."""
    heads = save_random_heads(tiny_llama(seed=3), tmp_path / "heads")
    bad = tmp_path / field
    shutil.copytree(heads[kind], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, field: value}))
    cls = EagleProposer if kind == "eagle" else ParallelProposer
    cls(cls.Config(heads=str(bad), tree_nodes=6, top_k=2), target=TorchRuntime(tiny_llama(seed=3)))


@pytest.mark.parametrize("kind", ["eagle", "parallel"])
@pytest.mark.parametrize("field,value", [
    ("rope_theta", "1e4"), ("rope_theta", 0), ("rms_norm_eps", -1.0), ("rms_norm_eps", None),
    ("num_heads", 0), ("num_heads", 3), ("num_kv_heads", 3), ("num_heads", 10), ("hidden_size", "32"),
    ("intermediate_size", 1.5), ("draft_vocab_size", True), ("feature_layers", [1, 0])])
def test_bad_head_config_refused_at_load_naming_directory_and_field(tmp_path, kind, field, value):
    """A value the layer cannot run is refused when the head loads, in one line naming the head's
    directory and the field (hidden 32 over 2 kv heads: num_heads 3 or num_kv_heads 3 leave query
    heads outside whole groups; num_heads 10 makes 3-wide heads, which rotary cannot halve)."""
    with pytest.raises(ValueError) as err:
        build_from(tmp_path, kind, field, value)
    msg = str(err.value)
    assert str(tmp_path / field) in msg and field in msg.split("(", 1)[1], msg


def test_config_checks_keep_valid_values_and_normalise_numbers():
    import numpy as np

    cfg = EagleConfig(np.int64(32), num_heads=4, num_kv_heads=2, rope_theta=10000, feature_layers=[np.int64(2)])
    assert (cfg.hidden_size, cfg.rope_theta, cfg.feature_layers) == (32, 10000.0, (2,))
    assert type(cfg.hidden_size) is int and type(cfg.rope_theta) is float
    with pytest.raises(ValueError, match="rms_norm_eps must be a positive finite number, got nan"):
        EagleConfig(32, num_heads=4, num_kv_heads=2, rms_norm_eps=float("nan"))
    with pytest.raises(ValueError, match="num_heads"):
        ParallelConfig(32, num_heads=0)


def test_shipped_heads_still_load():
    """The example heads' configs pass the checks (their shapes, as loaded by the drafters)."""
    root = Path(__file__).resolve().parents[1] / "examples" / "heads"
    configs = [p for p in root.glob("*/*/config.json") if json.loads(p.read_text()).get("kind") in ("eagle", "parallel")]
    assert configs
    for path in configs:
        cfg = json.loads(path.read_text())
        cls = EagleConfig if cfg["kind"] == "eagle" else ParallelConfig
        names = cls.__dataclass_fields__
        built = cls(**{k: v for k, v in cfg.items() if k in names})
        built.check_shape()  # what the drafter checks when it builds the layer
        assert built.hidden_size == cfg["hidden_size"]


@pytest.mark.parametrize("field,value", [
    ("block_size", "6"), ("block_size", 2.5), ("block_layers", "1"), ("block_layers", True), ("mask_token", 1.5),
    ("anchor_input", "false"), ("block_context", "no")])
def test_bad_parallel_fields_refused_at_load_naming_directory_and_field(tmp_path, field, value):
    """The parallel drafter's own fields: a string "false" was truthy (the head drafted with an
    anchor input it was not trained with), a float block size failed deep in torch."""
    with pytest.raises(ValueError) as err:
        build_from(tmp_path, "parallel", field, value)
    msg = str(err.value)
    assert str(tmp_path / field) in msg and field in msg.split("(", 1)[1], msg


@pytest.mark.parametrize("field,value", [("num_heads", "2"), ("hidden_size", 0), ("num_layers", -1),
                                         ("draft_vocab_size", 1.5)])
def test_bad_medusa_config_refused_naming_the_field(field, value):
    from spec_plugins.heads.medusa import MedusaConfig

    with pytest.raises(ValueError, match=f"{field} must be"):
        MedusaConfig(**{"hidden_size": 32, field: value})
    assert MedusaConfig(32, num_layers=0).num_layers == 0  # no residual blocks: the LM head itself
