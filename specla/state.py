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
from specla.graphs import capturing


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


class PendingBank:
    """The pending buffers of several GDN layers (equal factor shapes), stacked: layer i's
    `pending` is `(k[i], g[i], u[i], length[i])`, contiguous views. Storing an accepted path
    for all of them costs a handful of kernels (stack the records, one gather per factor, one
    length copy) instead of ~8 per layer, and the kernels read the views like separate buffers.
    """

    def __init__(self, layers: list[int], states: list, k_shape, g_shape, u_shape, batch: int, nodes: int,
                 dtype: torch.dtype, device):
        L = len(layers)
        z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        self.layers = list(layers)
        self.k = z(L, batch, nodes, *k_shape)
        self.g = z(L, batch, nodes, *g_shape)
        self.u = z(L, batch, nodes, *u_shape)
        self.length = torch.zeros(L, batch, dtype=torch.long, device=device)
        self.views = [(self.k[i], self.g[i], self.u[i], self.length[i]) for i in range(L)]
        for st, view in zip(states, self.views):
            st.pending = view

    @property
    def nodes(self) -> int:
        return int(self.k.shape[2])

    def attached(self, cache: "Cache") -> bool:
        """Every member layer still holds this bank's buffers (nobody replaced them)."""
        return all(cache.layers[i].pending is v for i, v in zip(self.layers, self.views))

    def fits(self, records: list, path: torch.Tensor) -> bool:
        B, P = path.shape
        if P > self.nodes or B != self.k.shape[1]:
            return False
        for i in self.layers:
            r = records[i]
            if not isinstance(r, GDNRecord) or r.k.shape[0] != B:
                return False
            for t, buf in ((r.k, self.k), (r.g, self.g), (r.u, self.u)):
                if t.shape[2:] != buf.shape[3:] or t.dtype != buf.dtype or t.device != buf.device:
                    return False
        n = records[self.layers[0]].k.shape[1]
        return all(records[i].k.shape[1] == n and records[i].u.shape[1] == n and records[i].g.shape[1] == n
                   for i in self.layers)

    def store_args(self, records: list, path: torch.Tensor, chain: bool):
        """`store_pending`'s arguments but the path and its length: (buffers, parts, chain), for
        all member layers at once; the caller checked `fits`. chain: the caller promises
        path[b, :length[b]] = 0, 1, ... (a chain's accepted prefix), so a full-width path is the
        records as they are: stacked straight into the buffers, no gather (three launches of
        ~5 us a chain round on the H200, rounds.json)."""
        parts = [[getattr(records[i], name) for i in self.layers] for name in ("k", "g", "u")]
        return (self.k, self.g, self.u, self.length), parts, chain and path.shape[1] == parts[0][0].shape[1] == self.nodes


def store_pending(bufs, parts, path: torch.Tensor, length: torch.Tensor, chain: bool) -> None:
    """A `PendingBank` store (`PendingBank.store_args`) on its buffers (k, g, u [L, B, nodes, ...],
    length [L, B]): parts are the member layers' k, g and u records [B, n, ...]. A pure function
    of tensors, so a fused target compiles it (in `commit_stacked`): Inductor writes each buffer
    with one kernel that reads the layers' records where they are, instead of a stack and a
    gather per factor (eager: 7 launches a tree round, three of them 3.7 us gathers on the H200,
    `tree_shapes_8faf436_profile.json`)."""
    B, P = path.shape
    L, n = len(parts[0]), parts[0][0].shape[1]
    idx = (torch.arange(B, device=path.device)[:, None] * n + path).reshape(-1)  # flat node per (b, p)
    for buf, recs in zip(bufs[:3], parts):
        if chain:
            torch.stack(recs, out=buf)
        elif torch.compiler.is_compiling():
            # each layer's path rows gathered on their way into the bank: Inductor then never
            # writes all n nodes' records stacked before reading back the P it keeps (eagerly
            # that would be a gather a layer, so the eager store stacks first)
            rows = [r.reshape(B * n, -1).index_select(0, idx).view(B, P, *buf.shape[3:]) for r in recs]
            if P == buf.shape[2]:
                torch.stack(rows, out=buf)
            else:
                buf[:, :, :P].copy_(torch.stack(rows))
        else:
            src = torch.stack(recs).reshape(L, B * n, -1)  # [L, B * n, ...]
            buf[:, :, :P].copy_(src.index_select(1, idx).view(L, B, P, *buf.shape[3:]))
    bufs[3].copy_(length.reshape(1, B).expand(L, B))


def commit_convs(conv: torch.Tensor, xs: list, path: torch.Tensor, length: torch.Tensor) -> None:
    """`ops.conv_commit` of several layers at once: conv [L, B, C, W-1] their conv states,
    stacked (`Cache.conv`), xs their records' pre-conv inputs [B, n, C]. A pure function of
    tensors, so a fused target compiles it into a few kernels a round, where the per-layer
    kernel was a launch a layer (24 of ~1.8 µs in the H200's chain round,
    controlled_55d95ad_h200.json)."""
    B, P = path.shape
    L, _, C, W1 = conv.shape
    rows = torch.arange(B, device=path.device)[:, None]
    # slot j of the new state is input t = length + j of (old state, accepted path): only the
    # W-1 path nodes that end up in it are read, not every layer's whole path
    t = length[:, None] + torch.arange(W1, device=path.device)  # [B, W-1]
    node = path[rows, (t - W1).clamp(0, P - 1)]
    new = torch.stack([x[rows, node] for x in xs]).to(conv.dtype).transpose(2, 3)  # [L, B, C, W-1]
    old = conv.gather(3, t.clamp(max=W1 - 1)[None, :, None, :].expand(L, B, C, W1))
    conv.copy_(torch.where((t < W1)[None, :, None, :], old, new))


def commit_stacked(bank, conv, path: torch.Tensor, length: torch.Tensor, total: torch.Tensor) -> None:
    """A commit's work on stacked buffers as one pure function of tensors, which a fused target
    compiles as one region: the pending bank's store (`store_pending`, bank =
    `PendingBank.store_args` or None), the stacked conv states' advance (`commit_convs`, conv =
    (states, the layers' records) or None) and the consumed-token count `total` += length."""
    if bank is not None:
        bufs, parts, chain = bank
        store_pending(bufs, parts, path, length, chain)
    if conv is not None:
        states, xs = conv
        commit_convs(states, xs, path, length)
    total.add_(length)


class Cache:
    """Per-layer durable state plus `length` [B], the number of tokens each row has consumed.

    `bank`: a `PendingBank` holding the pending buffers of the GDN layers, once a delayed
    commit needs them (built on the first delayed commit, or up front by `GraphTarget`).
    `conv`: the GDN layers' conv states stacked [L, B, C, W-1] (each layer's `conv` a view of
    it) when their shapes agree; with `stack_convs` (`GraphTarget` beside a fused target) a
    commit advances them together, otherwise each layer's by its own kernel (eagerly, the
    stacked function's 24 gathers took twice as long as the 24 Triton launches on an H100).
    `commit_tensors`: what runs the commit's work on those stacked buffers (`commit_stacked`;
    `GraphTarget` compiles it beside a fused target).
    `clean`: host-side knowledge that no layer holds a pending update (the cache was just
    emptied or flushed), so `flush` launches nothing: a prefill after `Target.reset` would
    otherwise run three launches a layer to apply empty updates. Every delayed commit clears
    it, also those a CUDA graph replays (`GraphTarget` clears it on the host). Under a graph
    capture `flush` always runs: the graph must hold the work for whatever state it replays on.
    """

    def __init__(self, layers: list, length: torch.Tensor):
        self.layers = layers
        self.length = length
        self.bank: PendingBank | None = None
        self.commit_tensors = commit_stacked
        self.stack_convs = False
        self.clean = False
        self.conv_layers = [i for i, s in enumerate(layers) if isinstance(s, GDNLayerState) and s.conv is not None]
        convs = [layers[i].conv for i in self.conv_layers]
        self.conv = None
        if len(convs) > 1 and len({(c.shape, c.dtype, c.device) for c in convs}) == 1:
            self.conv = torch.stack(convs)
            for i, c in zip(self.conv_layers, self.conv):
                layers[i].conv = c

    def make_bank(self, records: list | None, batch: int, nodes: int, shapes=None) -> PendingBank | None:
        """Stack the pending buffers of every GDN layer (all must have equal factor shapes,
        from `records` or `shapes` = (k_shape, g_shape, u_shape, dtype)); None if they differ."""
        idx = [i for i, s in enumerate(self.layers) if isinstance(s, GDNLayerState)]
        if not idx:
            return None
        if shapes is None:
            keys = {(tuple(records[i].k.shape[2:]), tuple(records[i].g.shape[2:]), tuple(records[i].u.shape[2:]),
                     records[i].k.dtype, records[i].g.dtype, records[i].u.dtype) for i in idx}
            if len(keys) != 1:
                return None
            ks, gs, us, dk, dg, du = keys.pop()
            if not dk == dg == du:
                return None
            shapes = (ks, gs, us, dk)
        ks, gs, us, dt = shapes
        self.bank = PendingBank(idx, [self.layers[i] for i in idx], ks, gs, us, batch, nodes, dt,
                                self.layers[idx[0]].S.device)
        return self.bank

    def reserve_pending(self, batch: int, nodes: int, key_shape: tuple[int, int]) -> None:
        """Pending buffers for every GDN layer before the first delayed commit (a CUDA graph must
        read the same buffers from its capture on): one bank when the layers' shapes agree,
        zeroed buffers per layer otherwise. key_shape: (H, K) of the keys."""
        gdn = [s for s in self.layers if isinstance(s, GDNLayerState)]
        shapes = {(s.S.shape[1], s.S.shape[3], s.S.dtype) for s in gdn}
        if len(shapes) == 1:
            HV, V, dt = shapes.pop()
            self.make_bank(None, batch, nodes, shapes=(key_shape, (HV,), (HV, V), dt))
            return
        for s in gdn:
            z = lambda *shape: torch.zeros(*shape, device=s.S.device, dtype=s.S.dtype)  # noqa: E731
            HV, V = s.S.shape[1], s.S.shape[3]
            s.pending = (z(batch, nodes, *key_shape), z(batch, nodes, HV), z(batch, nodes, HV, V),
                         torch.zeros(batch, dtype=torch.long, device=s.S.device))

    @property
    def batch(self) -> int:
        return int(self.length.shape[0])


    def flush(self) -> "Cache":
        """Apply every pending accepted update; afterwards S equals AR's state."""
        if not self.clean or capturing():
            for s in self.layers:
                if isinstance(s, GDNLayerState):
                    s.flush()
            self.clean = True
        return self

    def commit(self, records: list, path: torch.Tensor, length: torch.Tensor, delayed: bool = False,
               chain: bool = False) -> None:
        """Consume the nodes path[b, :length[b]] (root first) of the last verify round; chain:
        the round verified a chain, so that path is 0, 1, ... (`PendingBank.store_args`).

        Conv state and KV caches advance now (they are tiny); the GDN state advances now, or,
        when `delayed`, at the next verify or flush. The verify that produced `records`
        consumed any earlier pending update, so at most one round is ever pending.
        """
        bank = None
        if delayed:
            self.clean = False
            bank = self.bank
            if bank is None or not bank.attached(self) or not bank.fits(records, path):
                if capturing():
                    # new buffers inside a capture would leave the verify graph reading stale ones
                    raise RuntimeError("Cache.commit: the pending buffers do not fit this commit "
                                       f"(path {tuple(path.shape)}) during CUDA graph capture")
                # first delayed commit, a longer path, or buffers replaced: (re)build the bank.
                # The verify that produced `records` folded any earlier pending update, so
                # nothing live is lost.
                bank = self.make_bank(records, path.shape[0], path.shape[1])
                if bank is not None and not bank.fits(records, path):
                    bank = None
        together = self.conv is not None and self.stack_convs
        for s, rec in zip(self.layers, records):
            if isinstance(s, GDNLayerState):
                if s.conv is not None and not together:
                    ops.conv_commit(s.conv, rec.x, path, length)
                if delayed:
                    if bank is None:
                        s.set_pending(rec, path, length)
                else:
                    ops.gdn_commit(s.S, rec.k, rec.g, rec.u, path, length)
            else:
                _commit_kv(s, rec, path, length, self.length)  # before `length` moves on
        self.commit_tensors(None if bank is None else bank.store_args(records, path, chain),
                            (self.conv, [records[i].x for i in self.conv_layers]) if together else None,
                            path, length, self.length)

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
