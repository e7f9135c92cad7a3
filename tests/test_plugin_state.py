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


def test_each_proposer_sizes_trees_with_its_own_calibrations():
    """The model keeps one cost curve for every proposer, but a tree sizer per wiring: a sizer's
    calibrations are per source index, and source 0 of a suffix section is another drafter than
    source 0 of a recycling one. (Before: one sizer per model, so what suffix learnt scaled
    recycling's estimates in the next call.) A section's and a proposer's sizer carry across calls."""
    model, draft, other = tiny_llama(seed=3, sharpness=4.0), tiny_llama(seed=4), tiny_llama(seed=5)
    inputs = {"input_ids": torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]])}

    def generate(section, n=8, **extra):
        return model.generate(**inputs, max_new_tokens=n, do_sample=False, custom_generate=speculative_generate,
                              spec_config={"proposer": section}, **extra)

    suffix = {"type": "suffix", "num_draft_tokens": 8, "tree_nodes": "auto", "scope": "request"}
    generate(suffix)
    setup = model.__dict__["_spec_plugins"]
    (first,) = setup.wirings.values()
    learnt = first.sizer.calibration(0)
    learnt.observe(0.0, 50.0)  # suffix over-predicted: its scale is at the floor
    floor = (learnt.accepted, learnt.predicted)
    generate({"type": "recycling", "num_draft_tokens": 6, "tree_size": "auto"}, n=1)  # wired, no round sized
    second = list(setup.wirings.values())[-1]
    assert second.section.type == "recycling" and second.sizer is not first.sizer
    assert second.sizer.calibration(0).scale == 1.0  # recycling's estimates start calibrated
    assert (learnt.accepted, learnt.predicted) == floor
    generate(suffix, n=1)
    assert list(setup.wirings.values())[-1] is first  # the section's wiring, its sizer with it, reused
    for d in (draft, draft, other):  # a draft model's proposer keeps its own sizer across calls
        generate({"type": "draft_model", "num_draft_tokens": 3, "model": {"backend": "torch", "model": "<given>"}},
                 n=4, draft_model=d)
    assert len(setup.sizers) == 2 and all(s is not first.sizer for s in setup.sizers.values())
    # the kept state does not stop the model from pickling (torch.save) or copying, and a copy
    # decodes as the model does: it starts without the kept state and builds its own
    import copy
    import pickle

    want = generate(suffix).tolist()
    for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert again.__dict__.get("_spec_plugins") is None
        out = again.generate(**inputs, max_new_tokens=8, do_sample=False, custom_generate=speculative_generate,
                             spec_config={"proposer": suffix})
        assert out.tolist() == want and again.__dict__["_spec_plugins"].runtime.model is again
