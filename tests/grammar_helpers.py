"""A 32-token byte-level tokenizer for tiny models, and an independent grammar reference.

``NaiveGrammar`` is what the tests compare the engine's grammar masks with: a transformers
``LogitsProcessor`` that builds a fresh llguidance matcher for every row of every call and feeds
it the row's whole completion, so it shares nothing with ``spec_plugins.grammar`` (no rollback,
no tree walk, no caching)."""

from __future__ import annotations

import numpy as np
import torch

EOS = 0
CHARS = ['{', '}', '"', ':', ',', 'Ġ', 'a', 'b', 'c', 'x', 'y', '1', '2', '3', '[', ']']  # ids 1..16
MERGES = [('{', '"'), ('"', ':'), ('"', ','), ('"', '}'), ('a', 'b'), ('ab', 'c'), ('x', 'y'), ('Ġ', '"'),
          ('1', '2'), ('c', 'a'), ('b', 'a'), ('a', 'c'), ('b', 'y'), ('y', 'x'), ('12', '3')]  # ids 17..31
VOCAB = 1 + len(CHARS) + len(MERGES)  # 32, tiny_llama's default

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["abc", "xy"]}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
REGEX = r"(ab|c|xy)+(12|3)"


def tiny_tokenizer(extra: str = ""):
    """A fast Hugging Face tokenizer over ``VOCAB`` byte-level tokens (``<eos>`` = 0), and one
    token for each character of ``extra`` after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS}
    for c in CHARS:
        vocab[c] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    assert len(vocab) == VOCAB
    for c in extra:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


class NaiveGrammar:
    """transformers ``LogitsProcessor``: tokens the grammar does not allow after the row's
    completion (``input_ids[r, start:]``) go to -inf; ``rows``: the rows it constrains (all)."""

    def __init__(self, lltok, grammar: str, start: int, rows=None) -> None:
        self.tok, self.grammar, self.start, self.rows = lltok, grammar, start, rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import llguidance

        out = scores.clone()
        for r, row in enumerate(input_ids.tolist()):
            if self.rows is not None and r not in self.rows:
                continue
            done = row[self.start:]
            if EOS in done:
                continue  # a finished row (transformers pads it with EOS)
            m = llguidance.LLMatcher(self.tok, self.grammar, log_level=0)
            assert m.consume_tokens(done), m.get_error()
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[: scores.shape[-1]].astype(bool))
            out[r, ~allowed.to(scores.device)] = float("-inf")
        return out
