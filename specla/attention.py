"""Gated softmax attention for hybrid GDN + attention stacks (Qwen3-Next / Qwen3.5).

Per token x (DESIGN §2, hybrid bullets):

    q, gate = Wq x, Wgate x             # per query head; gate only with attn_output_gate
    k, v    = Wk x, Wv x                # grouped-query: Hkv key/value heads
    q, k    = rmsnorm(q), rmsnorm(k)    # per head over head_dim (zero-centred in Qwen3-Next / 3.5)
    q, k    = rope(q, pos), rope(k, pos) # partial rotary: the first rot_dim dims, half-split
    o       = softmax(q kᵀ / sqrt(D) + mask) v
    y       = Wo( o * sigmoid(gate) )

The KV cache (`KVLayerState`, [B, Hkv, L_max, D]) holds rotated keys and values at their
positions; row b has consumed `cache_length[b]` tokens, entries past it are free.

- `forward(h, st, cache_length)`: a plain causal sequence starting at position
  cache_length[b]; writes its K/V into the cache and attends to the cache + itself, causally.
- `verify(h, parents, st, cache_length, chain)`: a draft topology. Node j has rotary position
  cache_length + depth(j) and attends to the committed entries [0, cache_length) plus its
  ancestors and itself. The committed entries are only read (a chain's nodes use the free
  slots after them); the nodes' K/V come back in a `KVRecord`, and
  `Cache.commit` appends the accepted path's entries, compacted, at cache_length ...

Attention runs in `scaled_dot_product_attention` with a boolean mask. Decode steps and verify
attend over the whole static cache (L_max) (plus the n nodes): no host syncs and shapes fixed by
(L_max, n), so a step can be captured in a CUDA graph. A tree's verify concatenates the cache
with the nodes' K/V (one copy of the layer's cache per round); a chain's writes them into the
free slots, as an AR step would. Prefill (T > 1, not captured) bounds the keys by the longest row.
Grouped-query attention folds the G query heads of each KV head into the query axis, so K/V
are never replicated per query head.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla import topology
from specla.config import ModelConfig
from specla.errors import UnsupportedConfigError
from specla.graphs import capturing
from specla.layers import RMSNorm
from specla.rotary import apply_rotary, rotary_inv_freq
from specla.state import KVLayerState, KVRecord


class GatedAttention(nn.Module):
    """Softmax attention mixer with one fused input projection [q | gate | k | v]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.Hq, self.Hkv, self.D = cfg.attn_num_heads, cfg.attn_num_kv_heads, cfg.attn_head_dim
        if self.Hq <= 0 or self.Hkv <= 0 or self.D <= 0:
            raise UnsupportedConfigError(
                "attention layers need attn_num_heads, attn_num_kv_heads and attn_head_dim > 0")
        if self.Hq % self.Hkv:
            raise UnsupportedConfigError(
                f"attn_num_heads={self.Hq} is not a multiple of attn_num_kv_heads={self.Hkv}")
        self.G = self.Hq // self.Hkv
        rot = int(self.D * cfg.partial_rotary_factor)
        self.rot_dim = rot - rot % 2
        gate = self.Hq * self.D if cfg.attn_output_gate else 0
        self.split = [self.Hq * self.D, gate, self.Hkv * self.D, self.Hkv * self.D]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        zc = cfg.norm_style == "zero_centered"
        self.q_norm = RMSNorm(self.D, cfg.norm_eps, zc)
        self.k_norm = RMSNorm(self.D, cfg.norm_eps, zc)
        self.o_proj = nn.Linear(self.Hq * self.D, cfg.hidden_size, bias=False)
        self.scale = self.D ** -0.5
        self._inv_freq: dict = {}

    # state ---------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int, device, dtype) -> KVLayerState:
        shape = (batch, self.Hkv, max_len, self.D)
        return KVLayerState(torch.zeros(shape, device=device, dtype=dtype),
                            torch.zeros(shape, device=device, dtype=dtype))

    # pieces --------------------------------------------------------------------------------
    def inv_freq(self, device, dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._inv_freq:
            self._inv_freq[key] = rotary_inv_freq(self.rot_dim, self.cfg.rope_theta, dtype).to(device)
        return self._inv_freq[key]

    def _qkv(self, h: torch.Tensor, pos: torch.Tensor):
        """h [B, n, hidden], positions [B, n] -> q [B, n, Hq, D], gate, k, v [B, n, Hkv, D] (rotated)."""
        B, n, _ = h.shape
        q, gate, k, v = torch.split(self.in_proj(h), self.split, dim=-1)
        q = self.q_norm(q.reshape(B, n, self.Hq, self.D))
        k = self.k_norm(k.reshape(B, n, self.Hkv, self.D))
        v = v.reshape(B, n, self.Hkv, self.D)
        f = self.inv_freq(h.device, h.dtype)
        return apply_rotary(q, pos, f), (gate if self.cfg.attn_output_gate else None), apply_rotary(k, pos, f), v

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [B, n, Hq, D]; keys/values [B, Hkv, L, D]; mask [B, n, L] bool -> [B, n, Hq * D].

        The G query heads sharing a KV head are folded into the query axis, so SDPA sees
        [B, Hkv, G * n, D] queries against [B, Hkv, L, D] keys with no K/V replication.
        """
        B, n = q.shape[:2]
        qg = q.reshape(B, n, self.Hkv, self.G, self.D).permute(0, 2, 3, 1, 4).reshape(B, self.Hkv, self.G * n, self.D)
        m = mask[:, None, None].expand(B, 1, self.G, n, mask.shape[-1]).reshape(B, 1, self.G * n, mask.shape[-1])
        o = F.scaled_dot_product_attention(qg, keys.to(q.dtype), values.to(q.dtype), attn_mask=m, scale=self.scale)
        return o.reshape(B, self.Hkv, self.G, n, self.D).permute(0, 3, 1, 2, 4).reshape(B, n, self.Hq * self.D)

    def _output(self, o, gate):
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    # API -----------------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, st: KVLayerState, cache_length: torch.Tensor) -> torch.Tensor:
        """Consume h [B, T, hidden] at positions cache_length[b] + t, writing K/V into the cache."""
        B, T, _ = h.shape
        L = st.k.shape[2]
        ar = torch.arange(T, device=h.device)
        pos = cache_length[:, None] + ar[None, :]  # [B, T]
        q, gate, k, v = self._qkv(h, pos)
        self._store(st, pos, k, v)
        if T > 1 and not capturing():
            # an eager prefill: one host sync bounds the keys, so the mask stays [T, length]
            # instead of [T, L_max]; steps and graph-captured prefill chunks keep the static shape
            L = min(L, int(cache_length.max()) + T)
        mask = torch.arange(L, device=h.device)[None, None, :] <= pos[:, :, None]  # [B, T, L]
        return self._output(self._attend(q, st.k[:, :, :L], st.v[:, :, :L], mask), gate)

    def write_kv(self, h: torch.Tensor, st: KVLayerState, cache_length: torch.Tensor) -> None:
        """Only the cache side of `forward`: K/V of h [B, T, hidden] at cache_length[b] + t, no attention."""
        B, T, _ = h.shape
        pos = cache_length[:, None] + torch.arange(T, device=h.device)[None, :]
        _, k, v = torch.split(self.in_proj(h), [sum(self.split[:2])] + self.split[2:], dim=-1)
        k = apply_rotary(self.k_norm(k.reshape(B, T, self.Hkv, self.D)), pos, self.inv_freq(h.device, h.dtype))
        self._store(st, pos, k, v.reshape(B, T, self.Hkv, self.D))

    def _store(self, st, pos, k, v):
        B, T = pos.shape
        idx = pos[:, None, :, None].expand(B, self.Hkv, T, self.D)
        st.k.scatter_(2, idx, k.transpose(1, 2).to(st.k.dtype))
        st.v.scatter_(2, idx, v.transpose(1, 2).to(st.v.dtype))

    def verify(self, h: torch.Tensor, parents: torch.Tensor, st: KVLayerState, cache_length: torch.Tensor,
               chain: bool = False):
        """Score the topology `parents` [B, n]; returns (out [B, n, hidden], KVRecord). Reads the cache only.

        `chain` (the caller promises parents[:, j] = j - 1): the nodes' K/V go into the cache's
        free slots at their positions (past the committed length: nothing reads them but this
        verify, and the commit writes the accepted ones there again) and every node attends
        causally by position, so a position's keys sit where an AR step would find them and its
        reduction over them is the same (exact mode, docs/exact.md); a tree's nodes share
        positions, so they take a copy of the cache followed by the nodes, masked by ancestry."""
        B, n, _ = h.shape
        L = st.k.shape[2]
        pos = cache_length[:, None] + topology.depths(parents)
        q, gate, k, v = self._qkv(h, pos)
        if chain:
            self._store(st, pos, k, v)
            mask = torch.arange(L, device=h.device)[None, None, :] <= pos[:, :, None]  # [B, n, L]
            return self._output(self._attend(q, st.k, st.v, mask), gate), KVRecord(k=k, v=v)
        keys = torch.cat([st.k, k.transpose(1, 2).to(st.k.dtype)], dim=2)  # [B, Hkv, L + n, D]
        values = torch.cat([st.v, v.transpose(1, 2).to(st.v.dtype)], dim=2)
        committed = torch.arange(L, device=h.device)[None, :] < cache_length[:, None]  # [B, L]
        mask = torch.cat([committed[:, None, :].expand(B, n, L), topology.ancestor_mask(parents)], dim=2)
        return self._output(self._attend(q, keys, values, mask), gate), KVRecord(k=k, v=v)
