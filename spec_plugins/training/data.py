"""Self-distillation data: the target's own greedy responses to a shipped prompt set, and the
target's last-layer features for every position of prompt + response, cached once on disk and
shared by every head trained on the same target (``features.safetensors``).

Greedy responses come from batched plain decoding on the project's torch runtime, which returns
the features of every token it feeds, so no second pass over the data is needed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

ProgressFn = Callable[[int, int], None]  # (done, total)


@dataclass
class FeatureSet:
    """Sequences (prompt + greedy response) flattened: row i spans offsets[i]:offsets[i+1]."""

    tokens: torch.Tensor  # [N] long
    hidden: torch.Tensor  # [N, H] float16, post-final-norm features of each position
    offsets: torch.Tensor  # [S+1] long
    prompt_lens: torch.Tensor  # [S] long

    def __len__(self) -> int:
        return int(self.prompt_lens.numel())

    def seq(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.hidden[a:b], int(self.prompt_lens[i])

    @property
    def response_tokens(self) -> int:
        return int((self.offsets[1:] - self.offsets[:-1] - self.prompt_lens).sum())

    def token_counts(self, vocab: int) -> torch.Tensor:
        """How often each token appears in the responses (for the draft vocabulary)."""
        counts = torch.zeros(vocab, dtype=torch.long)
        for i in range(len(self)):
            toks, _, p = self.seq(i)
            counts += torch.bincount(toks[p:], minlength=vocab)[:vocab]
        return counts

    def save(self, path: str | Path, meta: dict) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"tokens": self.tokens, "hidden": self.hidden.contiguous(), "offsets": self.offsets,
                   "prompt_lens": self.prompt_lens}, str(tmp), metadata={"meta": json.dumps(meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "FeatureSet":
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls(t["tokens"], t["hidden"], t["offsets"], t["prompt_lens"])


def load_prompts(path: str | Path) -> list[str]:
    """One JSON object per line with a ``prompt`` field."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path} line {n}: expected an object with a non-empty string `prompt`, got {line[:80]!r}")
        out.append(row["prompt"])
    if not out:
        raise ValueError(f"no prompts in {path}")
    return out


def encode_chat(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Wrap each prompt in the chat template (as the CLI does for --prompt)."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@torch.inference_mode()
def greedy_with_features(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int] = (),
                         batch_size: int = 32, progress: ProgressFn | None = None
                         ) -> list[tuple[list[int], torch.Tensor]]:
    """Plain greedy decoding that keeps the target's features as it goes (no second pass).

    Returns per prompt (sequence, features [len(sequence), H]); the sequence is prompt +
    response minus the final token, which was never fed to the model and so has no feature."""
    from spec_plugins.backends.torch_runtime import TorchRuntime

    runtime = TorchRuntime(model)
    eos_set = set(int(e) for e in eos)
    out: list[tuple[list[int], torch.Tensor]] = []
    steps_total = -(-len(prompts) // batch_size) * max_new_tokens
    steps_done = 0
    for s in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[s: s + batch_size]]
        res = runtime.prefill(chunk, want_hidden=True)
        L = res.hidden.shape[1]
        seqs = [list(p) for p in chunk]
        feats = [[res.hidden[b, L - len(p):].float()] for b, p in enumerate(chunk)]
        live = list(range(len(chunk)))  # chunk rows still decoding, in runtime row order
        nxt = res.logits[:, -1].argmax(-1)
        for step in range(max_new_tokens):
            for r, t in zip(live, nxt.tolist()):
                seqs[r].append(t)
            keep = [i for i, r in enumerate(live) if seqs[r][-1] not in eos_set]
            if step + 1 == max_new_tokens or not keep:
                break
            if len(keep) < len(live):
                runtime.select_rows(keep)
                live, nxt = [live[i] for i in keep], nxt[keep]
            res = runtime.forward(nxt[:, None], want_hidden=True)
            for b, r in enumerate(live):
                feats[r].append(res.hidden[b].float())
            nxt = res.logits[:, -1].argmax(-1)
            steps_done += 1
            if progress and steps_done % 8 == 0:
                progress(steps_done, steps_total)
        steps_done = (s // batch_size + 1) * max_new_tokens
        if progress:
            progress(steps_done, steps_total)
        for r in range(len(chunk)):
            f = torch.cat(feats[r])
            out.append((seqs[r][: f.shape[0]], f))
    return out


def build_features(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int] = (),
                   batch_size: int = 32, progress: ProgressFn | None = None) -> FeatureSet:
    """Greedy responses + features for every prompt."""
    got = greedy_with_features(model, prompts, max_new_tokens, eos, batch_size, progress)
    lens = torch.tensor([len(s) for s, _ in got])
    return FeatureSet(
        tokens=torch.tensor([t for s, _ in got for t in s], dtype=torch.long),
        hidden=torch.cat([f for _, f in got]).to(torch.float16),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
    )


@torch.inference_mode()
def target_features(model: Any, sequences: Sequence[Sequence[int]], batch_size: int = 8) -> list[torch.Tensor]:
    """Post-final-norm hidden states [L, H] of every position (right padding never leaks left)."""
    out = []
    base = model.get_decoder()
    dev = next(model.parameters()).device
    for s in range(0, len(sequences), batch_size):
        chunk = sequences[s: s + batch_size]
        L = max(len(c) for c in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        for b, c in enumerate(chunk):
            ids[b, : len(c)] = torch.as_tensor(list(c))
        h = base(input_ids=ids.to(dev)).last_hidden_state.float().cpu()
        out.extend(h[b, : len(c)] for b, c in enumerate(chunk))
    return out


def cache_key(target: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> str:
    """Features depend on the target, the exact prompt ids and the response length only."""
    h = hashlib.sha256(json.dumps([target, [list(p) for p in prompts], max_new_tokens]).encode())
    return h.hexdigest()[:16]


def cached_features(path: Path, build: Callable[[], FeatureSet], meta: dict) -> tuple[FeatureSet, bool]:
    """Load ``path`` if present, else build and save it. Returns (features, was_cached)."""
    if path.is_file():
        return FeatureSet.load(path), True
    fs = build()
    fs.save(path, meta)
    return fs, False
