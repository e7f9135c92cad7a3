"""What the transformers plugin keeps on a model across ``generate()`` calls: bounded, however many
proposer settings the calls sweep."""

from __future__ import annotations

import gc

import torch
from test_transformers_integration import PROMPTS

from conftest import tiny_llama
from spec_plugins.integrations import plugin_state
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.proposers.draft_model import DraftModelProposer


def test_calls_sweeping_proposer_settings_keep_the_most_recent_few():
    """Each distinct proposer section was wired once and kept for the model's life: a sweep over
    draft lengths kept a proposer per value (an EAGLE head's weights, a draft model's runtime and
    its KV cache each time). The ``KEPT`` most recent stay; output is plain greedy throughout."""
    model, draft = tiny_llama(seed=3), tiny_llama(seed=4)
    inputs = {"input_ids": torch.tensor([PROMPTS[0]])}
    plain = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    sweep = range(1, plugin_state.KEPT + 5)
    for k in sweep:
        for extra in ({}, {"draft_model": draft}):
            kind = "draft_model" if extra else "ngram"
            section = {"type": kind, "num_draft_tokens": k}
            if extra:
                section["model"] = {"backend": "torch", "model": "<given>"}
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False, custom_generate=speculative_generate,
                                 spec_config={"proposer": section}, **extra)
            assert torch.equal(out, plain), (kind, k)
    setup = model.__dict__["_spec_plugins"]
    assert len(setup.wirings) == plugin_state.KEPT
    kept = draft.__dict__["_spec_plugins_drafts"][setup.runtime]
    assert len(kept) == plugin_state.KEPT
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, DraftModelProposer)]
    assert len(alive) == plugin_state.KEPT
    recent = next(reversed(setup.wirings))  # the last section used is reused, not rebuilt
    before = setup.wirings[recent]
    model.generate(**inputs, max_new_tokens=6, do_sample=False, custom_generate=speculative_generate,
                   spec_config={"proposer": {"type": "ngram", "num_draft_tokens": sweep[-1]}})
    assert setup.wirings[recent] is before
