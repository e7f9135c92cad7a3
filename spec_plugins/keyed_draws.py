"""A seeded row's samples keyed on (seed, lane, absolute position), not drawn from a stream.

A stream generator (``torch.Generator``) hands out its numbers in call order, so a seeded row's
output would depend on how many positions each round verified: on the draft schedule, which
``auto`` picks from measured timings, and on the neighbours sharing its generator. Point-mass
drafts (every model-free proposer and the heads' top-k) are verified by sampling one token from
the target at every forward position and following the matches (``verify.rejection_verify``);
here that sample is a keyed exponential race whose arrival times are hashes of (seed, lane,
position) and the index. The token at absolute position t is then a function of the seed and the
target's distribution there alone, the same for plain decoding and for any drafter and schedule.
The law is unchanged: along the path the walk follows, each position's race is used once, and the
races of different positions are independent (a position a round looked at past its emitted token
decided nothing, so the next round's use of it is fresh).

The race (``keyed_race``) has two stages. The vocabulary is cut into blocks of ``BLOCK`` ids (the
last padded with zero mass); block j wins with arrival E_j / m_j (m_j its mass, E_j = -log U_j
exponential), so with probability m_j / total; inside the winning block token t wins with
E_t / p_t, so with p_t / m_j: P(t) = p_t / total, exactly the target's law. A token or block of
zero mass never wins (an all-zero row takes token 0). Unlike an inverse CDF over the ids, where
rounding anywhere below a token moves every boundary above it, the winner changes only when two
arrivals nearly tie, so the tiny logit differences of a batched forward (~1e-6) leave a seeded
row's tokens as they are alone. Only about V / ``BLOCK`` + ``BLOCK`` uniforms are hashed per
position, not one per token.

``lane`` keeps rows that share one seed apart (``generate_batch(seed=...)``: row i is lane i); a
row with its own seed is lane 0, so ``generate(p, seed=s)`` equals row 0 of
``generate_batch([p, ...], seed=s)``. Seeded rows are verified together with keyed draws where
the proposer drafts point masses (every round: ``ProposerTraits.point_masses``); draws that are
not one per position (a drafted distribution's rejection test, a drafter's own sampling) use the
row's own stream generator, seeded from ``lane_seed(seed, lane)``, as before.

The key is 64 bits (two words, one per half of the seed). The hash is 32-bit integer mixing
(Wellons' ``lowbias32``) in int64 tensor arithmetic whose products stay below 2**63 (no overflow
on any device): a word per position (``position_words``), mixed with each index and a salt per
stage, two words of that giving 53 bits of uniform (``uniforms``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from spec_plugins.transfer import upload_tensor

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x * c) mod 2**32 for x, c < 2**32, by 16-bit halves of c (no int64 overflow)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor | int) -> torch.Tensor | int:
    """lowbias32: a bijection of 32-bit integers with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@lru_cache(maxsize=4096)
def _key(seed: int, lane: int) -> tuple[int, int]:
    """A 64-bit key of (seed, lane) as two 32-bit words: distinct 64-bit seeds in one lane give
    distinct keys (each word is a bijection of one half of the seed, given the lane)."""
    s, lane = int(seed) % (1 << 64), int(lane) & _M32
    return _mix(_mix((s & _M32) ^ 0x2545F491) ^ lane), _mix(_mix((s >> 32) ^ 0x1B873593) ^ lane)


def lane_seed(seed: int, lane: int) -> int:
    """The stream generator's seed of a row in lane ``lane`` of ``seed``: the seed itself in lane 0
    (a row with its own seed), a distinct one per lane otherwise (rows sharing a seed)."""
    if lane == 0:
        return int(seed)
    hi, lo = _key(seed, lane)
    return (hi << 31) ^ lo


BLOCK = 256  # ids per block of the race's first stage
_BLOCK_SALT, _TOKEN_SALT = 0x3C6EF372, 0xA54FF53A  # the two stages draw apart


def position_words(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit word per absolute position, ``keys`` [..., 2] (``_key`` of each row's seed and
    lane) broadcast against ``positions``, on their device: the seed of that position's race."""
    return _mix(_mix((positions.long() & _M32) ^ keys[..., 0]) ^ keys[..., 1])


def uniforms(words: torch.Tensor, index: torch.Tensor, salt: int) -> torch.Tensor:
    """One uniform in (0, 1] (float64, 53 bits) per position word and index (``words`` broadcast
    against ``index``), a stage's ``salt`` keeping the stages apart. Never 0: -log of it is finite."""
    a = _mix(_mix((index.long() & _M32) ^ salt) ^ words)
    hi, lo = _mix(a ^ 0x68E31DA4), _mix(a ^ 0x1B56C4E9)
    return (((hi << 21) | (lo >> 11)) + 1).double() * 2.0 ** -53


def _first_arrival(u: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """The winner of an exponential race along the last axis: argmin of -log(u) / mass, so each
    entry wins with probability mass / total; an entry without mass (zero, negative or NaN) never
    wins, and a row with none at all takes index 0."""
    arrival = torch.where(mass > 0, -u.log() / mass, torch.inf)
    return arrival.argmin(-1)


def keyed_race(probs: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs`` [R, V] (unnormalised allowed) won by the race keyed on
    ``words`` [R] (``position_words``): a block by its mass, then a token inside it (module
    docstring). [R] on the probs' device; a row without mass takes token 0."""
    R, V = probs.shape
    nb = -(-V // BLOCK)
    padded = torch.nn.functional.pad(probs, (0, nb * BLOCK - V)) if nb * BLOCK != V else probs
    mass = padded.reshape(R, nb, BLOCK)
    w = words.long()[:, None]
    masses = mass.sum(-1, dtype=torch.float64)  # [R, nb], summed in float64 without a float64 copy
    block = _first_arrival(uniforms(w, torch.arange(nb, device=probs.device), _BLOCK_SALT), masses)
    inside = mass.gather(1, block[:, None, None].expand(R, 1, BLOCK)).squeeze(1).double()  # [R, BLOCK]
    tokens = block[:, None] * BLOCK + torch.arange(BLOCK, device=probs.device)
    return block * BLOCK + _first_arrival(uniforms(w, tokens, _TOKEN_SALT), inside)


@dataclass(frozen=True)
class KeyedDraws:
    """The draws of a group of seeded rows for one round: each row's (seed, lane) and ``start``, the
    absolute index of the token its root position samples (the row's length)."""

    seeds: tuple[tuple[int, int], ...]
    starts: tuple[int, ...]

    def sample(self, p: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """One token per forward position: p [B, N, V], ``offsets`` [N] each position's distance
        from the root (a node's depth + 1). [B, N]."""
        B, N, V = p.shape
        keys = upload_tensor([_key(s, lane) for s, lane in self.seeds], p.device)  # [B, 2]
        starts = upload_tensor(list(self.starts), p.device)
        words = position_words(keys[:, None, :], starts[:, None] + offsets[None])  # [B, N]
        return keyed_race(p.reshape(B * N, V), words.reshape(-1)).view(B, N)
