"""Request preparation for the HTTP routes: body parsing, token limits and sampling parameters,
with TGI's messages and status codes."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from spec_plugins.config import SamplingConfig
from spec_plugins.server.schemas import ApiError, ChatRequest, GenerateParameters, validation_message
from spec_plugins.types import RowRequest

DEFAULT_MAX_NEW_TOKENS = 256


MAX_BODY_BYTES = 4 << 20  # a prompt of a 32k-token context is ~130 KB of text; refuse more before parsing
MAX_JSON_DEPTH = 32  # TGI's bodies nest 4 deep; refuse deeper before the parser recurses


def _nesting(body: bytes, cap: int) -> int:
    """JSON nesting depth of ``body`` (brackets outside strings), stopping once past ``cap``."""
    if body.count(b"[") + body.count(b"{") <= cap:  # the common case: no deeper than its brackets
        return cap
    depth = deepest = 0
    in_str = esc = False
    for c in body:
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == 0x5C, c != 0x22)
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > cap:
                return deepest
        elif c in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _strings(obj: Any) -> Any:
    """Every string (keys included) in a parsed JSON value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _parse(model: type, body: bytes) -> Any:
    """Body -> validated request: size and depth caps before parsing, valid Unicode after."""
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body has {len(body)} bytes; at most {MAX_BODY_BYTES} are accepted")
    if _nesting(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ApiError(422, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"Failed to parse the request body as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(422, f"Failed to deserialize the JSON body: expected an object, got {type(data).__name__}")
    for text in _strings(data):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\\ud800") is valid JSON, not valid text
            raise ApiError(422, f"the request holds invalid Unicode: {exc.reason} at character {exc.start} of a "
                                "string") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, validation_message(exc)) from None


@dataclass
class Prepared:
    ids: list[int]
    params: GenerateParameters
    row: RowRequest
    seed: int | None


TENANT_HEADER = "x-tenant"
MAX_TENANT_CHARS = 128


def tenant_of(request: Any) -> str | None:
    """The request's tenant (header ``X-Tenant``): proposers with cross-request memory
    (``suffix`` with ``scope: tenant``) only reuse text of requests with the same tenant."""
    t = request.headers.get(TENANT_HEADER)
    if t is not None and len(t) > MAX_TENANT_CHARS:
        raise ApiError(422, f"the X-Tenant header has {len(t)} characters; at most {MAX_TENANT_CHARS} are accepted")
    return t


def prepare(state: Any, ids: list[int], params: GenerateParameters, key: int, tenant: str | None = None) -> Prepared:
    """Token limits and sampling, with TGI's messages."""
    if params.truncate is not None:
        ids = ids[-params.truncate:]
    n_in = len(ids)
    if n_in == 0:
        raise ApiError(422, "`inputs` cannot be empty")
    if n_in > state.max_input_tokens:
        raise ApiError(422, f"`inputs` tokens must be <= {state.max_input_tokens} (--max-input-tokens). "
                            f"Given: {n_in}")
    room = state.max_total_tokens - n_in
    max_new = params.max_new_tokens if params.max_new_tokens is not None else min(room, DEFAULT_MAX_NEW_TOKENS)
    if n_in + max_new > state.max_total_tokens:
        raise ApiError(422, f"`inputs` tokens + `max_new_tokens` must be <= {state.max_total_tokens}. "
                            f"Given: {n_in} `inputs` tokens and {max_new} `max_new_tokens`")
    seed = None
    if params.sampling:
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        sampling = SamplingConfig(temperature=params.temperature or 1.0, top_k=params.top_k, top_p=params.top_p,
                                  repetition_penalty=params.repetition_penalty, seed=seed)
    else:
        sampling = SamplingConfig(temperature=0.0, repetition_penalty=params.repetition_penalty, seed=None)
    return Prepared(ids, params, RowRequest(key, ids, max_new, sampling, seed, logprobs=True, tenant=tenant), seed)


def encode_text(state: Any, text: str) -> list[int]:
    return list(state.tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_chat(state: Any, req: ChatRequest) -> list[int]:
    tok = state.tokenizer
    msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    raise ApiError(422, "this model's tokenizer has no chat template; use /generate")
