"""Request preparation for the HTTP routes: tokenization under the token limits, and sampling
parameters, with TGI's messages naming the fields the client used.

Tokenizing runs in a worker thread (``body.offload``), and never on more text than the limits
can use: a 4 MiB prompt costs the tokenizer about 1 GB and 3 s, so an input longer than the
limit can possibly fit is refused on the count of its first characters (``encode_text``).
"""

from __future__ import annotations

import copy
import random
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from spec_plugins.config import SamplingConfig
from spec_plugins.server.schemas import ApiError, GenerateParameters
from spec_plugins.text import StopStrings, TextStream
from spec_plugins.types import RowRequest

DEFAULT_MAX_NEW_TOKENS = 256
# A cut through the text may split a word into more tokens than the whole word has; the counts
# below allow this many extra tokens for it.
PROBE_MARGIN = 16


@dataclass(frozen=True)
class Names:
    """The request's fields as the client named them, for error messages."""

    inputs: str = "inputs"
    max_new_tokens: str = "max_new_tokens"


TGI = Names()


@dataclass
class Prepared:
    ids: list[int]
    params: GenerateParameters
    row: RowRequest
    seed: int | None
    text: TextStream | None = None  # the row's text, fed in the batch (its stop strings stop the row there)
    hide_stop: bool = False  # OpenAI's routes: the text ends before a stop string and has no special tokens


TENANT_HEADER = "x-tenant"
MAX_TENANT_CHARS = 128


def tenant_of(request: Any) -> str | None:
    """The request's tenant (header ``X-Tenant``): proposers with cross-request memory
    (``suffix`` with ``scope: tenant``) only reuse text of requests with the same tenant."""
    t = request.headers.get(TENANT_HEADER)
    if t is not None and len(t) > MAX_TENANT_CHARS:
        raise ApiError(422, f"the X-Tenant header has {len(t)} characters; at most {MAX_TENANT_CHARS} are accepted")
    return t


def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters. Byte-level BPE and SentencePiece entries spell
    the text they stand for (one character per byte or more), so no token covers more text; a
    tokenizer whose unknown token swallows whole words breaks this, and then ``encode_text``
    only tokenizes more (its answers stay exact)."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1)


def check_input_count(state: Any, n: int, names: Names = TGI) -> None:
    """An input of ``n`` tokens is within ``--max-input-tokens`` (TGI's 422 otherwise)."""
    if n > state.max_input_tokens:
        raise ApiError(422, f"`{names.inputs}` tokens must be <= {state.max_input_tokens} (--max-input-tokens). "
                            f"Given: {n}")


def check_truncate(state: Any, truncate: int | None) -> None:
    """TGI's bound on ``truncate`` (its wording: ``--max-input-tokens`` itself is allowed). A larger
    one cannot be honoured, since no input keeps more tokens than the limit; it was taken as no
    truncation, so a long input was refused or kept in full instead of cut as asked."""
    if truncate is not None and not 0 < truncate <= state.max_input_tokens:
        raise ApiError(422, f"`truncate` must be strictly positive and less than {state.max_input_tokens}. "
                            f"Given: {truncate}")


def prepare(state: Any, ids: list[int], params: GenerateParameters, key: int, tenant: str | None = None,
            names: Names = TGI, hide_stop: bool = False, controls: Any = None, compiled: Any = None) -> Prepared:
    """Token limits and sampling, with TGI's messages. ``hide_stop`` (OpenAI's routes): the text
    shown ends before a stop string and skips special tokens; TGI's keeps both, as TGI does.
    ``controls``: grammar, bias and penalties (``server.controls``), the grammar ``compiled``."""
    if params.truncate is not None:
        ids = ids[-params.truncate:]
    n_in = len(ids)
    if n_in == 0:
        raise ApiError(422, f"`{names.inputs}` cannot be empty")
    check_input_count(state, n_in, names)
    room = state.max_total_tokens - n_in
    max_new = params.max_new_tokens if params.max_new_tokens is not None else min(room, DEFAULT_MAX_NEW_TOKENS)
    if n_in + max_new > state.max_total_tokens:
        raise ApiError(422, f"`{names.inputs}` tokens + `{names.max_new_tokens}` must be <= "
                            f"{state.max_total_tokens}. Given: {n_in} `{names.inputs}` tokens and {max_new} "
                            f"`{names.max_new_tokens}`")
    seed = None
    if params.sampling:
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        sampling = SamplingConfig(temperature=params.temperature or 1.0, top_k=params.top_k, top_p=params.top_p,
                                  repetition_penalty=params.repetition_penalty, seed=seed)
    else:
        sampling = SamplingConfig(temperature=0.0, repetition_penalty=params.repetition_penalty, seed=None)
    # per-token text as TGI sends it (special tokens spelled; OpenAI's routes skip them); a stop
    # sequence stops the row in the round that completes it, so no token after it is computed
    text = TextStream(state.tokenizer, params.stop or (), skip_special_tokens=hide_stop)
    extra = controls.row(state, compiled, n_in) if controls is not None else {}
    row = RowRequest(key, ids, max_new, sampling, seed, logprobs=True, tenant=tenant, stop=StopStrings(text), **extra)
    return Prepared(ids, params, row, seed, text, hide_stop)


def _tokenize(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


_WORD_START = re.compile(r"(?<=\S)\s")


def _bounded(state: Any, text: str, truncate: int | None, names: Names, special: bool) -> int:
    """Where in ``text`` tokenizing starts (a character index), so no more is tokenized than the
    limits use. Without ``truncate``: a text longer than ``8 x`` (then ``max_token_chars x``) the
    token limit is first counted on that many leading characters; more than the limit there (+ the
    margin) and it is refused unread (0: the whole text). With ``truncate``: a text longer than
    ``max_token_chars x (truncate + margin + 1)`` characters starts at a word start within that
    tail, which holds more than ``truncate`` tokens; their last ``truncate`` are the whole text's
    unless one word spans the cut."""
    check_truncate(state, truncate)
    tok, per = state.tokenizer, state.max_token_chars
    limit = state.max_input_tokens
    if truncate is not None:
        window = per * (truncate + PROBE_MARGIN + 1)
        if len(text) <= window:
            return 0
        tail = len(text) - window
        cut = _WORD_START.search(text, tail, tail + PROBE_MARGIN * per)
        return cut.start() if cut else tail
    for size in sorted({8 * (limit + PROBE_MARGIN + 1), per * (limit + PROBE_MARGIN + 1)}):
        if len(text) <= size:
            break
        n = len(_tokenize(tok, text[:size], special))
        if n > limit + PROBE_MARGIN:
            raise ApiError(422, f"`{names.inputs}` tokens must be <= {limit} (--max-input-tokens). Given: more "
                                f"than {n - PROBE_MARGIN} (counted in its first {size} of {len(text)} characters)")
    return 0


def encode_text(state: Any, text: str, truncate: int | None = None, names: Names = TGI,
                special: bool = True) -> list[int]:
    """Token ids of ``text`` (call it off the event loop), tokenizing no more than the limits use
    (``_bounded``); with ``truncate``, its last ``truncate`` tokens."""
    start = _bounded(state, text, truncate, names, special)
    ids = _tokenize(state.tokenizer, text[start:], special)
    return ids[-truncate:] if truncate is not None else ids


def token_spans(state: Any, text: str, truncate: int | None = None, names: Names = TGI,
                special: bool = True) -> list[dict[str, Any]]:
    """TGI's ``/tokenize`` answer: ``{id, text, start, stop}`` per token of ``text``, under the
    same limits and ``truncate`` as ``encode_text`` (an input over ``--max-input-tokens`` is a
    422, as /generate answers it). ``start``/``stop`` are UTF-8 byte offsets into ``text`` and
    ``text`` the text between them, as TGI reports them (its Rust tokenizer's offsets are byte
    offsets; the text between two character offsets is the same); a token the tokenizer adds
    (BOS; none with ``special`` false, TGI's ``add_special_tokens``) spans 0..0, any other token
    its own offsets (an empty one k..k). Offsets need a fast tokenizer (its offsets mapping)."""
    tok = state.tokenizer
    if not getattr(tok, "is_fast", False):
        raise ApiError(404, f"No fast tokenizer available: /tokenize reports each token's offsets, which this "
                            f"model's tokenizer ({type(tok).__name__}) cannot give", "tokenizer")
    start = _bounded(state, text, truncate, names, special)
    enc = tok(text[start:], add_special_tokens=special, return_offsets_mapping=True, return_special_tokens_mask=True)
    spans = [(t, 0, 0) if added else (t, a + start, b + start)
             for t, (a, b), added in zip(enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"])]
    spans = spans[-truncate:] if truncate is not None else spans
    check_input_count(state, len(spans), names)
    at = _byte_index(text, {i for _, a, b in spans for i in (a, b)})
    return [{"id": t, "text": text[a:b], "start": at[a], "stop": at[b]} for t, a, b in spans]


def _byte_index(text: str, positions: set[int]) -> dict[int, int]:
    """UTF-8 byte offset of each character index in ``positions`` (one pass over ``text``)."""
    if text.isascii():
        return {i: i for i in positions}
    out, size, prev = {}, 0, 0
    for i in sorted(positions):
        size += len(text[prev:i].encode("utf-8", "surrogatepass"))
        out[i], prev = size, i
    return out


CHAT = Names("messages", "max_tokens")


def render_chat(state: Any, messages: Sequence[Any]) -> str:
    """The model's chat template over ``messages`` (``ChatMessage``), ready for the assistant."""
    return _apply_template(state.tokenizer, _template_messages(messages))


def _template_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    return [{"role": m.template_role(), "content": m.text()} for m in messages]


def _apply_template(tok: Any, msgs: Sequence[dict[str, str]]) -> str:
    """The chat template over plain ``{"role", "content"}`` messages; a template error is a 422."""
    if not getattr(tok, "chat_template", None):
        raise ApiError(422, "this model's tokenizer has no chat template; use /generate or /v1/completions")
    from jinja2 import TemplateError

    try:
        return tok.apply_chat_template(list(msgs), add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # templates raise on what they do not take (roles out of order, ...)
        raise ApiError(422, f"the model's chat template refused these `messages`: {exc}") from None


def encode_chat(state: Any, messages: Sequence[Any], names: Names = CHAT) -> list[int]:
    """Token ids of the rendered chat (as ``apply_chat_template(tokenize=True)``: the template
    writes the special tokens itself), under the same limits as ``encode_text``.

    Message text that spells a special token (``<|im_end|>``) becomes that control token, as in
    transformers, TGI and vLLM. With ``state.escape_special_tokens`` it is encoded as the plain
    text it is (``escape_special``), so a user cannot open a system turn."""
    msgs = _template_messages(messages)
    text = _apply_template(state.tokenizer, msgs)
    ids = encode_text(state, text, None, names, special=False)
    if getattr(state, "escape_special_tokens", False):
        ids = escape_special(state.tokenizer, text, ids, message_spans(state.tokenizer, msgs, text))
    return ids


# a message's stand-in while locating it: private-use characters, which no case or whitespace
# filter changes
_MARK = "\ue000{}\ue001"


def message_spans(tokenizer: Any, msgs: Sequence[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Where the text of each message holding a special token's spelling lies in ``text`` (the
    rendered chat), in order. The template is rendered again with a marker in place of each such
    message: the markers show where the template put the messages, so a message is never matched at
    the template's own tokens (``<|im_end|>`` spells the template's turn ends too). A template that
    changes such a message or copies it other than once cannot tell it from its own tokens: a 422."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    which = [i for i, m in enumerate(msgs) if any(t in m["content"] for t in specials)]
    if not which:
        return []
    marked = [dict(m, content=_MARK.format(i)) if i in which else m for i, m in enumerate(msgs)]
    skeleton = _apply_template(tokenizer, marked)
    found = []
    for i in which:
        if skeleton.count(_MARK.format(i)) != 1:
            raise _not_verbatim([i])
        found.append((skeleton.index(_MARK.format(i)), i))
    spans, parts, pos, size = [], [], 0, 0
    for at, i in sorted(found):
        content = msgs[i]["content"]
        parts += [skeleton[pos:at], content]
        size += at - pos
        spans.append((size, size + len(content)))
        size += len(content)
        pos = at + len(_MARK.format(i))
    if "".join(parts) + skeleton[pos:] != text:  # the template changed a message's text (``| trim``, ...)
        raise _not_verbatim(which)
    return spans


def _not_verbatim(which: Sequence[int]) -> ApiError:
    """The messages whose special-token text cannot be escaped (``message_spans``), by path."""
    named = ", ".join(f"`messages.{i}`" for i in which)
    one = len(which) == 1
    return ApiError(422, f"{named} {'holds' if one else 'hold'} special-token text that cannot be escaped: the chat "
                         f"template does not copy {'this message' if one else 'these messages'} verbatim")


def escape_special(tokenizer: Any, text: str, ids: list[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """``ids`` (``text`` tokenized with its special tokens) with each span of ``text`` (a message's
    own text, ``message_spans``, in order) encoded as plain text: the tokens covering it are
    re-tokenized with ``split_special_tokens``; the template's tokens stay."""
    if not spans:
        return ids
    split = _splitter(tokenizer)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) != len(ids):  # ``ids`` is ``text`` tokenized the same way; a mismatch is a bug here
        raise RuntimeError("escape_special: the token offsets do not match the tokenized chat")
    out: list[int] = []
    j = 0
    for start, end in spans:
        first = next(k for k in range(j, len(ids)) if offsets[k][1] > start)  # the first token reaching the span
        last = max(k for k in range(first, len(ids)) if offsets[k][0] < end)  # the last one starting inside it
        out += ids[j:first]
        piece = text[offsets[first][0]:offsets[last][1]]
        out += list(split(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        j = last + 1
    return out + ids[j:]


_SPLITTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its splitting copy
_SPLITTERS_LOCK = threading.Lock()


def _splitter(tokenizer: Any) -> Any:
    """A private copy of ``tokenizer`` for ``split_special_tokens``: transformers applies that
    option by setting a flag on the shared Rust tokenizer for the call, which would change how
    prompts tokenized at the same time in other worker threads are encoded. The copy gets the
    flag once, here, and every call on it asks for the same value, so nothing flips it again."""
    with _SPLITTERS_LOCK:
        split = _SPLITTERS.get(tokenizer)
        if split is None:
            split = copy.deepcopy(tokenizer)
            split("", add_special_tokens=False, split_special_tokens=True)  # sets the copy's flag before any use
            _SPLITTERS[tokenizer] = split
    return split


def check_token_ids(state: Any, ids: Sequence[int], field: str) -> list[int]:
    """A prompt given as token ids: each a token of this model's vocabulary."""
    vocab = state.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(422, f"`{field}`: token id {bad} is not in this model's vocabulary (0..{vocab - 1})")
    return list(ids)
