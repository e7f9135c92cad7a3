"""Round 12: a proposer instance built without its config section drafts the policy's default
length; it used to decode with no speculation at all, without a word (tests built that way checked
nothing speculative)."""

from __future__ import annotations

from conftest import tiny_llama
from helpers import plain_greedy

from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.policy.draft_policy import DEFAULTS
from spec_plugins.proposers.draft_model import DraftModelProposer


def test_a_proposer_without_a_section_drafts_the_default_length_and_stays_exact():
    target = tiny_llama(seed=1)
    rt = TorchRuntime(target)
    dec = SpeculativeDecoder(rt, DraftModelProposer(None, target=rt, runtime=TorchRuntime(tiny_llama(seed=1))))
    out = dec.generate([1, 2, 3], 12)
    assert out.token_ids == plain_greedy(target, [1, 2, 3], 12)
    s = out.stats
    assert s.draft_tokens > 0 and len(s.drafted_by_position) == DEFAULTS.fixed_k
    assert dec.without_speculation().generate([1, 2, 3], 12).stats.draft_tokens == 0
