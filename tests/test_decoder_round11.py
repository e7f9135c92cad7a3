"""``generate_batch``: a ``seeds`` entry of None says nothing about its row, so the row keeps the
seed its ``sampling`` entry sets; the row then samples exactly as ``generate(seed=...)`` does."""

from __future__ import annotations

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.verifiers import ExactVerifier


def test_a_none_seeds_entry_keeps_the_rows_own_sampling_seed():
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(vocab=64, seed=0)),
                             NgramProposer(NgramProposer.Config(num_draft_tokens=3)), ExactVerifier())
    prompt = [5, 6, 5, 6]
    ref = {s: dec.generate(prompt, max_new_tokens=12, temperature=1.0, seed=s).token_ids for s in (7, 8)}
    assert ref[7] != ref[8]  # the seeds tell the rows apart: the check below can fail
    own = [{"temperature": 1.0, "seed": 7}, {"temperature": 1.0, "seed": 8}]
    for seeds in (None, [None, None], [None, 8], [7, None]):
        out = dec.generate_batch([prompt, prompt], max_new_tokens=12, sampling=own, seeds=seeds)
        assert [r.token_ids for r in out] == [ref[7], ref[8]], seeds
    out = dec.generate_batch([prompt, prompt], max_new_tokens=12, sampling=own, seeds=[8, None])
    assert [r.token_ids for r in out] == [ref[8], ref[8]]  # a given entry wins over the row's own
