"""Pieces shared by the heads: the frozen target LM head restricted to a draft vocabulary,
and the on-disk format (``head.safetensors`` + ``config.json``).

Draft vocabulary: a head scores only the tokens seen in its training data (FR-Spec style). On
SmolLM2 the full LM head (49152 x 576) costs about as much as a quarter of the target per
token, so a 8k-token draft vocabulary makes drafting several times cheaper; exactness is
unaffected because drafts are only ever proposals.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spec_plugins.transfer import HOST


def config_number(name: str, value: Any, integer: bool, least: float | None = 0, strict: bool = True) -> Any:
    """``value`` as an int (``integer``) or a finite float above ``least`` (at least it, without
    ``strict``; None: any, the caller checks the range); else a ValueError naming the field. A head's config.json is checked when read,
    not at the first draft; a string or a bool is not a number here, whatever Python would coerce."""
    kind = numbers.Integral if integer else numbers.Real
    number = isinstance(value, kind) and not isinstance(value, bool)
    low = least is None or (value > least if strict else value >= least) if number else False
    if not number or not (low and -math.inf < value < math.inf):
        noun = "integer" if integer else "finite number"
        what = (f"{'an' if integer else 'a'} {noun}" if least is None else f"a positive {noun}" if strict and least == 0
                else f"{'an' if integer else 'a'} {noun} {'above' if strict else 'of at least'} {least:g}")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value) if integer else float(value)


def config_flag(name: str, value: Any) -> bool:
    """``value`` as a bool; else a ValueError naming the field (the string "false" is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device or "cpu", dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def target_lm_parts(target: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM head weight [V, H], input embedding weight [V, H]), detached, of a transformers causal
    LM, of a runtime that holds one (``.model``), or of a runtime without one (an exported
    graph) through the model it was exported from (``.source_model``), loaded once here."""
    if isinstance(target, tuple):
        return target
    model = target if hasattr(target, "get_output_embeddings") else getattr(target, "model", None)
    caps = getattr(target, "capabilities", None)
    if model is None and caps is not None and not caps.hidden_states:
        raise ValueError(f"a trained head drafts from the target's hidden states, which the {caps.name or 'target'} "
                         "runtime does not return; use a proposer that needs none (ngram, suffix, recycling, "
                         "lookahead, a draft model) on this runtime")
    if model is None:
        source = getattr(target, "source_model", None)
        if source is None:
            raise ValueError(f"a trained head shares the target's LM head and embeddings, but the "
                             f"{type(target).__name__} target has neither a transformers model nor a source model")
        from spec_plugins.backends.torch_runtime import load_hf

        model, _ = load_hf(source, "float32", "cpu")
    return model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()


def draft_vocab(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """``size`` token ids (ascending): those seen in the training responses, most frequent first,
    then filled with the lowest ids (BPE vocabularies put frequent merges first), so tokens the
    small training set missed (other languages, code) can still be drafted."""
    size = min(size, token_counts.numel())
    seen = int((token_counts > 0).sum())
    order = torch.argsort(token_counts.float(), descending=True, stable=True)
    picked = order[: min(seen, size)]
    if picked.numel() < size:
        rest = torch.ones(token_counts.numel(), dtype=torch.bool)
        rest[picked] = False
        picked = torch.cat([picked, rest.nonzero().squeeze(1)[: size - picked.numel()]])
    return picked.sort().values


@dataclass(frozen=True)
class HeadFiles:
    """A trained head on disk: ``<dir>/head.safetensors`` and ``<dir>/config.json``."""

    directory: Path

    @property
    def weights(self) -> Path:
        return self.directory / "head.safetensors"

    @property
    def config(self) -> Path:
        return self.directory / "config.json"

    def exists(self) -> bool:
        return self.weights.is_file() and self.config.is_file()


def save_head(module: nn.Module, config: dict, directory: str | Path, dtype: torch.dtype = torch.float16) -> HeadFiles:
    """Write trainable weights (+ the draft vocabulary) as safetensors and the config as JSON.
    The frozen target tensors (LM head, embeddings) are not written: they come from the target,
    so the config records a sample of them (``target_fingerprint``) that loading checks.
    A ``target`` name in ``config`` is what the refusal names as the head's target.
    Each file is written whole or not at all (``files.write_atomic``): a full disk leaves the
    earlier file (if any) and no half-written one, and raises ``WriteError`` naming the file."""
    from safetensors.torch import save_file

    from spec_plugins.files import write_atomic

    files = HeadFiles(Path(directory))
    files.directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
             for k, v in module.state_dict().items()}
    meta = {"kind": str(config.get("kind", ""))}
    write_atomic(files.weights, lambda tmp: save_file(state, str(tmp), metadata=meta))
    sample = target_fingerprint(module)
    text = json.dumps(config if sample is None else {**config, FINGERPRINT: sample}, indent=2, sort_keys=True) + "\n"
    write_atomic(files.config, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return files


def load_head(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state dict) of a saved head; raises FileNotFoundError naming what is missing."""
    from safetensors.torch import load_file

    files = HeadFiles(Path(directory))
    if not files.exists():
        raise FileNotFoundError(f"no trained head in {files.directory} (need head.safetensors and config.json); "
                                "train one with `spec-plugins train {medusa,eagle,parallel} --features DIR --out DIR`")
    try:
        cfg = json.loads(files.config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{files.config} is not a head config: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{files.config} is not a head config: expected a JSON object")
    try:
        state = load_file(str(files.weights))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a corrupt file
        raise ValueError(f"{files.weights} cannot be read as safetensors ({type(exc).__name__}: {exc}); "
                         "retrain or copy the head again") from None
    for name, tensor in state.items():
        problem = tensor_problem(name, tensor)
        if problem:
            raise ValueError(f"{files.weights}: tensor {name!r} {problem}; retrain or copy the head again")
    for name in ID_TENSORS:  # ids of any integer width, as every kind indexes with them
        if name in state:
            state[name] = state[name].to(torch.int64)
    return cfg, state


ID_TENSORS = ("vocab_ids",)  # the heads' only saved index tensor: rows of the target's LM head
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor_problem(name: str, tensor: torch.Tensor) -> str | None:
    """Why a saved head tensor cannot be loaded as it is, or None. load_state_dict casts whatever
    it gets: float ids would truncate to other tokens, integer weights would turn into floats, and
    repeated ids draft the same token as several siblings. The ids' range is the target's
    vocabulary (``check_target_fit``)."""
    if name in ID_TENSORS:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            return f"holds token ids as {tensor.dtype}; they must be stored as integers"
        if tensor.dim() != 1:
            return f"must be one-dimensional, got shape {tuple(tensor.shape)}"
        distinct = tensor.to(torch.int64).unique().numel()  # unsigned widths have no unique() of their own
        if distinct != tensor.numel():
            return f"repeats token ids ({tensor.numel() - distinct} duplicates); each draft token must be distinct"
        return None
    if tensor.dtype not in FLOAT_DTYPES:
        return f"is stored as {tensor.dtype}; weights must be float16, bfloat16, float32 or float64"
    return None


def check_target_fit(hidden_size: int, vocab_ids: torch.Tensor, lm_weight: torch.Tensor,
                     embed_weight: torch.Tensor | None = None, config: dict | None = None, target: Any = None) -> None:
    """Refuse a head trained for another target before it drafts: its hidden size must be the
    width of the target's LM head ``lm_weight`` [V, H], its draft vocabulary rows of it, and
    the sample of the target's tensors its ``config`` records (``target_fingerprint``; a head
    saved without one is checked on shapes only) must match ``lm_weight`` and ``embed_weight``.
    Another model of the same shapes loads otherwise and drafts tokens its target rejects."""
    if hidden_size != lm_weight.shape[1]:
        raise ValueError(f"it was trained for a target of hidden size {hidden_size}, this target's is "
                         f"{lm_weight.shape[1]}")
    if vocab_ids.numel():
        low, high = int(vocab_ids.min()), int(vocab_ids.max())
        if low < 0 or high >= lm_weight.shape[0]:
            raise ValueError(f"its draft vocabulary holds token {low if low < 0 else high}, outside this target's "
                             f"vocabulary of {lm_weight.shape[0]}")
    sample = (config or {}).get(FINGERPRINT)
    if sample is None:
        return
    rows, cols, recorded = fingerprint_field(sample, lm_weight.shape)
    worst, where = 0.0, ""
    for name, tensor in (("lm_head", lm_weight), ("embed", embed_weight)):
        if name in recorded and tensor is not None:
            err = relative_gap(torch.tensor(_entries(tensor, rows, cols), device=HOST), recorded[name])
            if err > worst:
                worst, where = err, {"lm_head": "LM head", "embed": "embedding"}[name]
    if worst > FINGERPRINT_TOLERANCE:
        trained = (config or {}).get("target")
        raise ValueError(f"it was trained for {f'target {trained!r}' if trained else 'another target'}, not for "
                         f"{target_name(target)}: the {where} values its config.json records ({FINGERPRINT}) differ "
                         f"from this target's by {worst:.0%} of their size, more than the {FINGERPRINT_TOLERANCE:.0%} "
                         "allowed for a bf16 or quantized copy of the same weights; train a head for this target")


FINGERPRINT = "target_fingerprint"  # the config.json field
FINGERPRINT_SIZE = 48  # sampled entries of each tensor
# largest relative L2 gap accepted: quantization to 2-4 bits moves the sample less than this (its
# sampling spread included), another model's weights (even of the same shapes) by about their own size
FINGERPRINT_TOLERANCE = 0.6


def target_fingerprint(module: nn.Module) -> dict | None:
    """A fixed sample of the target tensors a head was built with: ``FINGERPRINT_SIZE`` entries
    (draft-vocabulary rows, seeded columns) of its LM head rows ``lm_weight`` (row i is token
    ``vocab_ids[i]``) and, where it holds them, its embeddings, as floats (JSON), so a load on a
    target of another dtype or device can compare them; None for a module without them."""
    ids, lm = getattr(module, "vocab_ids", None), getattr(module, "lm_weight", None)
    if not isinstance(ids, torch.Tensor) or not isinstance(lm, torch.Tensor) or not ids.numel():
        return None
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(ids.numel(), (FINGERPRINT_SIZE,), generator=gen, device=HOST)
    cols = torch.randint(lm.shape[1], (FINGERPRINT_SIZE,), generator=gen, device=HOST)
    rows = ids.detach().cpu()[pos]
    sample = {"rows": rows.tolist(), "cols": cols.tolist(), "lm_head": _entries(lm, pos, cols)}
    emb = getattr(module, "embed_weight", None)
    if isinstance(emb, torch.Tensor):
        sample["embed"] = _entries(emb, rows, cols)
    return sample


def _entries(weight: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> list[float]:
    """``weight[rows, cols]`` as floats, gathered where ``weight`` lives (not copied whole)."""
    values = weight.detach()[rows.to(weight.device), cols.to(weight.device)]
    return [float(f"{v:.7g}") for v in values.float().cpu().tolist()]


def fingerprint_field(sample: Any, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(rows, cols, {tensor name: recorded values}) of a config's ``target_fingerprint``, checked
    as read (a hand-edited one is refused naming the field); entries outside a target of
    ``shape`` [V, H] mean another target."""
    if not isinstance(sample, dict) or not isinstance(sample.get("rows"), list) or not sample["rows"]:
        raise ValueError(f"{FINGERPRINT} must be an object with non-empty rows, cols and lm_head lists")
    n = len(sample["rows"])
    index = {}
    for axis, name in enumerate(("rows", "cols")):
        got = sample.get(name)
        if not isinstance(got, list) or len(got) != n:
            raise ValueError(f"{FINGERPRINT}.{name} must be a list of {n} indices, got {got!r}")
        index[name] = [config_number(f"{FINGERPRINT}.{name}[{i}]", x, True, 0, strict=False) for i, x in enumerate(got)]
        if max(index[name]) >= shape[axis]:
            raise ValueError(f"it was trained for another target: its {FINGERPRINT} samples "
                             f"{name} {max(index[name])}, outside this target's LM head of shape {list(shape)}")
    values = {}
    for name in ("lm_head", "embed"):
        got = sample.get(name)
        if got is None and name == "embed":
            continue
        if not isinstance(got, list) or len(got) != n:
            raise ValueError(f"{FINGERPRINT}.{name} must be a list of {n} numbers, got {got!r}")
        values[name] = torch.tensor([config_number(f"{FINGERPRINT}.{name}[{i}]", x, False, None)
                                     for i, x in enumerate(got)], device=HOST)
    return torch.tensor(index["rows"], device=HOST), torch.tensor(index["cols"], device=HOST), values


def relative_gap(have: torch.Tensor, recorded: torch.Tensor) -> float:
    """||have - recorded|| / ||recorded||: dtype rounding and quantization keep it small whatever
    the values' scale; where ``recorded`` is all zeros: 0 if ``have`` is too, else inf (as for NaN)."""
    size, gap = float(recorded.norm()), float((have - recorded).norm())
    if math.isnan(gap):
        return math.inf
    return gap / size if size > 0 else (0.0 if gap == 0 else math.inf)


def target_name(target: Any) -> str:
    """How a refusal names the target given: its model's name or path where it has one."""
    model = target if hasattr(target, "get_output_embeddings") else getattr(target, "model", None)
    name = getattr(target, "source_model", None) or getattr(getattr(model, "config", None), "name_or_path", None)
    return f"target {name!r}" if name else "this target"


def a_or_an(word: str) -> str:
    """``word`` with its indefinite article, by its first letter (an eagle, a medusa)."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def build_head(kind: str, directory: str | Path, build: Any, found: Any = None) -> Any:
    """``build()`` a head from a saved directory; a head of another kind (``found``: its config.json's
    ``kind``, None where it names none) or of another model fails with one line naming the
    directory, and the kind it holds, instead of a deep KeyError / size mismatch. The error's lines
    are joined, not cut to the first: torch's load_state_dict names the tensor and both shapes (or
    the missing keys) only after its heading line."""
    if found is not None and found != kind:
        raise ValueError(f"{directory} does not hold {a_or_an(kind)} head: it holds {a_or_an(found)} head (its "
                         f"config.json says kind {found!r}); load it with proposer type {found}, or give a directory "
                         f"of {a_or_an(kind)} head")
    try:
        return build()
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise ValueError(f"{directory} does not hold {a_or_an(kind)} head for this model "
                         f"({type(exc).__name__}: {why if len(why) <= 500 else why[:497] + '...'})") from None
