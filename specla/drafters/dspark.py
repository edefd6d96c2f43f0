"""DSpark-style parallel block drafter: a parallel backbone plus a sequential head (docs/ready.md).

One drafter forward proposes a whole block of `block_size` (7) tokens:

    x_0 = emb(root), x_i = m_i (i = 1..P-1)           the root (last emitted token) and learned
                                                      mask embeddings, at positions len + i
    per draft layer l:
        K, V = [ k_l(c_l(F_s)), v_l(c_l(F_s)) for every consumed token s ;  k_l(x), v_l(x) of the block ]
        x   += o_l(attn(q_l(x), K, V))                 non-causal inside the block, all of the context
        x   += mlp_l(x)
    logits_i = lm_head(norm(x_i)) + U[prev_i] Vᵀ       sequential head: a rank-r Markov bias on the
                                                      token before position i (the root for i = 0,
                                                      else the token drafted at i - 1)
    conf_i   = σ(w · norm_c(x_i) + a · max log p_i + c) acceptance of position i given positions < i

F_s = fuse([norm₁(f¹_s); norm₂(f²_s); norm₃(f³_s)]) fuses the residual streams of low, middle
and high target layers for token s (as the EAGLE drafter; `capture` = those layers, delivered by
`extend`), and c_l is a per-layer RMSNorm. The context's K/V depend on F only, so the drafter
keeps a cache of them per layer, written by `extend` for every consumed token (no attention, no
MLP for history entries). The target's embedding and LM head are shared by reference (frozen,
never saved). Drafting: position i predicts the token i + 1 places after the root; the tokens
are the greedy choices of the sequential head, position by position (point masses,
`Draft.probs = None`), and the block is cut after the last position whose cumulative
expected acceptance Π_{j≤i} conf_j is at least `threshold` (at least `min_draft` tokens).

`DSparkModel.block_hidden` is the same computation for many anchors of whole training
sequences at once (`specla.train.block_drafter`); `layer_forward` is shared. Subclasses
(ReaDy, `specla.drafters.ready`) add to the residual stream through `inject`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla import fused, graphs, ops
from specla.config import ModelConfig
from specla.drafters.base import Draft, DraftContext, Drafter, attention_window, grown, kv_room
from specla.drafters.eagle import check_fits_target, default_feature_layers
from specla.errors import CheckpointError, InputError
from specla.layers import GatedMLP, RMSNorm
from specla.model import Model
from specla.rotary import apply_rotary, rotary_inv_freq
from specla.precision import accumulation_dtype

MODEL_TYPE = "specla_dspark"


@dataclass
class DSparkConfig:
    hidden_size: int  # the target's (its embedding and LM head are shared)
    vocab_size: int
    feature_layers: list[int]  # target layers whose residual stream forms the context
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int = 7  # draft positions per block (root + block_size - 1 masks)
    seq_rank: int = 16  # rank of the sequential head's Markov bias
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @classmethod
    def for_target(cls, target: ModelConfig, **over) -> "DSparkConfig":
        """Two layers of 64-dim heads, MLP 2x: 1.77 M parameters (3.5 MB bf16) at the demo shape."""
        D = target.hidden_size
        heads = max(1, D // 64)
        kw = dict(hidden_size=D, vocab_size=target.vocab_size,
                  feature_layers=default_feature_layers(target.num_hidden_layers), num_layers=2,
                  num_heads=heads, head_dim=D // heads, intermediate_size=2 * D, norm_eps=target.norm_eps)
        kw.update(over)
        return cls(**kw)

    def check(self, target: ModelConfig) -> None:
        check_fits_target(self, target)
        if self.block_size < 1:
            raise CheckpointError(f"block size must be positive, got {self.block_size}")


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        D, eps, Hd = cfg.hidden_size, cfg.norm_eps, cfg.num_heads * cfg.head_dim
        self.attn_norm = RMSNorm(D, eps)
        self.ctx_norm = RMSNorm(D, eps)  # the context feature as this layer's key/value input
        self.q_proj = nn.Linear(D, Hd, bias=False)
        self.k_proj = nn.Linear(D, Hd, bias=False)
        self.v_proj = nn.Linear(D, Hd, bias=False)
        self.o_proj = nn.Linear(Hd, D, bias=False)
        self.mlp_norm = RMSNorm(D, eps)
        self.mlp = GatedMLP(D, cfg.intermediate_size)


# The reader context a subclass's `inject` receives (ReaDy: the states to read); None for DSpark.
ReadFn = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


class DSparkModel(nn.Module):
    """The drafter's own weights (no embedding, no LM head)."""

    model_type = MODEL_TYPE

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        D, eps, P = cfg.hidden_size, cfg.norm_eps, cfg.block_size
        self.cfg = cfg
        self.feature_norms = nn.ModuleList(RMSNorm(D, eps) for _ in cfg.feature_layers)
        self.fuse = nn.Linear(len(cfg.feature_layers) * D, D, bias=False)
        self.mask_emb = nn.Parameter(torch.randn(max(P - 1, 0), D) * 0.02)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, eps)
        self.seq_u = nn.Embedding(cfg.vocab_size, cfg.seq_rank)
        self.seq_v = nn.Linear(cfg.seq_rank, cfg.vocab_size, bias=False)
        nn.init.zeros_(self.seq_v.weight)  # no bias before training: the backbone alone
        self.conf_norm = RMSNorm(D, eps)
        self.conf = nn.Linear(D, 1)
        self.conf_logp = nn.Parameter(torch.ones(()))
        self.scale = cfg.head_dim ** -0.5
        self._inv_freq: dict = {}

    # pieces shared by drafting and training ----------------------------------------------------
    def features(self, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fused context feature F [B, n, D] from the captured layers' residual streams."""
        return self.fuse(torch.cat([norm(h) for norm, h in zip(self.feature_norms, hidden)], -1))

    def _rotary(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.device, x.dtype)
        if key not in self._inv_freq:
            self._inv_freq[key] = rotary_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, x.dtype).to(x.device)
        return self._inv_freq[key]

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], self.cfg.num_heads, self.cfg.head_dim)

    def context_kv(self, i: int, feat: torch.Tensor, pos: torch.Tensor):
        """Layer i's keys (rotated) and values for context features feat [B, n, D] at positions pos [B, n]."""
        layer = self.layers[i]
        c = layer.ctx_norm(feat)
        k = apply_rotary(self._heads(layer.k_proj(c)), pos, self._rotary(feat))
        return k, self._heads(layer.v_proj(c))

    def block_input(self, root_emb: torch.Tensor) -> torch.Tensor:
        """[..., D] root embeddings -> [..., P, D]: the root, then the mask embeddings."""
        m = self.mask_emb.to(root_emb.dtype).expand(*root_emb.shape[:-1], -1, -1)
        return torch.cat([root_emb[..., None, :], m], -2)

    def inject(self, i: int, site: str, x: torch.Tensor, blocks: int, read: ReadFn | None) -> torch.Tensor | None:
        """Residual added to layer i's stream x [B, blocks * P, D] before ("pre") or after ("post")
        its attention; None: nothing (DSpark). ReaDy reads the target's states here."""
        return None

    def layer_forward(self, i: int, x: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                      mask: torch.Tensor, blocks: int = 1, read: ReadFn | None = None) -> torch.Tensor:
        """x [B, N, D] (N = blocks * P) at positions pos [B, N]; ctx_k, ctx_v [B, H, C, hd] the
        context entries (rotated keys); mask [B, N, C + N]: which context and block keys each
        query sees."""
        layer = self.layers[i]
        add = self.inject(i, "pre", x, blocks, read)
        if add is not None:
            x = x + add
        h = layer.attn_norm(x)
        f = self._rotary(x)
        q = apply_rotary(self._heads(layer.q_proj(h)), pos, f)  # [B, N, H, hd]
        k = apply_rotary(self._heads(layer.k_proj(h)), pos, f).transpose(1, 2)
        v = self._heads(layer.v_proj(h)).transpose(1, 2)
        keys = torch.cat([ctx_k.to(q.dtype), k], 2)
        values = torch.cat([ctx_v.to(q.dtype), v], 2)
        x = x + layer.o_proj(self._attend(q, keys, values, mask))
        add = self.inject(i, "post", x, blocks, read)
        if add is not None:
            x = x + add
        return x + layer.mlp(layer.mlp_norm(x))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, N, H, hd] over keys, values [B, H, C + N, hd] -> [B, N, H * hd]. Drafting (no
        grad) runs `ops.masked_attention`, split over the window: cuDNN's SDPA spent ~62 us a
        call on a block's 7 queries over a 2k-slot window on the H200, with one program per
        head (block_round_b0eadc4.json: half the block forward). Training needs SDPA's backward."""
        if not torch.is_grad_enabled():
            return ops.masked_attention(q, keys, values, mask, self.scale)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=self.scale)
        return o.transpose(1, 2).flatten(2)

    def logits(self, h: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Backbone logits (before the sequential head's bias)."""
        return F.linear(self.norm(h), lm_head_weight)

    def seq_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """The sequential head's rank-r Markov bias [..., vocab] for the previous tokens prev [...]."""
        return self.seq_v(self.seq_u(prev))

    def confidence(self, h: torch.Tensor, logp_max: torch.Tensor) -> torch.Tensor:
        """Logit of the probability that a position is accepted given the positions before it."""
        c = self.conf(self.conf_norm(h)).squeeze(-1)
        return c + self.conf_logp.to(c.dtype) * logp_max.to(c.dtype)

    # training ---------------------------------------------------------------------------------
    def block_hidden(self, feat: torch.Tensor, root_emb: torch.Tensor, anchors: torch.Tensor,
                     read: ReadFn | None = None) -> torch.Tensor:
        """Blocks of many anchors of whole sequences at once: h [B, A, P, D].

        feat [B, T, D]: fused target features of the sequence's tokens (context entry s at
        position s); root_emb [B, A, D]: the embeddings of the anchors' roots; anchors [B, A]:
        the roots' positions r. Block (b, a) sees the context entries s < r (the tokens the
        target has consumed when r is the root) and its own block, exactly as when drafting.
        """
        B, T, D = feat.shape
        A, P = anchors.shape[1], self.cfg.block_size
        dev = feat.device
        steps = torch.arange(P, device=dev)
        x = self.block_input(root_emb).reshape(B, A * P, D)
        pos = (anchors[..., None] + steps).reshape(B, A * P)
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        sees_ctx = (torch.arange(T, device=dev) < anchors[..., None]).repeat_interleave(P, 1)  # [B, A*P, T]
        block_of = torch.arange(A * P, device=dev) // P
        sees_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], -1)
        for i in range(len(self.layers)):
            k, v = self.context_kv(i, feat, ctx_pos)
            x = self.layer_forward(i, x, pos, k.transpose(1, 2), v.transpose(1, 2), mask, A, read)
        return x.reshape(B, A, P, D)


# the drafter ----------------------------------------------------------------------------------

class DSparkDrafter(Drafter):
    """Chains of up to `block` tokens from one block forward per round.

    threshold: cut the block after the last position whose cumulative predicted acceptance is
    at least this (0: never cut); min_draft: tokens kept whatever the confidence. graphs (CUDA):
    replay the block forward from a CUDA graph (captured at a generation's first round and
    again when the context cache grows or the buffers it reads change). compile: the graphed
    block forward and extend compiled with this mode (`specla.fused`); None: the target
    model's own (compiled when the target is fused, as under SPECLA_COMPILE).
    """

    name = "dspark"
    device_root = True
    chain = True

    def __init__(self, model: DSparkModel, target: Model, threshold: float = 0.0, block: int | None = None,
                 min_draft: int = 1, graphs: bool = False, initial_capacity: int = 256,
                 compile: str | None = None):
        P = model.cfg.block_size
        block = P if block is None else block
        if not 1 <= block <= P:
            raise InputError(f"block must be in 1..{P}, got {block}")
        if not 1 <= min_draft <= block:
            raise InputError(f"min_draft must be in 1..{block}, got {min_draft}")
        if not 0.0 <= threshold <= 1.0:
            raise InputError(f"the confidence threshold must be in [0, 1], got {threshold}")
        if graphs and target.device.type != "cuda":
            raise InputError("drafter CUDA graphs need a target on a CUDA device")
        model.cfg.check(target.cfg)
        self.model, self.target = model, target
        self.block, self.threshold, self.min_draft, self.graphs = block, threshold, min_draft, graphs
        self.max_nodes = block + 1
        self.capture = tuple(model.cfg.feature_layers)
        self.initial_capacity = initial_capacity
        self.compile = compile
        self._compiled: dict = {}
        model._rotary(torch.empty(0, device=target.device, dtype=target.dtype))  # made here: compiled code only reads it
        self.reset(1)

    # context cache ----------------------------------------------------------------------------
    def reset(self, batch: int, horizon: int | None = None) -> None:
        """Start a generation: the cache empties in place when the batch size is unchanged (its
        buffers, and the captured graphs, are reused across generations)."""
        self._horizon = horizon
        self._drafting = False  # host flag: a proposal was made (extends now come from rounds)
        if getattr(self, "len", None) is not None and self.len.shape[0] == batch:
            self.len.zero_()
            self._bound = 0
            return
        cfg, dev, dt = self.model.cfg, self.target.device, self.target.dtype
        # a spare slot: every window is then a strided view, so a compiled block forward never
        # specialises on a contiguous one (a window as wide as the cache would recompile)
        shape = (batch, cfg.num_heads, self.initial_capacity + 1, cfg.head_dim)
        self.k = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_layers)]
        self.len = torch.zeros(batch, dtype=torch.long, device=dev)  # consumed tokens (in place)
        self._bound = 0  # host-side upper bound of max(self.len)
        self._root = torch.zeros(batch, dtype=torch.long, device=dev)  # the graphs' input
        self._graphs, self._graph_key = {}, None  # by attention window, over the buffers of _graph_key
        self._extend_graphs = {}  # by accepted-path width

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] - 1

    def _reserve(self, extra: int) -> None:
        self._bound, new = kv_room(self.capacity, self._bound, extra, self.len)
        if new is not None:
            self.k = [grown(t, new + 1) for t in self.k]
            self.v = [grown(t, new + 1) for t in self.v]
            self._graphs, self._extend_graphs = {}, {}  # captured graphs hold the old buffers

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor,
               static: bool = False) -> None:
        """One context entry per consumed token (entries past length[b] land past the new length,
        where later writes replace them). With graphs, a round's accepted path (its width fixed
        by the target's node budget) replays a graph per width: eagerly its ~75 small kernels
        cost more host time than the whole block forward; prefill chunks (any width, before the
        first proposal) run eagerly."""
        n = hidden[self.capture[0]].shape[1]
        if n:
            self._reserve(n)
        if self.graphs and self._drafting and n:
            self._extend_replay(hidden, length)
        else:
            self._extend(hidden, length)
        self._bound += n

    def _extend(self, hidden: dict[int, torch.Tensor], length: torch.Tensor) -> None:
        """The device work of `extend` (the cache must have room: `_reserve`)."""
        m = self.model
        feat = m.features([hidden[i] for i in self.capture])  # [B, n, D]
        B, n = feat.shape[:2]
        if n:
            slots = self.len[:, None] + torch.arange(n, device=feat.device)
            for i in range(len(m.layers)):
                k, v = m.context_kv(i, feat, slots)
                idx = slots[:, None, :, None].expand(B, k.shape[2], n, k.shape[3])
                self.k[i].scatter_(2, idx, k.transpose(1, 2).to(self.k[i].dtype))
                self.v[i].scatter_(2, idx, v.transpose(1, 2).to(self.v[i].dtype))
        self.len.add_(length)

    def _extend_replay(self, hidden: dict[int, torch.Tensor], length: torch.Tensor) -> None:
        n = hidden[self.capture[0]].shape[1]
        if n not in self._extend_graphs:
            # warm-up and capture with zero lengths: their writes land past the committed length
            # (slots the next extend overwrites before any block forward reads them)
            static = ({i: hidden[i].clone() for i in self.capture}, torch.zeros_like(length))
            _, extend, guard = self._graph_fns()
            self._extend_graphs[n] = (graphs.capture(lambda: extend(*static), guard()), static)
        graph, (st_hid, st_len) = self._extend_graphs[n]
        for i in self.capture:
            st_hid[i].copy_(hidden[i])
        st_len.copy_(length)
        graph.replay()

    # drafting ---------------------------------------------------------------------------------
    def reader(self, cache):
        """What `inject` reads (ReaDy: the committed states of `cache`); None for DSpark."""
        return None

    def _window(self) -> int:
        """Leading context slots a block forward attends over."""
        return attention_window(self.capacity, self._bound, 0, self._horizon)

    def _views(self, window: int | None):
        W = self.capacity if window is None else window
        return [k[:, :, :W] for k in self.k], [v[:, :, :W] for v in self.v]

    def block_forward(self, root: torch.Tensor, cache=None, window: int | None = None, views=None):
        """One block forward from roots [B], attending over the first `window` context slots
        (default: all; or over `views`, per-layer (keys, values) windows of the cache):
        (backbone logits [B, P, V], h [B, P, D]). Device work only."""
        m, tgt = self.model, self.target
        B, dev, P = root.shape[0], root.device, m.cfg.block_size
        keys, values = views if views is not None else self._views(window)
        cap = keys[0].shape[2]
        x = m.block_input(tgt.embeddings(root))  # [B, P, D]
        pos = self.len[:, None] + torch.arange(P, device=dev)
        sees_ctx = (torch.arange(cap, device=dev)[None] < self.len[:, None])[:, None].expand(B, P, cap)
        mask = torch.cat([sees_ctx, torch.ones(B, P, P, dtype=torch.bool, device=dev)], -1)
        read = self.reader(cache)
        for i in range(len(m.layers)):
            x = m.layer_forward(i, x, pos, keys[i], values[i], mask, 1, read)
        return m.logits(x, tgt.lm_head.weight), x

    def draft(self, root: torch.Tensor, cache=None, window: int | None = None, views=None):
        """The block's greedy tokens [B, block] and how many to keep [B] (no host synchronisation)."""
        m = self.model
        logits, h = self.block_forward(root, cache, window, views)
        acc = accumulation_dtype(logits.dtype)
        prev, toks, lmax = root, [], []
        for i in range(self.block):
            li = (logits[:, i] + m.seq_bias(prev).to(logits.dtype)).to(acc)
            prev = li.argmax(-1)  # ties: the lowest id, as AR
            toks.append(prev)
            lmax.append(li.max(-1).values - torch.logsumexp(li, -1))
        tokens = torch.stack(toks, 1)
        conf = torch.sigmoid(m.confidence(h[:, :self.block], torch.stack(lmax, 1)).to(acc))
        surv = conf.cumprod(1)  # never increases: the kept positions are a prefix
        keep = (surv >= self.threshold).sum(1).clamp(min=self.min_draft)
        return tokens, keep

    def _graph_state(self, cache):
        """What a captured forward depends on besides values updated in place."""
        return (self.k[0].data_ptr(), self.k[0].shape[2])

    def _graph_fns(self):
        """(block draft, extend, capture guard factory) for the graphs: compiled when the drafter
        or its target asks (a block forward and an extend are ~120 and ~75 small kernels
        eagerly); kept across generations and cache growth."""
        mode = self.compile or fused.mode_of(self.target)
        if mode not in self._compiled:
            # the attention window (cache slots, dim 2) is symbolic: one compile serves every window
            draft, guard = fused.compile_for_graph(
                lambda root, cache, keys, values: self.draft(root, cache, views=(keys, values)), mode, dynamic=True)
            extend, _ = fused.compile_for_graph(self._extend, mode)
            self._compiled[mode] = (draft, extend, guard)
        return self._compiled[mode]

    def _replay(self, root: torch.Tensor, cache, window: int):
        key = self._graph_state(cache)
        if key != self._graph_key:
            self._graphs, self._graph_key = {}, key
        graph = self._graphs.get(window)
        if graph is None:
            keys, values = self._views(window)
            fused.mark_dynamic(2, *keys, *values)
            draft, _, guard = self._graph_fns()
            # the warm-up compiles and fills the reader's address tables
            graph = self._graphs[window] = graphs.capture(lambda: draft(self._root, cache, keys, values), guard())
        self._root.copy_(root)
        graph.replay()
        return graph.out

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        dev = self.target.device
        root = ctx.root if ctx.root is not None else torch.tensor([h[-1] for h in ctx.history], device=dev)
        self._drafting = True
        window = self._window()
        tokens, keep = (self._replay(root, ctx.cache, window) if self.graphs
                        else self.draft(root, ctx.cache, window))
        # always the whole block, with positions past the confidence cut marked invalid
        # (acceptance ignores them): no host read, so the loop may run ahead of the host
        B, n = root.shape[0], self.block
        toks = torch.cat([root[:, None], tokens], 1)
        parents = torch.arange(-1, n, device=dev).expand(B, n + 1)
        return Draft(toks, parents, valid=None if self.threshold == 0 else keep + 1)
