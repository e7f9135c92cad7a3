"""Round 11 of the tree drafters: depth limits refused at config time, measurement kept out of
suffix decoding's traffic counters, and the tree API the docs name."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from conftest import tiny_llama
from helpers import plain_greedy
from spec_plugins.backends.torch_runtime import TorchRuntime

from spec_plugins.config import SamplingConfig, SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.policy.cost import measure_draft
from spec_plugins.proposers.lookahead import LookaheadProposer
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.sampling import LogitsPipeline

GREEDY = LogitsPipeline(SamplingConfig(temperature=0.0))
DOCS = Path(__file__).resolve().parents[1] / "docs" / "proposers.md"


def _decoder(model, proposer: dict) -> SpeculativeDecoder:
    cfg = {"target": {"backend": "torch", "model": "x"}, "proposer": proposer, "sampling": {"temperature": 0.0}}
    return SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model))


def _chain(depth: int) -> list[list[int]]:
    return [[0] * d for d in range(1, depth + 1)]


# ---- 1. recycling paths deeper than the depth limit ------------------------------------------------------
def test_recycling_refuses_paths_deeper_than_num_draft_tokens():
    """Nodes below the depth limit were verified every forward and never accepted."""
    with pytest.raises(ValueError, match=r"paths are 10 deep but num_draft_tokens=3"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x"},
                          "proposer": {"type": "recycling", "paths": _chain(10), "num_draft_tokens": 3}})
    with pytest.raises(ValueError, match=r"paths are 7 deep but num_draft_tokens=6"):
        RecyclingProposer.Config(paths=_chain(7))  # the default depth limit is a limit too
    for k in (3, 4, "auto", 0):  # at or above the limit; 'auto' and 0 set no fixed one
        RecyclingProposer.Config(paths=_chain(3), num_draft_tokens=k)


def test_recycling_paths_at_the_depth_limit_draft_whole_and_stay_greedy():
    model = tiny_llama(seed=3, sharpness=4.0, vocab=16)
    dec = _decoder(model, {"type": "recycling", "paths": _chain(3), "num_draft_tokens": 3})
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert dec.generate(prompt, max_new_tokens=20).token_ids == plain_greedy(model, prompt, 20)
    assert dec.proposer.shape.size == 3


# ---- 2. measuring the drafting cost is no traffic ----------------------------------------------------------
def test_suffix_lookups_count_requests_only():
    """Building the decoder times ``propose`` (``measure_draft``): those calls counted as global
    index lookups on /metrics before any request came. Now the counters hold one lookup per
    row and round that drafts, counted here at the proposer's entry."""
    model = tiny_llama(seed=3, sharpness=4.0, vocab=16)
    dec = _decoder(model, {"type": "suffix", "scope": "global"})
    prop, stats = dec.proposer, dec.proposer.index.stats
    assert (stats.lookups, stats.hits) == (0, 0)
    drafting_rows, inner = [], prop.propose
    prop.propose = lambda ctx: drafting_rows.append(sum(b > 0 for b in ctx.budgets)) or inner(ctx)
    dec.generate([1, 2, 3, 1, 2, 3], max_new_tokens=8)
    dec.generate([1, 2, 3, 1, 2, 3], max_new_tokens=8)  # the first is in the index now: hits
    assert stats.lookups == sum(drafting_rows) > 0
    assert stats.hits > 0
    metrics = {name: value for name, _, _, value in prop.metrics()}
    assert metrics["spec_suffix_index_lookups_total"] == stats.lookups
    assert not prop.measuring


def test_measuring_reaches_a_compositions_children_and_is_restored():
    model = tiny_llama(seed=3, sharpness=4.0, vocab=16)
    dec = _decoder(model, {"type": "hybrid", "proposers": [{"type": "suffix", "scope": "global"},
                                                           {"type": "recycling", "tree_size": "auto"}]})
    child = dec.proposer.children[0]
    dec.generate([1, 2, 3, 1, 2, 3], max_new_tokens=8)
    before = (child.index.stats.lookups, child.index.stats.hits)
    measure_draft(dec.proposer, GREEDY, dec.target, context=32)  # the hybrid, its children drafting inside
    assert (child.index.stats.lookups, child.index.stats.hits) == before
    assert child.measuring is False


# ---- 3. a lookahead window deeper than the depth limit --------------------------------------------------------
def test_lookahead_refuses_a_window_deeper_than_num_draft_tokens():
    """Guesses past the depth limit were drawn every round and thrown away."""
    with pytest.raises(ValueError, match=r"window=16 is deeper than num_draft_tokens=8"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x"},
                          "proposer": {"type": "lookahead", "window": 16}})
    with pytest.raises(ValueError, match=r"window=3 is deeper than num_draft_tokens=2"):
        LookaheadProposer.Config(window=3, num_draft_tokens=2)
    for fields in ({"window": 8}, {"window": 16, "num_draft_tokens": "auto"}, {"window": 16, "num_draft_tokens": 0},
                   {"num_draft_tokens": 2}):  # the default window is a cap
        LookaheadProposer.Config(**fields)


def test_a_dumped_lookahead_config_with_a_short_depth_parses_again():
    """Ray Serve replicas parse the dumped config: the default window it carries is still a cap."""
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "x"},
                            "proposer": {"type": "lookahead", "num_draft_tokens": 2}})
    again = SpecConfig.parse(cfg.model_dump(mode="json"))
    assert again.proposer.window == cfg.proposer.window and again.proposer.num_draft_tokens == 2


# ---- 4. the tree API the docs name exists -----------------------------------------------------------------
def _tree_section() -> str:
    """The docs' paragraph on ``spec_plugins/tree.py``: its opening line and bullets."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("`spec_plugins/tree.py` holds"))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return "\n".join(lines[start:end])


def test_every_tree_api_name_the_docs_give_exists():
    """Dotted ``spec_plugins.*`` names import; bare names are attributes of ``spec_plugins.tree``
    or of a module the paragraph names (its file paths)."""
    text = _tree_section()
    modules = [importlib.import_module("spec_plugins.tree"), importlib.import_module("spec_plugins.types")]
    for path in re.findall(r"`(spec_plugins/[\w/]+)\.py`", text):
        assert (DOCS.parents[1] / f"{path}.py").is_file(), path
        modules.append(importlib.import_module(path.replace("/", ".")))
    for dotted in re.findall(r"`(spec_plugins\.[\w.]+)`", text):
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name), dotted
    not_api = {"parents", "valid", "top_k", "size"}  # fields, arguments and config names the prose mentions
    names = set(re.findall(r"`([A-Za-z_]\w*)[`(]", text)) - not_api
    missing = sorted(n for n in names if not any(hasattr(m, n) for m in modules))
    assert not missing, f"docs/proposers.md names {missing}, which no module it points to defines"
    assert {"merge_trees", "best_static_tree", "expand", "select", "RowTrees"} <= names
