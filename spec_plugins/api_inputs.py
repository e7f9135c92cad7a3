"""What the Python API (``SpeculativeDecoder``) accepts and refuses, in one place.

Prompt token ids, chat messages, stop strings, per-row sampling and seeds and token limits are
checked and normalised here before any row starts, so a bad value fails with an error naming it
(never deep inside a forward, never read as something else). A proposer's drafts, the other input a user
hands the package, are checked here too (``check_draft``), as the batch places them.
"""

from __future__ import annotations

import operator
from collections.abc import MappingView
from collections.abc import Set as AbstractSet
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import torch
from pydantic import ValidationError

from spec_plugins.config import SamplingConfig
from spec_plugins.row_trees import RowTrees, node_depths
from spec_plugins.transfer import HOST
from spec_plugins.types import Draft

# stop strings: one string, several, or None (no stop)
Stop = Union[str, Sequence[str], None]


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or getattr(x, "dtype", None) in (torch.bool, bool)


def integer(x: Any) -> int | None:
    """``x`` as an int where it is an integer (Python, numpy, or a one-element integer tensor),
    else None: never a float, bool or str read as one."""
    if _is_bool(x):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def token_id(t: Any, i: int) -> int:
    """A prompt's token id at position ``i`` (``integer``)."""
    out = integer(t)
    if out is None:
        kind = "bool" if _is_bool(t) else type(t).__name__
        several = "; generate_batch() takes several prompts" if isinstance(t, (list, tuple)) else ""
        raise TypeError(f"prompt token ids must be integers; position {i} holds {t!r} ({kind}){several}")
    return out


def not_bytes(prompt: Any) -> None:
    """Refuse bytes: they iterate as integers, so they would be read as token ids."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"a prompt is a str, chat messages or a list of token ids, got {type(prompt).__name__}: "
                        "decode it to a str first (e.g. prompt.decode('utf-8')) or pass its token ids")


def ordered_sequence(prompt: Any) -> Iterable:
    """A token-id or chat-message prompt that iterates as one ordered sequence: a set, a dict or
    its views (no order the caller chose, or keys for ids) and an array or tensor that is not 1-D
    (read flat, or as a scalar) are refused, as anything not iterable is."""
    ndim = getattr(prompt, "ndim", 1)
    if not isinstance(prompt, Iterable) or isinstance(prompt, (AbstractSet, Mapping, MappingView)) or ndim != 1:
        shape = f" of shape {list(prompt.shape)}" if ndim != 1 and hasattr(prompt, "shape") else ""
        several = "; generate_batch() takes several prompts" if ndim == 2 else ""
        raise TypeError(f"a prompt is a str, chat messages or a list of token ids, got {type(prompt).__name__}{shape}"
                        f"{several}")
    return prompt


# chat roles: OpenAI's (``developer`` is its newer name for ``system``, which templates know;
# ``function`` its older ``tool``) and Llama 3's tool-output role ``ipython``
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def template_role(role: str) -> str:
    """The role a chat template is given: ``developer`` as ``system``, any other as is."""
    return "system" if role == "developer" else role


def holds_calls(m: Mapping[str, Any]) -> bool:
    """Whether ``m`` is an assistant turn holding tool calls (``tool_calls``, a non-empty list, or
    the older ``function_call``, an object): the one message OpenAI lets leave its content out or
    null."""
    calls, call = m.get("tool_calls"), m.get("function_call")
    return m.get("role") == "assistant" and (
        (isinstance(calls, (list, tuple)) and len(calls) > 0) or (isinstance(call, Mapping) and len(call) > 0))


def check_content(m: Mapping[str, Any], i: int) -> None:
    """Refuse message ``i`` (a dict with a known role) when it gives no content, naming
    ``messages[i].content``, as OpenAI refuses it (a 400) rather than rendering an empty turn: a
    missing key, null or an empty list of parts, unless the turn holds tool calls
    (``holds_calls``). An empty string is text, as at OpenAI. The server's chat route and
    ``chat_messages`` share this check."""
    where = f"messages[{i}].content"
    content = m.get("content")
    if content is None and holds_calls(m):  # left out or null
        return
    if content is None:
        how = "is missing" if "content" not in m else "is null"
        calls = " (an assistant turn may leave it out only where it holds a non-empty tool_calls list or a " \
            "function_call object)" \
            if m.get("role") == "assistant" else ""
        raise ValueError(f"{where} {how}: give a string or a list of text parts{calls}")
    if isinstance(content, (list, tuple)) and not content:
        raise ValueError(f"{where} is an empty list: give at least one text part, or a string")


def content_text(content: Any, where: str) -> str:
    """A message's content as the template's text: a str, None (an assistant turn holding tool
    calls, ``check_content``: ""), or text parts (``{"type": "text", "text": str}``) joined;
    anything else is refused naming ``where`` (``messages[0].content``), as a template would fail
    on it or print it raw."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ValueError(  # noqa: TRY004 - one error type for every bad message
            f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                and set(part) == {"type", "text"}):
            raise ValueError(f'{where}[{j}] must be a text part {{"type": "text", "text": str}}, got {part!r}')
    return "".join(part["text"] for part in content)


def chat_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Chat messages as the template gets them, each a dict with a known ``role`` and its
    ``content`` (``content_text``; only an assistant turn holding tool calls may leave it out or
    null, ``check_content``: ""), mapped as the server maps them (``template_role``). Other keys
    (``name``, ``tool_calls``) are kept for templates that read them; the server's routes pass
    role and content only (its special-token escaping covers message text, not what a template
    prints of other keys). A bad message is refused naming it."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(  # noqa: TRY004 - one error type for every bad message
                f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in CHAT_ROLES:
            got = f"{m['role']!r}" if "role" in m else "none"
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {got}")
        check_content(m, i)
        out.append({**m, "role": template_role(m["role"]),
                    "content": content_text(m.get("content"), f"messages[{i}].content")})
    return out


def in_vocab(ids: list[int], vocab_size: int) -> list[int]:
    """``ids``, each checked to be a row of the target's embedding (an id outside it fails
    deep inside the forward otherwise)."""
    vocab = int(vocab_size)
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise ValueError(f"prompt token id {t} (position {i}) is outside the model's vocabulary "
                             f"(0..{vocab - 1})")
    return ids


def stop_strings(stop: Stop) -> list[str]:
    """Stop strings as a list: one string is one stop, None none; every entry a string."""
    if stop is None:
        return []
    if not isinstance(stop, Iterable):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    stops = [stop] if isinstance(stop, str) else list(stop)
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be strings; stop[{i}] is {s!r} ({type(s).__name__})")
    if "" in stops:  # would stop before the first token; the CLI's --stop says the same
        raise ValueError("stop: stop strings must not be empty")
    return stops


def token_limits(max_new_tokens: int | Sequence[int], rows: int) -> list[int]:
    """Each row's max_new_tokens: one integer for every row, or one per row; none negative."""
    many = isinstance(max_new_tokens, (list, tuple))
    limits = list(max_new_tokens) if many else [max_new_tokens] * rows
    if len(limits) != rows:
        raise ValueError(f"max_new_tokens needs one entry per prompt ({rows}), got {len(limits)}")
    ints = [integer(n) for n in limits]
    if any(n is None for n in ints):
        raise ValueError(f"max_new_tokens must be an integer (or one per prompt), got {max_new_tokens!r}")
    limits = [int(n) for n in ints]  # type: ignore[arg-type]
    if min(limits, default=0) < 0:
        raise ValueError("max_new_tokens must be >= 0")
    return limits


def per_prompt(name: str, value: Any, rows: int, entry: str) -> list[Any] | None:
    """``value`` (None: not given) as one entry per prompt. A str, bytes, dict or set would
    iterate as something else (characters, byte values, keys, an arbitrary order) and a single
    value has no entries, so they are refused naming ``name`` (``entry``: what one entry is)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bytearray, memoryview, Mapping, AbstractSet)) or not isinstance(value, Iterable) \
            or not hasattr(value, "__len__"):
        raise TypeError(f"{name} must be a list with one {entry} per prompt ({rows}), got {type(value).__name__}"
                        f"{': wrap it in a list, one per prompt' if isinstance(value, Mapping) else ''}")
    out = list(value)
    if len(out) != rows:
        raise ValueError(f"{name} needs one entry per prompt ({rows}), got {len(out)}")
    return out


def batch_prompts(prompts: Any, encode: Callable[[Any], list[int]]) -> list[list[int]]:
    """A batch's prompts, each encoded; a ``TypeError``/``ValueError`` of entry i is raised again
    (same type) naming ``prompts[i]``. One prompt where the list goes is refused pointing at
    ``generate()``: a str, bytes, or a flat list of token ids or of chat messages (each entry
    would be read as a prompt of its own); so is what has no order of prompts (a dict, a set; a
    dict's ``.values()`` has one and is read as a list)."""
    if isinstance(prompts, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"generate_batch takes a list of prompts, got one {type(prompts).__name__}; use "
                        "generate() for one prompt")
    if not isinstance(prompts, Iterable) or isinstance(prompts, (Mapping, AbstractSet)):
        raise TypeError(f"generate_batch takes a list of prompts, got {type(prompts).__name__}")
    entries = list(prompts)
    ids = bool(entries) and all(integer(p) is not None and getattr(p, "ndim", 0) == 0 for p in entries)
    if ids or entries and all(isinstance(p, Mapping) for p in entries):
        raise TypeError(f"generate_batch takes a list of prompts, got one list of "
                        f"{'token ids' if ids else 'chat messages'}; use generate() for one prompt, or wrap it "
                        "in a list")
    out = []
    for i, p in enumerate(entries):
        try:
            out.append(encode(p))
        except (TypeError, ValueError) as exc:
            if type(exc) not in (TypeError, ValueError):  # subclasses (pydantic's, a tokenizer's) as they are
                raise
            raise type(exc)(f"prompts[{i}]: {exc}") from exc
    return out


def checked_sampling(fields: Mapping[str, Any], title: str, where: tuple[str, ...] = ()) -> SamplingConfig:
    """``fields`` checked as a ``SamplingConfig`` is. A failure stays pydantic's ``ValidationError``
    (a ``ValueError``), titled ``title`` (the call) with each error's place under ``where``, so it
    names what the caller gave (``sampling[1].top_p``, ``temperature``), not SamplingConfig's."""
    try:
        return SamplingConfig.model_validate(dict(fields))
    except ValidationError as exc:
        errors = [{"type": e["type"], "loc": (*where, *e["loc"]), "input": e["input"],
                   **({"ctx": e["ctx"]} if "ctx" in e else {})} for e in exc.errors()]
        raise ValidationError.from_exception_data(title, errors) from None  # type: ignore[arg-type]


def row_sampling(s: SamplingConfig | Mapping, i: int) -> SamplingConfig:
    """Row ``i``'s sampling: a ``SamplingConfig``, or its fields (checked as a config is, an error
    naming ``sampling[i]``)."""
    if isinstance(s, SamplingConfig):
        return s
    if isinstance(s, Mapping):
        return checked_sampling(s, "generate_batch", (f"sampling[{i}]",))
    raise TypeError(f"sampling[{i}] must be a SamplingConfig or a dict of its fields, got {type(s).__name__}")


def row_seeds(seeds: Sequence[int | None] | None, sampling: Sequence[SamplingConfig] | None
              ) -> list[int | None] | None:
    """Each row's generator seed: ``seeds[i]`` (checked as ``SamplingConfig.seed`` is) where
    given (not None), else ``sampling[i].seed`` where that entry sets one; None without either (the
    row draws from the generator the rows share, seeded from the call's ``seed``)."""
    own = [s.seed if "seed" in s.model_fields_set else None for s in sampling] if sampling is not None else None
    if seeds is None:
        return own
    out = []
    for i, seed in enumerate(seeds):
        try:
            out.append(SamplingConfig(seed=seed).seed)
        except ValidationError as exc:
            raise ValueError(f"seeds[{i}] = {seed!r}: {exc.errors()[0]['msg']}") from None
        if out[i] is None and own is not None:
            out[i] = own[i]
    return out


# ---- a proposer's drafts ------------------------------------------------------------------------
OWN_PROPOSERS = ("spec_plugins.proposers.", "spec_plugins.heads.")  # modules of the package's own drafters
Q_SUM_TOLERANCE = 1e-2  # a q row's sum may miss 1 by this (float16/bfloat16 rounding, summed in float64)


def foreign(proposers: Sequence[Any]) -> bool:
    """Whether any of ``proposers`` (a proposer and its sources) is not one of the package's own."""
    return any(not type(p).__module__.startswith(OWN_PROPOSERS) for p in proposers)


def _shape(t: Any) -> str:
    return f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_draft(draft: Any, rows: int, vocab: int, who: str, values: bool,
                budgets: Sequence[int] | None = None) -> None:
    """Refuse a draft that verification would crash on deep inside (a token outside the vocabulary,
    wrong shapes) or, worse, verify to a wrong output law (a q that is no distribution, or gives
    its own drafted token probability 0, which exact verification then always accepts), naming
    the proposer ``who``; given the round's ``budgets`` (``ProposeContext.budgets``), also one that
    drafts a row deeper than its budget (``_check_depth``).

    Types and shapes need no tensor data, so every draft has them checked. ``values`` reads the
    tokens and q: the batch asks for it only where that read costs no device sync (a draft on the
    host) or the proposer is not the package's own, so the device-resident round of the package's
    drafters keeps its one host sync. A node whose q is NaN throughout (softmax over logits a row's
    processors masked entirely) is let through: that row fails when the batch processes its
    logits, and such a q rejects its token."""
    def bad(problem: str) -> ValueError:
        return ValueError(f"proposer {who} returned a bad draft: {problem}")

    if draft is None:
        return
    if not isinstance(draft, Draft):
        raise bad(f"propose() must return a Draft or None, got {type(draft).__name__}")
    t = draft.tokens
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != rows or t.dtype.is_floating_point \
            or t.dtype.is_complex or t.dtype == torch.bool:
        raise bad(f"tokens must be an integer tensor [B={rows}, n], got {_shape(t)}")
    n = int(t.shape[1])
    par = draft.parents
    if isinstance(par, tuple):
        if len(par) != n or any(integer(p) is None or not -1 <= p < i for i, p in enumerate(par)):
            raise bad(f"parents must be {n} ints (one per token), each -1 or an earlier node, got {par!r}")
    elif not isinstance(par, RowTrees) or tuple(par.parents.shape) != (rows, n) or len(par) != n:
        raise bad(f"parents must be a tuple of {n} ints or RowTrees over [B={rows}, n={n}], got {type(par).__name__}")
    v = draft.valid
    if v is not None and (not isinstance(v, torch.Tensor) or tuple(v.shape) != (rows, n) or v.dtype != torch.bool):
        raise bad(f"valid must be a bool tensor [B={rows}, n={n}] or None, got {_shape(v)}")
    q = draft.probs
    if q is not None and (not isinstance(q, torch.Tensor) or tuple(q.shape) != (rows, n, vocab)
                          or not q.dtype.is_floating_point):
        raise bad(f"probs must be a float tensor [B={rows}, n={n}, V={vocab}] (V: the target's logits width) "
                  f"or None, got {_shape(q)}")
    if budgets is not None and n:
        _check_depth(draft, budgets, values, bad)
    if values and n:
        _check_values(draft, vocab, bad)


def _check_depth(draft: Draft, budgets: Sequence[int], values: bool, bad: Callable[[str], ValueError]) -> None:
    """Refuse a row whose valid nodes reach deeper than its budget: the loop cuts each row's draft
    to its room (under its token limit and the target's context), and the runtimes rely on it, so
    a deeper draft would be verified and committed past both. Node depths come from the parents
    (host data); ``valid`` is read where it is on the host or ``values`` already reads the draft
    (a device-resident draft of the package's own drafters, sized by the policy, is not synced)."""
    depth = torch.tensor(node_depths(draft.parents), dtype=torch.long, device="cpu") + 1  # tokens deep
    valid = draft.valid_on_host()
    if valid is not None and valid.device != HOST and not values:
        return
    per_row = depth.expand(len(budgets), -1) if valid is None else torch.where(valid.cpu(), depth, 0)
    deepest = per_row.amax(1).tolist()
    for b, (d, k) in enumerate(zip(deepest, budgets)):
        if d > k:
            raise bad(f"row {b} is drafted {d} tokens deep, past its budget of {k} (ProposeContext.budgets: the "
                      "most tokens a row's draft may hold along any path)")


def _check_values(draft: Any, vocab: int, bad: Callable[[str], ValueError]) -> None:
    """``check_draft``'s value checks: per-node flags computed where each tensor is (a proposer's
    valid may sit on the host, its tokens on the device), read at once (more only to word an error)."""
    tok = draft.tokens.long()
    flags = [((tok < 0) | (tok >= vocab))[None]]  # every node: the forward embeds the invalid ones too
    on = draft.valid.to(tok.device) if draft.valid is not None else torch.ones_like(tok, dtype=torch.bool)
    q = draft.probs
    if q is not None:
        tok, on = tok.to(q.device), on.to(q.device)
        on = on & ~q.isnan().all(-1)  # no draft at all (docstring)
        total = q.sum(-1, dtype=torch.float64)
        q_x = q.gather(-1, tok.clamp(0, vocab - 1)[..., None]).squeeze(-1)
        flags.append(torch.stack([on & ~total.isfinite(), on & (q.amin(-1) < 0),
                                  on & ((total - 1).abs() > Q_SUM_TOLERANCE), on & (q_x <= 0)]))
    found = torch.cat([f.cpu() for f in flags])  # [checks, B, n]
    if not bool(found.any()):
        return
    check, b, i = (int(x) for x in found.nonzero()[0])
    at, x = f"row {b}, node {i}", int(tok[b, i])
    if check == 0:
        raise bad(f"token id {x} ({at}) is outside the target's vocabulary (0..{vocab - 1})")
    problem = {1: "are not finite (NaN or inf)", 2: "hold a negative probability",
               3: f"sum to {float(total[b, i]):.4g}, not 1: probs must be the distribution each token was drawn from"}
    if check in problem:
        raise bad(f"probs at {at} {problem[check]}")
    raise bad(f"token {x} ({at}) has probability 0 under the draft's own probs: it cannot have been drawn "
              "from them (exact verification would accept it every time)")
