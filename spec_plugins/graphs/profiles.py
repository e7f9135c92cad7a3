"""Optimisation profiles and binding shapes for TensorRT engines of the verify-graph layout.

TensorRT needs, per dynamic input, a min/opt/max shape at build time, and the exact shape of
every input at run time. The verify graph (``exporters/onnx_verify.py``) has four symbolic
axes: ``B`` (batch), ``N`` (new positions), ``P`` (past slots) and ``T = P + N``. Everything
here is arithmetic on those symbols, so it is tested without TensorRT or a GPU.

Two profiles: ``decode`` (N = 1..max_draft+1, the verify/draft step) and ``prefill``
(N = 1..prefill_chunk, prompts in chunks). ``P`` counts slots, holes included; the runtime
compacts holes before the slot axis outgrows ``max_context``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

SYMBOLS = ("B", "N", "P", "T")
Range = tuple[int, int, int]  # (min, opt, max)
Shape = tuple[int, ...]


class ProfileError(ValueError):
    """Limits that no engine can satisfy, or a step outside the engine's profiles."""


@dataclass(frozen=True)
class Limits:
    """What an engine is built to hold; every check names the flag that changes it."""

    max_batch: int = 1
    max_draft: int = 8  # draft nodes per step (the step runs max_draft + 1 positions)
    max_context: int = 2048  # positions (= past slots) the engine holds
    prefill_chunk: int | None = None  # prompt tokens per prefill call (default min(512, max_context))
    opt_batch: int = 1
    opt_context: int | None = None  # past length TensorRT tunes for (default max_context // 2)

    def __post_init__(self) -> None:
        if self.prefill_chunk is None:
            object.__setattr__(self, "prefill_chunk", min(512, self.max_context))
        if self.max_batch < 1:
            raise ProfileError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_draft < 1:
            raise ProfileError(f"--max-draft must be >= 1 (draft nodes per step), got {self.max_draft}")
        if self.max_context < self.max_draft + 2:
            raise ProfileError(
                f"--max-context {self.max_context} is too small for --max-draft {self.max_draft}: a step needs "
                f"at least one cached token plus {self.max_draft + 1} new positions "
                f"(max_context >= {self.max_draft + 2})")
        if not 1 <= self.prefill_chunk <= self.max_context:
            raise ProfileError(f"--prefill-chunk must be in 1..max_context ({self.max_context}), "
                               f"got {self.prefill_chunk}")
        if not 1 <= self.opt_batch <= self.max_batch:
            raise ProfileError(f"opt batch {self.opt_batch} must be in 1..max_batch ({self.max_batch})")
        if self.opt_context is not None and not 0 <= self.opt_context <= self.max_context:
            raise ProfileError(f"opt context {self.opt_context} must be in 0..max_context ({self.max_context})")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Profile:
    """One optimisation profile: a range per symbol, hence a min/opt/max shape per input."""

    name: str
    ranges: Mapping[str, Range]  # symbol -> (min, opt, max)

    def shapes(self, inputs: Sequence[Mapping]) -> dict[str, tuple[Shape, Shape, Shape]]:
        """(min, opt, max) shape of every input of a graph (manifest ``inputs`` entries)."""
        return {i["name"]: tuple(resolve(i["shape"], {s: r[k] for s, r in self.ranges.items()}, i["name"])
                                 for k in range(3)) for i in inputs}  # type: ignore[misc]

    def admits(self, dims: Mapping[str, int]) -> bool:
        return all(lo <= dims[s] <= hi for s, (lo, _, hi) in self.ranges.items() if s in dims)

    def to_dict(self) -> dict:
        return {"name": self.name, "ranges": {s: list(r) for s, r in self.ranges.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Profile":
        return cls(d["name"], {s: (int(r[0]), int(r[1]), int(r[2])) for s, r in d["ranges"].items()})


def profiles(limits: Limits) -> list[Profile]:
    """``decode`` first (the hot path picks it without searching), then ``prefill`` when its
    chunk is longer than a step."""
    L, step = limits.max_context, limits.max_draft + 1
    b = (1, limits.opt_batch, limits.max_batch)
    p_opt = limits.opt_context if limits.opt_context is not None else L // 2
    out = [Profile("decode", {"B": b, "N": (1, step, step), "P": (0, p_opt, L), "T": (1, p_opt + step, L + step)})]
    c = int(limits.prefill_chunk or step)
    if c > step:
        out.append(Profile("prefill", {"B": b, "N": (1, c, c), "P": (0, 0, L), "T": (1, c, L + c)}))
    return out


def resolve(shape: Sequence[int | str], dims: Mapping[str, int], name: str = "tensor") -> Shape:
    """Concrete shape of a manifest shape (ints and symbols); ``T`` defaults to ``P + N``."""
    env = dict(dims)
    if "T" not in env and "P" in env and "N" in env:
        env["T"] = env["P"] + env["N"]
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif d in env:
            out.append(int(env[d]))
        else:
            raise ProfileError(f"{name}: unknown dynamic axis {d!r} (known: {', '.join(SYMBOLS)})")
    return tuple(out)


def check_graph(inputs: Sequence[Mapping], outputs: Sequence[Mapping], graph: str = "graph") -> None:
    """Refuse graphs with axes the profiles cannot size (e.g. head graphs of another layout)."""
    for t in list(inputs) + list(outputs):
        for d in t["shape"]:
            if not isinstance(d, int) and d not in SYMBOLS:
                raise ProfileError(f"graph {graph!r}: tensor {t['name']!r} has dynamic axis {d!r}; TensorRT "
                                   f"profiles are computed for the axes {', '.join(SYMBOLS)} only")


@dataclass(frozen=True)
class Bindings:
    """Exact shapes of one engine call."""

    profile: int  # index into the engine's profiles
    inputs: dict[str, Shape]
    outputs: dict[str, Shape]


def bindings(inputs: Sequence[Mapping], outputs: Sequence[Mapping], profs: Sequence[Profile],
             B: int, N: int, P: int, prefer: str | None = None) -> Bindings:
    """Shapes for a call over ``B`` rows, ``N`` new positions and ``P`` past slots, and the
    first profile that admits them (``prefer`` first if it does). A step no profile admits
    fails with the limit it breaks and the export flag that raises it."""
    dims = {"B": B, "N": N, "P": P, "T": P + N}
    order = sorted(range(len(profs)), key=lambda i: profs[i].name != prefer)
    for i in order:
        if profs[i].admits(dims):
            return Bindings(i, {t["name"]: resolve(t["shape"], dims, t["name"]) for t in inputs},
                            {t["name"]: resolve(t["shape"], dims, t["name"]) for t in outputs})
    flags = {"B": "--max-batch", "N": "--max-draft / --prefill-chunk", "P": "--max-context", "T": "--max-context"}
    for s, v in dims.items():
        hi = max(p.ranges[s][2] for p in profs if s in p.ranges)
        if v > hi:
            raise ProfileError(f"{s}={v} exceeds the engine's largest {s} ({hi}); rebuild with a larger {flags[s]}")
    raise ProfileError(f"no optimisation profile admits B={B}, N={N}, P={P} "
                       f"(profiles: {', '.join(str(p.to_dict()) for p in profs)})")
