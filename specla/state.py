"""Durable decoding state, factor records and the commit (DESIGN §2, SpecLA §5).

Verification never writes the durable state: it returns per-layer *factor records*. After
acceptance, `Cache.commit` advances the state along the accepted path from those records,
without re-running projections or the MLP. In delayed mode the GDN part of a commit is kept
pending and applied by the next verify (fused into its state pass) or by `flush()`, which
runs whenever anything else reads the state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specla import ops


@dataclass
class GDNRecord:
    """What a verify round leaves behind for one GDN layer, per node."""

    x: torch.Tensor | None  # pre-conv q|k|v inputs [B, n, C] (None without short conv)
    k: torch.Tensor  # l2-normalised keys [B, n, H, K]
    g: torch.Tensor  # log-decay [B, n, HV]
    u: torch.Tensor  # corrected update β(v - S'ᵀk) [B, n, HV, V]


@dataclass
class KVRecord:
    """Keys (rotated) and values of the verified nodes for one attention layer."""

    k: torch.Tensor  # [B, n, Hkv, D]
    v: torch.Tensor


@dataclass
class GDNLayerState:
    S: torch.Tensor  # [B, HV, K, V], fp32 (fp64 for float64 models)
    conv: torch.Tensor | None  # last W-1 pre-conv inputs [B, C, W-1], oldest first
    # Buffers of an accepted path not yet folded into S: (k [B,P,H,K], g [B,P,HV],
    # u [B,P,HV,V], length [B]); length 0 means nothing is pending. They are written in
    # place, so a CUDA graph that reads or writes them stays valid across rounds.
    pending: tuple | None = None

    def flush(self) -> None:
        if self.pending is not None:
            k, g, u, length = self.pending
            path = torch.arange(k.shape[1], device=k.device).expand(k.shape[0], -1)
            ops.gdn_commit(self.S, k, g, u, path, length)
            length.zero_()

    def set_pending(self, rec: "GDNRecord", path: torch.Tensor, length: torch.Tensor) -> None:
        rows = torch.arange(path.shape[0], device=path.device)[:, None]
        k, g, u = rec.k[rows, path], rec.g[rows, path], rec.u[rows, path]
        P = k.shape[1]
        if self.pending is None or self.pending[0].shape[1] < P or self.pending[0].shape[2:] != k.shape[2:]:
            self.pending = (torch.empty_like(k), torch.empty_like(g), torch.empty_like(u), torch.zeros_like(length))
        # a shorter path fills the front of the buffers, which keep their identity (graphs read them)
        for buf, val in zip(self.pending[:3], (k, g, u)):
            buf[:, :P].copy_(val)
        self.pending[3].copy_(length)


@dataclass
class KVLayerState:
    k: torch.Tensor  # [B, Hkv, L_max, D]
    v: torch.Tensor


class Cache:
    """Per-layer durable state plus `length` [B], the number of tokens each row has consumed."""

    def __init__(self, layers: list, length: torch.Tensor):
        self.layers = layers
        self.length = length

    @property
    def batch(self) -> int:
        return int(self.length.shape[0])


    def flush(self) -> "Cache":
        """Apply every pending accepted update; afterwards S equals AR's state."""
        for s in self.layers:
            if isinstance(s, GDNLayerState):
                s.flush()
        return self

    def commit(self, records: list, path: torch.Tensor, length: torch.Tensor, delayed: bool = False) -> None:
        """Consume the nodes path[b, :length[b]] (root first) of the last verify round.

        Conv state and KV caches advance now (they are tiny); the GDN state advances now, or,
        when `delayed`, at the next verify or flush. The verify that produced `records`
        consumed any earlier pending update, so at most one round is ever pending.
        """
        for s, rec in zip(self.layers, records):
            if isinstance(s, GDNLayerState):
                if s.conv is not None:
                    ops.conv_commit(s.conv, rec.x, path, length)
                if delayed:
                    s.set_pending(rec, path, length)
                else:
                    ops.gdn_commit(s.S, rec.k, rec.g, rec.u, path, length)
            else:
                _commit_kv(s, rec, path, length, self.length)
        self.length.add_(length)

    def clone(self) -> "Cache":
        layers = []
        for s in self.layers:
            if isinstance(s, GDNLayerState):
                pend = tuple(t.clone() for t in s.pending) if s.pending is not None else None
                layers.append(GDNLayerState(s.S.clone(), None if s.conv is None else s.conv.clone(), pend))
            else:
                layers.append(KVLayerState(s.k.clone(), s.v.clone()))
        return Cache(layers, self.length.clone())


def _commit_kv(s: KVLayerState, rec: KVRecord, path, length, start) -> None:
    """Append the accepted nodes' K/V at positions start .. start+length-1 (compacted).

    Entries past `length` rewrite what is already there, so the shapes never depend on how
    many were accepted (no host sync; capturable in a CUDA graph).
    """
    B, P = path.shape
    rows = torch.arange(B, device=path.device)[:, None]
    steps = torch.arange(P, device=path.device)[None, :]
    pos = (start[:, None] + steps).clamp(max=s.k.shape[2] - 1)  # [B, P]
    live = (steps < length[:, None])[:, None, :, None]  # [B, 1, P, 1]
    for cache, new in ((s.k, rec.k), (s.v, rec.v)):
        idx = pos[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3])
        fresh = new[rows, path].transpose(1, 2).to(cache.dtype)  # [B, Hkv, P, D]
        cache.scatter_(2, idx, torch.where(live, fresh, cache.gather(2, idx)))
