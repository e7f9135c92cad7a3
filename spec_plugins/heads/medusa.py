"""Medusa heads: K residual blocks on the target's last hidden state h_t, each decoded by the
target's own (frozen) LM head; head k predicts token t+2+k (the LM head itself predicts t+1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from spec_plugins.heads.common import config_number


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    draft_vocab_size: int = 8192

    def __post_init__(self) -> None:
        """Checked when read (a config.json), naming the field, not at the first draft."""
        for name in ("hidden_size", "num_heads", "draft_vocab_size"):
            object.__setattr__(self, name, config_number(name, getattr(self, name), integer=True))
        object.__setattr__(self, "num_layers", config_number("num_layers", self.num_layers, True, 0, strict=False))

    def to_dict(self) -> dict:
        return {"kind": "medusa", **asdict(self)}


def calibration_field(value: Any) -> dict[str, list[float]]:
    """config.json's ``holdout_topk_accuracy`` (absent: {}) as the proposer reads it: per head
    ``"head{d}"``, its rank accuracies, each a finite number in [0, 1]; else a ValueError naming the
    field, so a hand-edited shape is refused at load rather than when the proposer builds its tree."""
    name = "holdout_topk_accuracy"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object of per-head rank accuracy lists, got {value!r}")
    out = {}
    for head, accs in value.items():
        if not isinstance(accs, list):
            raise ValueError(f"{name}[{head!r}] must be a list of rank accuracies, got {accs!r}")
        row = [config_number(f"{name}[{head!r}][{r}]", a, integer=False, least=0, strict=False) for r, a in enumerate(accs)]
        if any(a > 1 for a in row):
            raise ValueError(f"{name}[{head!r}] holds {accs!r}; rank accuracies must be in [0, 1]")
        out[head] = row
    return out


class ResBlock(nn.Module):
    """x + SiLU(W x): zero-initialised W starts each head as the plain LM head (Medusa)."""

    def __init__(self, dim: int, **factory: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """hidden [B, H] -> logits [B, K, Vd] over the draft vocabulary ``vocab_ids`` [Vd]."""

    def __init__(self, config: MedusaConfig, lm_weight: torch.Tensor, vocab_ids: torch.Tensor,
                 zero_init: bool = True, dtype: torch.dtype | None = None) -> None:
        """Built where the target's LM head lives, in ``dtype`` (default: the LM head's)."""
        super().__init__()
        self.config = config
        fk = dict(device=lm_weight.device, dtype=dtype or lm_weight.dtype)
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size, **fk) for _ in range(config.num_layers)])
            for _ in range(config.num_heads))
        if zero_init:
            for p in self.blocks.parameters():
                nn.init.zeros_(p)
        ids = vocab_ids.to(device=lm_weight.device, dtype=torch.long)
        self.register_buffer("vocab_ids", ids.clone())
        # frozen, shared with the target (rows of its LM head); not saved with the head
        self.register_buffer("lm_weight", lm_weight.detach()[ids].to(fk["dtype"]), persistent=False)
        self.calibration: dict[str, list[float]] = {}  # holdout rank accuracies per head, if trained

    @classmethod
    def from_pretrained(cls, directory: str, model: Any) -> "MedusaHeads":
        """Load a trained head and attach the target's (frozen) LM head."""
        from spec_plugins.heads.common import build_head, check_target_fit, load_head, target_lm_parts

        cfg, state = load_head(directory)
        lm, emb = target_lm_parts(model)

        def build() -> "MedusaHeads":
            fields = {k: cfg[k] for k in ("hidden_size", "num_heads", "num_layers", "draft_vocab_size")}
            check_target_fit(fields["hidden_size"], state["vocab_ids"], lm, emb, cfg, model)
            heads = cls(MedusaConfig(**fields), lm, state["vocab_ids"])
            heads.load_state_dict(state, strict=True)  # copies (and casts) into the target's device and dtype
            heads.calibration = calibration_field(cfg.get("holdout_topk_accuracy"))
            return heads.eval()

        return build_head("medusa", directory, build, cfg.get("kind", "medusa"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hs = torch.stack([blk(hidden) for blk in self.blocks], dim=-2)  # [B, K, H]
        return hs @ self.lm_weight.T.to(hs.dtype)  # [B, K, Vd]
