"""Our model-free proposers inside vLLM, as vLLM v1 ``custom_class`` proposers.

vLLM (0.22 to 0.33; removed in 0.34) loads a third-party drafter when the speculative config
names a class by its dotted path, ``speculative_config={"method": "custom_class", "model":
"spec_plugins.integrations.vllm.NgramDrafter", "num_speculative_tokens": k}``, builds it as
``cls(vllm_config)`` and, after every step, calls

    propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)
        -> list[list[int]]

with ``sampled_token_ids[i]`` the tokens row i accepted this step (empty for a row still in
prefill), ``num_tokens_no_spec`` an int array (row i's history length) and ``token_ids_cpu`` a
[max_num_reqs, max_model_len] int array (row i's history in ``[i, :num_tokens_no_spec[i]]``).
Drafts are returned by row position; vLLM's own rejection sampler verifies them. The call
carries no request ids, so a row's index is recognised by its history (``RowIndexes``), and
an index no row of the batch continues any more is a finished request (it enters suffix decoding's
global index). A row still in prefill continues its index too (it drafts nothing, but its
request has not finished); a request missing from a step's batch (preempted) counts as
finished, as nothing tells it from one that ended.

Proposer settings come from our own YAML proposer section, in the environment variable
``SPEC_PLUGINS_VLLM_PROPOSER`` (a path or inline YAML; a value that looks like a path, ending in
``.yaml``/``.yml``/``.json`` or holding a path separator, must name a file), so vLLM's config
carries only the class.
Fields vLLM decides itself are refused unless they agree with it: ``num_draft_tokens`` (vLLM's
``num_speculative_tokens``), ``tree_nodes`` (vLLM verifies chains) and ``scope: tenant`` (vLLM's
call carries no tenant).
``register()`` is the ``vllm.general_plugins`` entry point: it checks the installed vLLM has
this interface and is idempotent, as vLLM loads plugins in every process.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

ENV = "SPEC_PLUGINS_VLLM_PROPOSER"
KEY_TOKENS = 32  # first and last tokens of a history compared (most rows differ there)
SPREAD = 64  # and this many to twice as many more, spread over its middle (``_continues``)
PATH_SUFFIXES = (".yaml", ".yml", ".json")
_REGISTERED = False


def proposer_section(default_type: str) -> dict[str, Any]:
    """Our proposer section from ``SPEC_PLUGINS_VLLM_PROPOSER`` (file path or inline YAML)."""
    import yaml

    raw = os.environ.get(ENV)
    if not raw:
        return {"type": default_type}
    if os.path.isfile(raw):
        text = open(raw).read()
    elif _looks_like_path(raw):  # a mistyped path would otherwise be read as a YAML string
        raise FileNotFoundError(f"{ENV}={raw!r}: file not found (give an existing YAML/JSON file, or the "
                                "proposer section as inline YAML)")
    else:
        text = raw
    data = yaml.safe_load(text)
    if isinstance(data, dict) and "proposer" in data:
        data = data["proposer"]
    if not isinstance(data, dict) or data.get("type", default_type) != default_type:
        raise ValueError(f"{ENV} must hold a `{default_type}` proposer section, got {str(data)[:120]!r}")
    return {"type": default_type, **data}


def _looks_like_path(raw: str) -> bool:
    """A one-line value with no YAML mapping in it, ending in a config suffix or holding a path
    separator (inline YAML holds ``key: value``)."""
    seps = [sep for sep in (os.sep, os.altsep) if sep]
    return "\n" not in raw and ": " not in raw and (raw.strip().endswith(PATH_SUFFIXES)
                                                    or any(sep in raw for sep in seps))


class RowIndexes:
    """The index of each live request, recognised by its history (vLLM passes no request ids and
    moves rows when others leave): an index held from the last step whose tokens begin this
    row's history (``_continues``: its head, tail and tokens spread over the middle, so a new
    request sharing another's head and tail is not it) is the same request's, extended by the new
    tokens; an unclaimed one belongs to a finished request. A history is read by slices (a view of
    vLLM's array): those tokens against every held index, and what the row's index lacks, so a
    step costs the new tokens, not the context."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.held: list[Any] = []

    def step(self, histories: Sequence[Sequence[int]],
             prefilling: Sequence[bool] = ()) -> tuple[list[Any], list[Any]]:
        """Each row's index (None for a row in ``prefilling``: it drafts nothing) and the indexes
        no row continues (finished requests). A prefilling row keeps the index it continues held,
        unextended: a request re-prefilled in chunks is still running, and indexing it anew or
        reporting it finished would index its history twice. Decoding rows claim first, so a new
        prompt in prefill that repeats a running request's history does not take its index."""
        prefill = [i < len(prefilling) and bool(prefilling[i]) for i in range(len(histories))]
        free = list(self.held)
        out: list[Any] = [None] * len(histories)
        held: list[Any] = []
        for i in sorted(range(len(histories)), key=lambda i: prefill[i]):  # decoding rows first
            h = histories[i]
            idx = next((x for x in free if _continues(x, h)), None)
            if idx is not None:
                free.remove(idx)
                held.append(idx)
            if prefill[i]:
                continue
            if idx is None:
                idx = _Sized(self.make())
                held.append(idx)
            idx.extend(_ints(h[idx.length:]))
            out[i] = idx
        self.held = held
        return out, free


def _continues(held: "_Sized", history: Sequence[int]) -> bool:
    """``history`` begins with the tokens ``held`` holds, judged by their first and last
    ``KEY_TOKENS`` and ``SPREAD`` or more spread evenly over the middle: a fixed number per row,
    so a step's cost does not grow with the context, while a new request sharing a finished one's
    head and tail but not its middle is told apart."""
    t, n = held.tokens, held.length
    if not (0 < n <= len(history) and t[:KEY_TOKENS] == _ints(history[:min(n, KEY_TOKENS)])
            and t[-KEY_TOKENS:] == _ints(history[max(0, n - KEY_TOKENS):n])):
        return False
    step = max(1, (n - 2 * KEY_TOKENS) // SPREAD)  # a strided slice: a view of vLLM's array
    return t[KEY_TOKENS:n - KEY_TOKENS:step] == _ints(history[KEY_TOKENS:n - KEY_TOKENS:step])


def _ints(tokens: Sequence[int]) -> list[int]:
    return [int(t) for t in tokens]


class _Drafter:
    """Common part of the vLLM adapters: config, budget, rows."""

    TYPE = ""

    def __init__(self, vllm_config: Any = None, section: dict[str, Any] | None = None) -> None:
        from spec_plugins.registry import PROPOSERS

        spec = getattr(vllm_config, "speculative_config", None)
        self.k = int(getattr(spec, "num_speculative_tokens", None) or 5)
        section = section if section is not None else proposer_section(self.TYPE)
        cls = PROPOSERS.get(section["type"])
        self.config = cls.Config.model_validate(section)
        _refuse_unused(self.config, self.vllm_limits())

    def vllm_limits(self) -> dict[str, tuple[tuple[Any, ...], str]]:
        """Section fields vLLM decides itself: per field, the values that agree with vLLM (its
        default always does) and what vLLM does instead."""
        return {"num_draft_tokens": ((self.k,), f"vLLM drafts num_speculative_tokens ({self.k}) tokens per row")}

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        # each row's history as a view of vLLM's array (RowIndexes reads only what it needs of it)
        rows = range(len(sampled_token_ids))
        hist = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in rows]
        indexes, finished = self.rows.step(hist, [not sampled_token_ids[i] for i in rows])  # prefill: no draft
        self.finished(finished)
        return [self.draft_row(idx)[: self.k] if idx is not None else [] for idx in indexes]

    def draft_row(self, idx: Any) -> list[int]:
        raise NotImplementedError

    def finished(self, indexes: list[Any]) -> None:
        """Requests that left the batch since the last step."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load (vLLM calls this when present)."""


class NgramDrafter(_Drafter):
    """Prompt lookup (our ``ngram``) as a vLLM custom-class proposer."""

    TYPE = "ngram"

    def __init__(self, vllm_config: Any = None, section: dict[str, Any] | None = None) -> None:
        super().__init__(vllm_config, section)
        from spec_plugins.proposers.ngram import NgramIndex

        c = self.config
        self.rows = RowIndexes(lambda: NgramIndex(c.min_ngram, c.max_ngram))

    def draft_row(self, idx: Any) -> list[int]:
        return idx.inner.lookup(self.k)


class SuffixDrafter(_Drafter):
    """Suffix decoding (our ``suffix``) as a vLLM custom-class proposer: vLLM verifies chains,
    so each row drafts the most probable path of its speculation tree; finished requests enter
    the global index when ``scope`` is ``global``."""

    TYPE = "suffix"

    def __init__(self, vllm_config: Any = None, section: dict[str, Any] | None = None) -> None:
        super().__init__(vllm_config, section)
        from spec_plugins.suffix_global import GlobalIndex
        from spec_plugins.suffix_index import Cursor, RequestIndex

        c = self.config
        self.index = GlobalIndex(c.depth, c.global_max_tokens, max_nodes=c.global_max_nodes)
        self.rows = RowIndexes(lambda: RequestIndex(c.depth))
        self._Cursor = Cursor

    def vllm_limits(self) -> dict[str, tuple[tuple[Any, ...], str]]:
        return {**super().vllm_limits(),
                "tree_nodes": ((), f"vLLM verifies one chain per row, num_speculative_tokens ({self.k}) long"),
                "scope": (("request", "global"), "vLLM's call carries no tenant, so no finished request would be "
                          "remembered: use scope: global (shared by all requests) or scope: request (none)")}

    def draft_row(self, idx: Any) -> list[int]:
        from spec_plugins.suffix_trees import speculate

        c = self.config
        best: list[int] = []
        best_score = 0.0
        matches = [(idx.inner.trie, *idx.inner.match(c.max_match))]
        if c.scope == "global":
            cur = self._Cursor(self.index.trie("*"))
            cur.resync(idx.tokens)
            matches.append((cur.trie, *cur.match(c.max_match)))
        for trie, n, node in matches:
            if node is None:
                continue
            spec = speculate(trie, node, n, max(1, int(c.max_spec_factor * n)), min(self.k, c.depth - n), c.min_token_prob)
            chain = _top_path(spec)
            score = sum(p for _, p in chain)
            if score > best_score:
                best, best_score = [t for t, _ in chain], score
        return best

    def finished(self, indexes: list[Any]) -> None:
        if self.config.scope == "global":
            for gone in indexes:
                self.index.add("*", gone.tokens)


class _Sized:
    """An index plus how many history tokens it holds and the tokens themselves."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.tokens = inner, []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        self.tokens += new
        self.inner.extend(new)


def _refuse_unused(config: Any, limits: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """A section field vLLM decides itself would be silently unused (a setting that looks on but
    is not): refused by name unless at its default (a dumped config carries every field at its
    default) or at a value that agrees with vLLM."""
    fields = type(config).model_fields
    bad = [f"{name}: {getattr(config, name)!r} ({instead})" for name, (agree, instead) in limits.items()
           if getattr(config, name) not in (fields[name].default, *agree)]
    if bad:
        raise ValueError(f"{config.type} proposer section under vLLM: " + "; ".join(bad))


def _top_path(spec: Any) -> list[tuple[int, float]]:
    """The chain of most probable children from the root of a speculation tree."""
    best: dict[int, int] = {}
    for j, (p, prob) in enumerate(zip(spec.parents, spec.probs)):
        if p not in best or prob > spec.probs[best[p]]:
            best[p] = j
    out, node = [], -1
    while node in best:
        node = best[node]
        out.append((spec.tokens[node], spec.probs[node]))
    return out


def register() -> None:
    """``vllm.general_plugins`` entry point: check the installed vLLM offers ``custom_class``
    (re-entrant: vLLM calls it in every process, maybe several times)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm.v1.spec_decode.custom_class_proposer") is not None
    except ModuleNotFoundError:  # no vllm at all
        found = False
    if not found:
        import logging

        logging.getLogger(__name__).warning(
            "spec-plugins: this vLLM has no v1 custom_class proposer (vLLM 0.22-0.33 have it); "
            "NgramDrafter / SuffixDrafter cannot be loaded")
    _REGISTERED = True
