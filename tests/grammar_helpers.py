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
            bits = np.pad(bits, (0, max(0, scores.shape[-1] - bits.shape[0])))  # padded logits: never allowed
            allowed = torch.from_numpy(bits[: scores.shape[-1]].astype(bool))
            out[r, ~allowed.to(scores.device)] = float("-inf")
        return out


ENDLESS = 'start: "x" ("b" "c" | "a" r)\nr: "a" r'  # after "xa", "a" is forced without end: llguidance cannot
# consume it at a state whose mask it computed (its item limit), only where it computed none
X, A, B, C = 10, 7, 8, 9  # token ids of "x", "a", "b", "c"


class Padded:
    """transformers ``LogitsProcessor``: ``bonus`` added to the logits past the first ``width``
    columns (a padded vocabulary's columns, made the argmax unless a processor masks them)."""

    def __init__(self, width: int, bonus: float = 50.0) -> None:
        self.width, self.bonus = width, bonus

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        out[:, self.width:] += self.bonus
        return out


def scripted(tokens, tree: bool = False, sibling: int = B):
    """A proposer that drafts ``tokens`` (cut to the round's budget) for every row, every round:
    a chain, or (``tree``) a tree with ``sibling`` beside each of them, the chain going on under
    the scripted token."""
    from spec_plugins.proposers.base import Proposer
    from spec_plugins.types import Draft

    drafts_trees = tree

    class Scripted(Proposer):
        Config = dict
        tree = drafts_trees

        def __init__(self) -> None:
            self.config = {}

        def propose(self, ctx):
            k = min(max(ctx.budgets), len(tokens))
            if k == 0:
                return None
            if not tree:
                return Draft.from_chains([list(tokens[:k])] * len(ctx.sequences))
            toks, parents, last = [], [], -1
            for t in tokens[:k]:
                toks += [sibling, t]
                parents += [last, last]
                last = len(parents) - 1
            return Draft(torch.tensor([toks] * len(ctx.sequences)), tuple(parents))

    return Scripted()
