"""EAGLE drafter: one decoder layer over (feature f_t, embedding of token x_{t+1}), predicting
the next feature f_{t+1}; the target's frozen LM head decodes it into x_{t+2}.

Two input kinds, one module:
- EAGLE-1/2 (``feature_layers`` empty): f_t is the target's last hidden state after its final
  norm (what the LM head reads);
- EAGLE-3 (``feature_layers`` = low, mid and high decoder layers): the target's outputs of those
  layers, each RMS-normalised and fused by one linear map (``fc``) into a hidden-sized feature.
Either way the layer ends with an RMSNorm and its output is fed back as the next input feature
when drafting several tokens ahead (``project`` maps target features; the drafter's own outputs
are already hidden-sized). The module keeps no cache: callers pass past keys/values and an
additive attention mask, so every shape is explicit (exportable).
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from spec_plugins.heads.common import RMSNorm, config_number


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, mid and high decoder-layer outputs (1-based) as EAGLE-3 fuses them: distinct and in
    order from 8 layers on; a smaller (test-sized) model repeats or reorders some, which costs only
    weights, and ``--layers`` names others."""
    return (min(3, num_layers), max(1, num_layers // 2), max(1, num_layers - 2))


def parse_feature_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """``auto`` (low/mid/high, as EAGLE-3), ``none``, or comma-separated 1-based layer outputs."""
    if spec == "auto":
        return default_feature_layers(num_layers)
    if spec == "none":
        return ()
    try:
        layers = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"feature layers {spec!r}: expected auto, none or comma-separated integers") from None
    bad = [x for x in layers if not 1 <= x <= num_layers]
    if bad:
        raise ValueError(f"feature layers {spec!r}: layer outputs are numbered 1..{num_layers}, got {bad}")
    return layers


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1152
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    draft_vocab_size: int = 8192
    feature_layers: tuple[int, ...] = ()  # target decoder-layer outputs fused as input (EAGLE-3); () = last hidden

    def __post_init__(self) -> None:
        """Refuse a shape the layer cannot run (or would run into nonsense) when the config is
        built, naming the field, rather than at the first draft; numbers are normalised to int /
        float (a config.json or numpy may give others)."""
        for name in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "draft_vocab_size"):
            object.__setattr__(self, name, config_number(name, getattr(self, name), integer=True))
        for name in ("rope_theta", "rms_norm_eps"):
            object.__setattr__(self, name, config_number(name, getattr(self, name), integer=False))
        layers = tuple(self.feature_layers)
        if any(not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < 1 for x in layers):
            raise ValueError(f"feature_layers must be decoder-layer outputs numbered from 1, got {list(layers)}")
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in layers))

    def check_shape(self) -> None:
        """The fields together must make a layer attention can run; checked by the drafter that
        builds one (a subclass's own fields are checked after these, on the config alone)."""
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}): "
                             "each key/value head serves a whole group of query heads")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"hidden_size // num_heads = {self.head_dim} is the head width, which rotary "
                             f"embeddings split in halves: it must be even and at least 2 (hidden_size "
                             f"{self.hidden_size}, num_heads {self.num_heads})")

    @property
    def feature_size(self) -> int:
        """Width of the target features ``project`` takes."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def cache_heads(self) -> int:
        """Key/value heads per cached pair (the drafter's layer's; a parallel drafter may add more)."""
        return self.num_kv_heads

    def to_dict(self) -> dict:
        return {"kind": "eagle", **asdict(self)}


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split layout). x [B, h, T, d], positions [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None, :, None] * inv  # [B, 1, T, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def add_decoder_weights(m: nn.Module, c: EagleConfig, fk: dict) -> None:
    """A pre-norm decoder layer's weights as attributes of ``m`` (attention with grouped KV heads,
    then a SwiGLU MLP): the EAGLE layer's, and a parallel drafter's block layers'."""
    H, d = c.hidden_size, c.head_dim
    m.in_norm = RMSNorm(H, c.rms_norm_eps, **fk)
    m.q = nn.Linear(H, c.num_heads * d, bias=False, **fk)
    m.k = nn.Linear(H, c.num_kv_heads * d, bias=False, **fk)
    m.v = nn.Linear(H, c.num_kv_heads * d, bias=False, **fk)
    m.o = nn.Linear(c.num_heads * d, H, bias=False, **fk)
    m.mlp_norm = RMSNorm(H, c.rms_norm_eps, **fk)
    m.gate = nn.Linear(H, c.intermediate_size, bias=False, **fk)
    m.up = nn.Linear(H, c.intermediate_size, bias=False, **fk)
    m.down = nn.Linear(c.intermediate_size, H, bias=False, **fk)


def layer_kv(m: Any, c: EagleConfig, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (rotated to ``positions`` [B, T]) and values [B, kv, T, d] a layer of
    ``add_decoder_weights`` makes of its normalised input h [B, T, H]."""
    B, T, _ = h.shape
    k = m.k(h).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = m.v(h).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
    return rope(k, positions, c.rope_theta), v


def decoder_block(m: Any, c: EagleConfig, x: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
                  past_v: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer of ``add_decoder_weights`` on the residual stream x [B, T, H] at ``positions``
    [B, T], over cached keys/values [B, kv, S, d] and an additive mask [B, 1, T, S+T] (None: every
    query sees every key): (x after the layer, its new keys, its new values)."""
    B, T, _ = x.shape
    h = m.in_norm(x)
    q = rope(m.q(h).view(B, T, c.num_heads, c.head_dim).transpose(1, 2), positions, c.rope_theta)
    k, v = layer_kv(m, c, h, positions)
    keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
    rep = c.num_heads // c.num_kv_heads
    att = nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
        attn_mask=None if mask is None else mask.to(q.dtype))
    x = x + m.o(att.transpose(1, 2).reshape(B, T, -1))
    g = m.mlp_norm(x)
    return x + m.down(nn.functional.silu(m.gate(g)) * m.up(g)), k, v


class EagleDrafter(nn.Module):
    """forward(features [B,T,H], tokens [B,T], positions [B,T], past_k, past_v [B,kv,S,d],
    mask [B,1,T,S+T] additive) -> (next features [B,T,H], new keys, new values [B,kv,T,d])."""

    config_class: type = EagleConfig
    kind = "eagle"

    def __init__(self, config: EagleConfig, lm_weight: torch.Tensor, embed_weight: torch.Tensor,
                 vocab_ids: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Built where the target's LM head lives, in ``dtype`` (default: the LM head's)."""
        super().__init__()
        config.check_shape()
        c = self.config = config
        H = c.hidden_size
        dev = lm_weight.device
        fk = dict(device=dev, dtype=dtype or lm_weight.dtype)  # every weight on the target's device
        self.fc = nn.Linear(c.feature_size, H, bias=False, **fk) if c.feature_layers else None
        self.fuse = nn.Linear(2 * H, H, **fk)
        add_decoder_weights(self, c, fk)
        self.out_norm = RMSNorm(H, c.rms_norm_eps, **fk)
        ids = vocab_ids.to(device=dev, dtype=torch.long)
        self.register_buffer("vocab_ids", ids.clone())
        # frozen target tensors, shared, not saved with the head
        self.register_buffer("lm_weight", lm_weight.detach()[ids].to(fk["dtype"]), persistent=False)
        self.register_buffer("embed_weight", embed_weight.detach().to(dev), persistent=False)

    @classmethod
    def from_pretrained(cls, directory: str, model: Any) -> "EagleDrafter":
        """Load a trained drafter and attach the target's (frozen) LM head and embeddings
        (``model``: a transformers model, a runtime, or the (LM head, embeddings) pair)."""
        from dataclasses import fields

        from spec_plugins.heads.common import build_head, check_target_fit, load_head, target_lm_parts

        cfg, state = load_head(directory)
        lm, emb = target_lm_parts(model)

        def build() -> "EagleDrafter":
            names = {f.name for f in fields(cls.config_class)}
            config = cls.config_class(**{k: v for k, v in cfg.items() if k in names})
            check_target_fit(config.hidden_size, state["vocab_ids"], lm, emb, cfg, model)
            drafter = cls(config, lm, emb, state["vocab_ids"])
            drafter.load_state_dict(state, strict=True)  # copies (and casts) into the target's device and dtype
            return drafter.eval()

        return build_head(cls.kind, directory, build, cfg.get("kind", cls.kind))

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_size] -> the drafter's feature space [..., H]."""
        if self.fc is None:
            return target_features
        H = self.config.hidden_size
        parts = target_features.unflatten(-1, (len(self.config.feature_layers), H)).float()
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.fc(parts.flatten(-2).to(target_features.dtype))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        emb = nn.functional.embedding(tokens, self.embed_weight).to(features.dtype)
        x = self.fuse(torch.cat([features, emb], -1))  # [B, T, H]
        x, k, v = decoder_block(self, self.config, x, positions, past_k, past_v, mask)
        return self.out_norm(x), k, v

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Predicted features [..., H] -> logits over the draft vocabulary [..., Vd]."""
        lm = self.__dict__.get("_lm_linear")
        if lm is not None and lm.weight.dtype == features.dtype:
            return lm(features)
        return features @ self.lm_weight.T.to(features.dtype)

    def use_measured_kernels(self) -> Any:
        """Drafting runs the layer and the LM head over 1-16 rows, where this CPU's ``F.linear``
        is slowest (``backends/torch_kernels.py``): measure and install the faster kernel for
        every linear here, the LM head included, as the torch runtime does for the target.
        Effective inside ``torch_kernels.active()``; returns the choice (None off CPU)."""
        from spec_plugins.backends import torch_kernels

        lm = nn.Linear(self.config.hidden_size, self.lm_weight.shape[0], bias=False, device=self.lm_weight.device,
                       dtype=self.lm_weight.dtype)
        lm.weight = nn.Parameter(self.lm_weight, requires_grad=False)  # shared storage, not a submodule: never saved
        self.__dict__["_lm_linear"] = lm
        return torch_kernels.tune(nn.ModuleList([self, lm]), transposed=True)

    def empty_past(self, batch: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        z = torch.zeros(batch, c.cache_heads, 0, c.head_dim, dtype=dtype, device=self.lm_weight.device)
        return z, z.clone()
