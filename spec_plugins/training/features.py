"""Target features for drafter training, written in resumable 16-bit shards.

One target forward over each whole conversation (prefill speed, no generation) gives, for every
position j:
- ``hidden``  [N, H]    the last hidden state after the final norm (what the LM head reads);
- ``layers``  [N, L, H] the outputs of a few decoder layers (low, mid, high: EAGLE-3's fused input);
- ``lse``     [N]       logsumexp of the target's full-vocabulary logits, so the trainer can
                        rebuild the target's exact next-token probabilities over any draft
                        vocabulary from ``hidden`` alone: p(v) = exp(w_v . h - lse) (soft labels
                        without storing 49k floats per position);
- ``top1``    [N]       the target's greedy next token (for top-1 accuracy).
``tokens``, ``trained`` (the assistant wrote the token) and ``offsets`` delimit the conversations.
``hidden`` and ``layers`` are stored in fp16, or in bf16 where their values pass fp16's range
(``compact``: Gemma-3's layer outputs do), per shard; readers cast them to float32.

The extraction is resumable: ``progress.json`` records the shards written and the conversations
consumed, each shard is written atomically, and a rerun continues where the last one stopped.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Protocol, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from spec_plugins.training.heldout import check_heldout  # noqa: F401 (imported from here too)
from spec_plugins.files import write_atomic

FORMAT = "spec-plugins-features/1"
FEATURES_AGAIN = "extract the features again into a new --out (`spec-plugins train features`)"


@dataclass
class Shard:
    """One shard: conversations flattened, row i spans offsets[i]:offsets[i+1]."""

    tokens: torch.Tensor  # [N] long
    trained: torch.Tensor  # [N] bool
    offsets: torch.Tensor  # [S+1] long
    hidden: torch.Tensor  # [N, H] fp16 or bf16 (``compact``)
    layers: torch.Tensor  # [N, L, H] fp16 or bf16 (L may be 0)
    lse: torch.Tensor  # [N] fp32
    top1: torch.Tensor  # [N] long

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def span(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def save(self, path: Path) -> None:
        t = {"tokens": self.tokens, "trained": self.trained.to(torch.uint8), "offsets": self.offsets,
             "hidden": self.hidden.contiguous(), "layers": self.layers.contiguous(), "lse": self.lse, "top1": self.top1}
        write_atomic(path, lambda tmp: save_file(t, str(tmp), metadata={"format": FORMAT}))

    @classmethod
    def load(cls, path: Path) -> "Shard":
        with shard_errors(path):
            t = load_file(str(path))
            return cls(t["tokens"].long(), t["trained"].bool(), t["offsets"].long(), t["hidden"], t["layers"],
                       t["lse"].float(), t["top1"].long())

    @staticmethod
    def concat(parts: Sequence["Shard"]) -> "Shard":
        offs, base = [torch.zeros(1, dtype=torch.long)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += p.num_tokens
        cat = lambda name: _cat_same_dtype([getattr(p, name) for p in parts])  # noqa: E731
        return Shard(cat("tokens"), cat("trained"), torch.cat(offs), cat("hidden"), cat("layers"), cat("lse"),
                     cat("top1"))


@contextmanager
def shard_errors(path: Path, what: str = "feature shard", again: str = FEATURES_AGAIN) -> Iterator[None]:
    """Shard ``path`` read: missing or corrupt (an interrupted copy), a ValueError naming it (as load_head)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - safetensors' or numpy's own error, a missing file or tensor name
        raise ValueError(f"{what} {path} cannot be read ({type(exc).__name__}: {exc}); {again} or copy them again") from None


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the 16-bit dtype that holds it: fp16 (finer) where every value fits its range, else
    bf16 (float32's range), so a target with outputs past fp16's 65504 (Gemma-3's massive
    activations) is stored finite instead of as inf; a bf16 tensor stays bf16 (fp16 adds nothing)."""
    if t.dtype == torch.bfloat16 or (t.numel() and float(t.abs().max()) > torch.finfo(torch.float16).max):
        return t.to(torch.bfloat16)
    return t.half()


def _cat_same_dtype(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Parts joined in their one dtype; parts ``compact`` stored in fp16 and bf16 join in bf16,
    which holds both (torch.cat would promote them to float32, twice the size)."""
    dtypes = {p.dtype for p in parts}
    dt = dtypes.pop() if len(dtypes) == 1 else torch.bfloat16
    return torch.cat([p.to(dt) for p in parts])


@torch.inference_mode()
def target_outputs(model: Any, ids: torch.Tensor, layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """One forward over ``ids`` [1, T]: final-normed hidden, the chosen layer outputs (float32),
    lse and top-1."""
    return {k: v.float() if v.is_floating_point() else v
            for k, v in batch_outputs(model, ids, [ids.shape[1]], layers).items()}


@torch.inference_mode()
def batch_outputs(model: Any, ids: torch.Tensor, lengths: Sequence[int], layers: Sequence[int],
                  logit_rows: int = 8192) -> dict[str, torch.Tensor]:
    """One forward over right-padded rows ``ids`` [B, T] (row b is real up to ``lengths[b]``):
    the outputs at the real positions, row after row ([N] / [N, H], N = sum of lengths). Padding
    sits after every real position, so causal attention never reads it: no mask is needed.
    Hidden states keep the model's dtype; lse and top-1 come from float32 logits, computed
    ``logit_rows`` positions at a time (a GPU batch of 64k positions would need 13 GB at once)."""
    check_plain_head(model, ids[:1, : lengths[0]])
    out = model.get_decoder()(input_ids=ids, output_hidden_states=bool(layers))
    real = torch.arange(ids.shape[1], device=ids.device)[None, :] < torch.tensor(lengths, device=ids.device)[:, None]
    h = out.last_hidden_state[real]  # [N, H]
    sel = (torch.stack([out.hidden_states[i][real] for i in layers], 1) if layers
           else h.new_zeros(h.shape[0], 0, h.shape[1]))
    w = model.get_output_embeddings().weight.float()  # no bias: check_plain_head refuses one
    lse, top1 = [], []
    for a in range(0, h.shape[0], logit_rows):
        logits = torch.nn.functional.linear(h[a: a + logit_rows].float(), w)
        lse.append(torch.logsumexp(logits, -1))
        top1.append(logits.argmax(-1))
    outs = {"hidden": h, "layers": sel, "lse": torch.cat(lse), "top1": torch.cat(top1)}
    check_finite_outputs(model, outs)
    return outs


def check_finite_outputs(model: Any, outs: dict[str, torch.Tensor]) -> None:
    """Refuse target outputs with inf or NaN (activations that overflow the dtype the target runs
    in): stored, they make every loss that reads them NaN and the trained head NaN."""
    names = [n for n in ("logits", "hidden", "layers", "lse") if n in outs]
    finite = torch.stack([outs[n].isfinite().all() for n in names]).tolist()  # one device sync
    bad = [n for n, ok in zip(names, finite) if not ok]
    if bad:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        raise ValueError(f"{type(model).__name__} produced non-finite values (inf or NaN) in its {', '.join(bad)} "
                         f"running in {dtype}: its activations overflow that dtype; features of them would train "
                         "a NaN head (run the target in float32, or check its weights)")


_PLAIN_HEAD: "weakref.WeakSet[Any]" = weakref.WeakSet()  # models whose logits were found to be linear(h, head)


@torch.inference_mode()
def check_plain_head(model: Any, ids: torch.Tensor, probe: int = 64) -> None:
    """Refuse a model whose logits are not its LM head's product: lse, top-1 and the trainer's soft
    labels p(v) = exp(w_v . h - lse) rebuild them as h @ head.weight.T, which a transform after the
    head (Granite's logits_scaling, Gemma-2's soft-capping, Cohere's logit_scale) or a head bias
    (Phi's) makes another distribution. Compared numerically on the first ``probe`` tokens of
    ``ids`` [1, T], once per model, so any such model is caught whatever its config calls the
    transform; a bias is refused by name."""
    if model in _PLAIN_HEAD:
        return
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias (lm_head.bias, as Phi's has): the trainer's "
                         "soft labels p(v) = exp(w_v . h - lse) and the drafters' logits read the head's weight "
                         "without it, so they would not be its distribution; this target cannot be trained on")
    ids = ids[:1, :probe]
    own = model(input_ids=ids, use_cache=False).logits
    check_finite_outputs(model, {"logits": own})  # NaN logits would pass for a transform after the head
    mine = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state)
    tol = max(1e-4, 4 * torch.finfo(mine.dtype).eps)  # the same ops in the model's dtype: a rounding apart
    err = float((own.float() - mine.float()).abs().max())
    if not err <= tol * (1.0 + float(own.float().abs().max())):
        raise ValueError(f"{type(model).__name__}'s logits are not its LM head's product linear(h, lm_head) (they "
                         f"differ by up to {err:.3g}: a scaling or soft-capping after the head, such as Granite's "
                         "logits_scaling or Gemma-2's final_logit_softcapping); features rebuilt from the LM head "
                         "would not be its distribution, so this target cannot be trained on")
    _PLAIN_HEAD.add(model)


def resume_state(out: Path, meta: dict) -> dict | None:
    """The progress of an earlier extraction into ``out`` (None if there is none), refused when it
    was made with other settings: a rerun only continues the same extraction. The target is
    compared as a model, by name and by its weights' fingerprint (``target_check.rerun_meta``)."""
    from spec_plugins.training.target_check import rerun_meta
    from spec_plugins.training.trainer import differences

    path = Path(out) / "progress.json"
    state = json.loads(path.read_text()) if path.is_file() else None
    if state is None:
        return None
    meta = rerun_meta(state["meta"], meta)
    if state["meta"] != meta:
        raise ValueError(f"{out} holds features made with other settings ({'; '.join(differences(state['meta'], meta))}); "
                         "use a new --out directory")
    return state


def recorded_path(name: str) -> str:
    """What a directory records for a model or data path: an existing local path made absolute,
    so what it names loads from any working directory; a built-in model name as it is."""
    from spec_plugins.models import BUILTIN_MODELS

    p = Path(name).expanduser()
    return name if name in BUILTIN_MODELS or not p.exists() else str(p.resolve())


class ShardWriter:
    """Accumulates conversations and writes a shard every ``shard_tokens`` tokens; progress is
    checkpointed with each shard so an interrupted run resumes after the last shard."""

    def __init__(self, out: Path, meta: dict, shard_tokens: int) -> None:
        self.out, self.shard_tokens = out, shard_tokens
        out.mkdir(parents=True, exist_ok=True)
        self.progress_path = out / "progress.json"
        state = resume_state(out, meta)
        self.state = state or {"meta": meta, "shards": [], "consumed": 0, "tokens": 0, "trained_tokens": 0,
                               "conversations": 0, "seconds": 0.0, "exhausted": False}
        self._parts: list[Shard] = []
        self._pending_consumed = self.state["consumed"]
        self._t_last = time.perf_counter()  # each checkpoint carries the time spent since the last

    @property
    def tokens(self) -> int:
        return self.state["tokens"] + sum(p.num_tokens for p in self._parts)

    def add(self, tokens: Sequence[int], trained: Sequence[bool], outs: dict[str, torch.Tensor], consumed: int) -> None:
        n = len(tokens)
        self._parts.append(Shard(torch.tensor(tokens, dtype=torch.long), torch.tensor(trained, dtype=torch.bool),
                                 torch.tensor([0, n], dtype=torch.long), compact(outs["hidden"]),
                                 compact(outs["layers"]), outs["lse"], outs["top1"]))
        self._pending_consumed = consumed
        if sum(p.num_tokens for p in self._parts) >= self.shard_tokens:
            self.flush()

    def skip(self, consumed: int) -> None:
        """Conversations read but not kept still advance the resume point."""
        self._pending_consumed = consumed

    def flush(self, exhausted: bool = False) -> None:
        st = self.state
        now = time.perf_counter()
        if self._parts:
            shard = Shard.concat(self._parts)
            name = f"shard-{len(st['shards']):05d}.safetensors"
            shard.save(self.out / name)
            st["shards"].append(name)
            st["tokens"] += shard.num_tokens
            st["trained_tokens"] += int(shard.trained.sum())
            st["conversations"] += len(shard)
            self._parts = []
        st["consumed"] = self._pending_consumed
        st["seconds"] = round(st["seconds"] + now - self._t_last, 3)
        self._t_last = now
        st["exhausted"] = exhausted  # every example was read: a bigger budget adds nothing
        write_atomic(self.progress_path, lambda tmp: tmp.write_text(json.dumps(st, indent=1) + "\n"))


def extract(model: Any, examples: Iterable[tuple[list[int], list[bool]]], out: Path, meta: dict,
            layers: Sequence[int], max_tokens: int, shard_tokens: int = 32768, progress: bool = True,
            skipped: int = 0) -> dict:
    """Run the target over ``examples`` ((ids, trained mask) per conversation, in a fixed order)
    until ``max_tokens`` tokens are written; resumes from ``out/progress.json`` (an interrupted
    run, or a finished one given a bigger budget). ``skipped``: ``examples`` already leaves out
    that many examples from its start, which must be those an earlier run consumed (a source
    that skips them before making them: regenerating answers is slow)."""
    from tqdm.auto import tqdm

    made = next((p for p in reversed([Path(out), *Path(out).parents]) if not p.exists()), None)
    writer = ShardWriter(Path(out), meta, shard_tokens)
    if writer.tokens and (writer.state.get("exhausted") or writer.tokens >= max_tokens):
        return writer.state
    start_consumed = writer.state["consumed"]
    if skipped not in (0, start_consumed):
        raise ValueError(f"the examples start after {skipped} examples, but {out} resumes after {start_consumed}")
    bar = tqdm(total=max_tokens, initial=writer.tokens, unit="tok", desc="target features", disable=not progress,
               dynamic_ncols=True)
    dev = next(model.parameters()).device
    consumed = skipped
    exhausted = True
    for consumed, (ids, trained) in enumerate(examples, start=skipped + 1):
        if consumed <= start_consumed:
            continue
        if writer.tokens >= max_tokens:
            exhausted = False
            consumed -= 1
            break
        cut = writer.tokens + len(ids) > max_tokens
        ids = ids[: max_tokens - writer.tokens] if cut else ids
        trained = trained[: len(ids)]
        if len(ids) < 2 or not any(trained):
            if cut:  # the budget's remainder holds no answer token: the budget is spent
                exhausted = False
                consumed -= 1
                break
            writer.skip(consumed)
            continue
        outs = target_outputs(model, torch.tensor([ids], device=dev), layers)
        writer.add(ids, trained, {k: v.cpu() for k, v in outs.items()}, consumed)
        bar.update(len(ids))
    bar.close()
    if not writer.tokens:  # no reader takes a store without shards: refused, as write_token_shards does
        if made is not None:
            shutil.rmtree(made)
        raise ValueError("no conversation to write: none holding an answer (an assistant token, 2 tokens or more) "
                         f"within the budget of {max_tokens} tokens; {out} left as it was")
    writer.skip(consumed)
    writer.flush(exhausted=exhausted)
    return writer.state


class ShardSource(Protocol):
    """What the trainers read: shards by index, their token arrays without features (``read``),
    whole shards with features (``load``). ``FeatureStore`` reads them from disk;
    ``live.LiveFeatures`` computes the features on demand from token shards."""

    directory: Path
    shards: list[Path]
    meta: dict

    @property
    def tokens(self) -> int: ...

    def load(self, i: int) -> Shard: ...

    def read(self, i: int, names: Sequence[str]) -> dict[str, torch.Tensor]: ...


class ShardDirectory:
    """What a directory of shards says of itself (its state file: ``meta``, ``tokens``, the shard
    list), and loading shard i as its shard type. Features and token shards alike."""

    shard_type: ClassVar[Any]
    state: dict
    shards: list[Path]

    @property
    def meta(self) -> dict:
        return self.state["meta"]

    @property
    def tokens(self) -> int:
        return int(self.state["tokens"])

    def load(self, i: int) -> Any:
        return self.shard_type.load(self.shards[i])


class FeatureStore(ShardDirectory):
    """The shards of one extraction, read one at a time (the trainer streams them)."""

    shard_type = Shard

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        prog = self.directory / "progress.json"
        if not prog.is_file():
            raise FileNotFoundError(f"no features in {self.directory} (no progress.json); run "
                                    "`spec-plugins train features` first")
        self.state = json.loads(prog.read_text())
        self.shards = [self.directory / s for s in self.state["shards"]]
        if not self.shards:
            raise ValueError(f"{self.directory} has no feature shards yet")

    def read(self, i: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Some tensors of shard i (e.g. ``offsets``, ``trained``) without loading its features."""
        with shard_errors(self.shards[i]), safe_open(str(self.shards[i]), framework="pt") as f:
            return {n: f.get_tensor(n) for n in names}

    @property
    def hidden_size(self) -> int:
        """The target's hidden width, read from the first shard's header."""
        with shard_errors(self.shards[0]), safe_open(str(self.shards[0]), framework="pt") as f:
            return int(f.get_slice("hidden").get_shape()[1])

    def iter_shards(self, order: Sequence[int] | None = None) -> Iterator[Shard]:
        for i in order if order is not None else range(len(self.shards)):
            yield self.load(i)

    def limit_shards(self, max_tokens: int | None) -> list[int]:
        """Shard indices covering the first ``max_tokens`` tokens (all if None): a data-size
        sweep trains on prefixes of one extraction."""
        if max_tokens is None:
            return list(range(len(self.shards)))
        per = max(1, self.tokens // len(self.shards))
        return list(range(min(len(self.shards), max(1, math.ceil(max_tokens / per)))))
