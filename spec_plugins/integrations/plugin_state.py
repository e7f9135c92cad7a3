"""What the transformers plugin (``integrations.transformers``) keeps on a model between
``generate()`` calls: one lock per model, so calls on it decode one after another, and the
model's runtime wrapper, measured costs and wired proposers (``Setup``), so a later call
measures and builds nothing again.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from spec_plugins.backends import hf_compat
from spec_plugins.backends.torch_runtime import TorchRuntime, attention_implementation
from spec_plugins.config import SpecConfig
from spec_plugins.policy import Costs
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.proposers.base import Proposer
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.vocab import VocabMismatch, check_vocab_compatible
from spec_plugins.weak_cache import WeakCache
from spec_plugins.wiring import Wiring, wire


def model_lock(model: Any) -> threading.Lock:
    """The lock one loaded model's calls decode under: its kept runtime holds one KV cache, so a
    second thread waits for the first call to finish instead of sharing that cache. Kept beside
    the model, not on it, so the model still copies and pickles."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(model, threading.Lock())


_LOCKS: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()  # creates each model's lock once


@dataclass
class Setup:
    """What the plugin keeps per loaded model, on the model itself (``model._spec_plugins``): its
    runtime wrapper, the measured costs (one cost curve, shared by every proposer) and the
    proposers wired to it from spec config sections, each wiring with its own tree sizer (a
    sizer's calibrations are per source index, which means another drafter in another section).
    A second ``generate()`` then costs one forward per round plus its prefill,
    not the forwards of measuring the runtime and building proposers again. Rebuilt when what the
    runtime read from the model changes (``_stale``): its device or dtype, its attention
    implementation (one the runtime cannot mask is refused then), its vocabulary
    (``resize_token_embeddings``) or its context. It holds nothing of a
    draft model or proposer instance a call passes (``wired``), so dropping those frees them.
    A draft model (``draft_model=`` or a ``draft_model`` section) is checked against the target's
    tokenizer when built (``check_draft``)."""

    runtime: TorchRuntime
    costs: Costs | None = None
    wirings: dict[str, Wiring] = field(default_factory=dict)  # per proposer section (its JSON; "": none)
    # the tree sizer of each proposer instance a call passes (or built for a draft model), kept
    # across calls while the proposer lives (weak keys, as ``Costs`` keeps drafters' costs)
    sizers: WeakCache = field(default_factory=WeakCache)
    # the target's tokenizer read from its local directory (``local_tokenizer``), looked up once
    found_tokenizer: Any = field(default=None, repr=False)
    looked_up: bool = False

    def __reduce__(self) -> tuple:
        """A pickle of the model (``torch.save``) starts without it: rebuilt on first use (its costs
        and proposers belong to this process's runtime)."""
        return _absent, ()

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the model builds its own, around the copy

    @staticmethod
    def of(model: Any) -> "Setup":
        setup = model.__dict__.get("_spec_plugins")
        if setup is None or _stale(setup.runtime, model):  # checked on every call: the model may change
            setup = Setup(TorchRuntime(model, tokenizer=None))
            model.__dict__["_spec_plugins"] = setup  # a plain attribute: not a submodule, never saved
        return setup

    def wired(self, cfg: SpecConfig, draft_model: Any, implicit: bool, proposer: Proposer | None,
              tokenizer: Any = None) -> Wiring:
        """The proposer of the spec config (wired once per section), of the draft model (built once
        per target and section, ``_draft_proposer``) or the instance given, wired to this model.
        Wiring a built proposer again is cheap: the costs keep each proposer's measured drafting.
        ``tokenizer``: the target's (the call's ``spec_tokenizer``), which a draft model is
        checked against; without it, the one in the target's local directory, if any."""
        section = cfg.proposer
        if proposer is None and draft_model is None:
            key = section.model_dump_json() if section is not None else ""
            return _recent(self.wirings, key, lambda: self._wire_section(section, tokenizer))
        if proposer is not None:
            return self._wire(proposer.config, self._sizer(proposer), proposer=proposer)
        if section is not None and section.type != "draft_model" and not implicit:
            raise ValueError(f"draft_model/assistant_model given, but spec_config's proposer is {section.type!r}; "
                             "use proposer type draft_model (or drop the model)")
        if section is None or section.type != "draft_model":
            section = DraftModelProposer.Config.model_validate(_DRAFT_ALONE)
        drafter = self._draft_proposer(section, draft_model, tokenizer)
        return self._wire(section, self._sizer(drafter), proposer=drafter)

    def _wire_section(self, section: Any, tokenizer: Any) -> Wiring:
        """A spec config section wired with its own sizer; a draft model section's model is
        checked against the target's tokenizer before anything is measured."""
        if section is None or section.type != "draft_model":
            return self._wire(section, TreeSizer(), tokenizer=None)
        drafter = DraftModelProposer(section, target=self.runtime)
        check_draft(self._tokenizer(tokenizer), getattr(drafter.runtime, "tokenizer", None),
                    self.runtime.vocab_size, drafter.runtime.vocab_size)
        return self._wire(section, TreeSizer(), proposer=drafter)

    def _tokenizer(self, given: Any) -> Any:
        """The target's tokenizer: the one the call gave, else its local directory's (read once)."""
        if given is not None:
            return given
        if not self.looked_up:
            self.found_tokenizer, self.looked_up = local_tokenizer(self.runtime.model), True
        return self.found_tokenizer

    def _wire(self, section: Any, sizer: TreeSizer, **build: Any) -> Wiring:
        """``section`` wired over the kept costs with its own ``sizer``."""
        wiring = wire(self.runtime, section, costs=self.costs, sizer=sizer, **build)
        self.costs = wiring.costs or self.costs
        return wiring

    def _sizer(self, proposer: Proposer) -> TreeSizer:
        """The tree sizer of a proposer instance, made on its first call: its calibrations carry
        across calls with it, and no other proposer's estimates are scaled by them."""
        sizer = self.sizers.get(proposer)
        if sizer is None:
            sizer = self.sizers[proposer] = TreeSizer()
        return sizer

    def _draft_proposer(self, section: Any, draft_model: Any, tokenizer: Any) -> DraftModelProposer:
        """The draft model's proposer for this target and section, kept on the draft model, keyed
        weakly by the target's runtime: reused while both live, freed with the draft model (the
        target keeps no reference to it) or with this setup (the proposer keeps none to it).
        Checked against the target's tokenizer when built (``_checked_draft``); rebuilt, as the
        target's setup is, when the draft model changed what its runtime read (``_stale``)."""
        per_target = draft_model.__dict__.setdefault("_spec_plugins_drafts", WeakCache())
        kept = per_target.setdefault(self.runtime, {})
        key = section.model_dump_json()
        if key in kept and _stale(kept[key].runtime, draft_model):
            del kept[key]  # e.g. resized or moved since: a kept proposer would clamp to the old vocabulary
        return _recent(kept, key, lambda: DraftModelProposer(
            section, target=self.runtime, runtime=self._checked_draft(draft_model, tokenizer)))

    def _checked_draft(self, draft_model: Any, tokenizer: Any) -> TorchRuntime:
        """The runtime of a loaded draft model, whose tokenizer (read from its local directory)
        or vocabulary size passed ``check_draft``; the target itself needs no check."""
        runtime = TorchRuntime(draft_model)
        if draft_model is not self.runtime.model:
            check_draft(self._tokenizer(tokenizer), local_tokenizer(draft_model), self.runtime.vocab_size,
                        runtime.vocab_size)
        return runtime


def _stale(runtime: TorchRuntime, model: Any) -> bool:
    """Whether ``model`` changed what ``runtime`` read from it when built: a runtime keeping an old
    vocabulary size refuses the new tokens (its draft check, its sampling), one keeping an old
    context refuses or allows the wrong calls."""
    p = next(model.parameters())
    return (runtime.device != p.device or runtime.dtype != p.dtype
            or runtime.attention != attention_implementation(model)
            or runtime.vocab_size != int(model.get_output_embeddings().weight.shape[0])
            or runtime.max_context != hf_compat.context_limit(model))


# how far two logits widths may differ and still be one tokenizer padded (to a multiple of 64 or
# 128 rows, or a model family's own rounding): by 1/8 of the smaller width, or by PAD_ROWS rows
PAD_FRACTION, PAD_ROWS = 8, 256


def check_draft(target_tok: Any, draft_tok: Any, target_rows: int, draft_rows: int) -> None:
    """Refuse a draft model that does not use the target's tokenizer (its tokens would mean other
    text: every round drafted for nothing). Both tokenizers known: they must map tokens to the same
    ids (``check_vocab_compatible``, as ``SpeculativeDecoder.from_config`` checks); otherwise the
    logits widths must differ by no more than padding explains (``PAD_FRACTION``, ``PAD_ROWS``)."""
    if target_tok is not None and draft_tok is not None:
        check_vocab_compatible(target_tok, draft_tok, "target", "draft model")
        return
    small, big = sorted((target_rows, draft_rows))
    if big - small > max(small // PAD_FRACTION, PAD_ROWS):
        raise VocabMismatch(
            f"draft model's vocabulary ({draft_rows} logits) and the target's ({target_rows}) differ by more "
            f"than padding explains (1/{PAD_FRACTION} of the smaller, or {PAD_ROWS} rows): the draft model uses "
            "another tokenizer, and speculative decoding needs the target's. Use a draft model of the target's "
            "family; if it shares the tokenizer all the same, load both models from local directories holding "
            "their tokenizers, so the tokenizers are compared instead")


def local_tokenizer(model: Any) -> Any:
    """The tokenizer in the local directory a loaded model was read from (``name_or_path``), read
    offline; None where it names no directory or the directory holds no tokenizer."""
    path = str(getattr(model, "name_or_path", "") or "")
    if not path or not Path(path).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):  # no tokenizer files there (ValueError: none to instantiate)
        return None


KEPT = 8  # proposers kept per model (and per draft model and target): the sections used most recently


def _recent(kept: dict[str, Any], key: str, build: Callable[[], Any]) -> Any:
    """``kept[key]``, built on first use; ``kept`` holds the ``KEPT`` most recently used entries,
    so calls sweeping a proposer's settings do not keep a head or a draft model's cache per value."""
    value = kept.pop(key) if key in kept else build()
    kept[key] = value  # most recent last
    while len(kept) > KEPT:
        kept.pop(next(iter(kept)))
    return value


def _absent() -> None:
    """What an unpickled ``Setup`` is: none (``Setup.of`` builds one)."""
    return None


# a draft model given alone (no spec_config): 5 draft tokens per round
_DRAFT_ALONE = {"type": "draft_model", "num_draft_tokens": 5,
                "model": {"backend": "torch", "model": "<the draft model given to generate()>"}}
