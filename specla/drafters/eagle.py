"""Target-aligned EAGLE-style drafter (SpecLA §6.2; EAGLE-3 feature fusion and training-time test).

One decoder layer over the target's own features; the target's embedding and LM head are
used by reference (frozen, never stored with the drafter):

    F_t = fuse([norm₁(f¹_t); norm₂(f²_t); norm₃(f³_t)])      f^i_t: residual stream of token t after
                                                              a low, a middle and the last target layer
    x_t = fc([norm_e(emb(token_{t+1})); norm_f(F_t)])         entry t pairs feature t with the next token
    x_t = x_t + attn(attn_norm(x_t))                          causal softmax attention, rotary at t
    h_t = x_t + mlp(mlp_norm(x_t))                            SwiGLU
    logits_t = lm_head(norm(h_t))                             predicts token t+2

This is EAGLE-3's input form (the low/mid/high features fused to one hidden-size vector, then
concatenated with the token embedding) with an MTP-style fc in front of a standard layer.
Drafting past the last token whose target feature is known feeds the drafter its own h in
place of F: the entry after h_t is (emb(d), h_t) at position t + 1. The training-time test
(`unroll`) trains exactly that: step k of anchor t is the entry at position t + k that reads
the true token t + k + 1 and step k−1's h, and attends to the real entries s ≤ t plus its own
earlier steps — the keys the drafter sees when it drafts k tokens past anchor t.

`EagleDrafter` keeps a KV cache over the accepted history (entries t for every consumed token
whose successor is known; the last consumed token's feature waits in `pending` until the root
is known), and proposes by a beam top-k rollout (`specla.drafters.tree`): one forward per
depth over all beams, each attending along its own path. top-k 1 is a chain. Proposals are
deterministic top-k tokens (point masses): greedy and sampled acceptance are both exact with
them (`acceptance.sample`, probs None).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla import fused, graphs, ops, topology
from specla.config import ModelConfig
from specla.drafters import checkpoint, tree
from specla.drafters.base import Draft, DraftContext, Drafter, attention_window, grown, kv_room
from specla.engine import prompt_chunks
from specla.errors import CheckpointError, InputError
from specla.layers import GatedMLP, RMSNorm
from specla.model import Model
from specla.rotary import apply_rotary, rotary_inv_freq
from specla.precision import accumulation_dtype

MODEL_TYPE = "specla_eagle"
DRAFTER_DIR = "drafter"  # a target checkpoint's drafter lives in <target>/drafter/
# the drafter's distribution in tree scores, sharpened: on held-out GSM8K training questions
# (30, CPU, fp32) the demo's 16-node trees accept 6.44 tokens a round at 0.5 against 6.11 at 1
# (the plain log-probabilities) and 3.72 at 2 (benchmarks/diagnostics/tree_temperature.py)
TREE_TEMPERATURE = 0.5


def check_fits_target(cfg, target: ModelConfig) -> None:
    """A drafter config (hidden_size, vocab_size, feature_layers) against the target it serves."""
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"the drafter was trained for hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size}; "
            f"the target has {target.hidden_size} and {target.vocab_size}")
    bad = [i for i in cfg.feature_layers if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise CheckpointError(f"the drafter reads target layer {bad[0]}, but the target has "
                              f"{target.num_hidden_layers} layers")


def default_feature_layers(num_layers: int) -> list[int]:
    """Low, middle and high target layers (EAGLE-3): after layers L//4, L//2 and L-1."""
    return sorted({num_layers // 4, num_layers // 2, num_layers - 1})


@dataclass
class EagleConfig:
    hidden_size: int  # the target's hidden size (its embedding and LM head are shared)
    vocab_size: int
    feature_layers: list[int]  # target layers whose residual stream is fused
    num_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @classmethod
    def for_target(cls, target: ModelConfig, **over) -> "EagleConfig":
        """Heads of 64 dims, MLP 3x the hidden size: 1.2 M parameters (2.4 MB bf16) at the demo shape."""
        D = target.hidden_size
        heads = max(1, D // 64)
        kw = dict(hidden_size=D, vocab_size=target.vocab_size,
                  feature_layers=default_feature_layers(target.num_hidden_layers),
                  num_heads=heads, head_dim=D // heads, intermediate_size=3 * D, norm_eps=target.norm_eps)
        kw.update(over)
        return cls(**kw)

    def check(self, target: ModelConfig) -> None:
        check_fits_target(self, target)


def _ttt_attention(q, k0, v0, ks, vs, scale):
    """Step k >= 1 of the unroll, [B, H, T, hd] each: anchor t attends to the real entries s <= t
    (step 0's keys, causal) and to its own entries of steps 1..k (one key per step: a diagonal)."""
    T, acc = q.shape[2], accumulation_dtype(q.dtype)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ k0.transpose(-1, -2)).to(acc).masked_fill(~causal, float("-inf"))
    sd = torch.stack([(q.to(acc) * kj.to(acc)).sum(-1) for kj in ks], -1)
    p = torch.softmax(torch.cat([s0, sd], -1) * scale, -1).to(v0.dtype)
    return p[..., :T] @ v0 + (p[..., T:, None] * torch.stack(vs, -2)).sum(-2)


class EagleDrafterModel(nn.Module):
    """The drafter's own weights (no embedding, no LM head)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.norm_eps
        self.cfg = cfg
        self.feature_norms = nn.ModuleList(RMSNorm(D, eps) for _ in cfg.feature_layers)
        self.fuse = nn.Linear(len(cfg.feature_layers) * D, D, bias=False)
        self.norm_emb = RMSNorm(D, eps)
        self.norm_feat = RMSNorm(D, eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.attn_norm = RMSNorm(D, eps)
        self.qkv_proj = nn.Linear(D, 3 * cfg.num_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, D, bias=False)
        self.mlp_norm = RMSNorm(D, eps)
        self.mlp = GatedMLP(D, cfg.intermediate_size)
        self.norm = RMSNorm(D, eps)
        self.scale = cfg.head_dim ** -0.5
        self._inv_freq: dict = {}

    # pieces shared by drafting and training ----------------------------------------------------
    def features(self, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fused target feature F [B, n, D] from the captured layers' residual streams."""
        return ops.linear(torch.cat([norm(h) for norm, h in zip(self.feature_norms, hidden)], -1), self.fuse.weight)

    def inputs(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """Entry input from the next token's embedding and a feature (F, or the drafter's own h)."""
        return ops.linear(torch.cat([self.norm_emb(emb), self.norm_feat(feat)], -1), self.fc.weight)

    def step_inputs(self, table: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """`inputs` of a draft step's entries [B, n]: token embeddings from `table`, each
        entry's feature the row src[b, i] of h [B, nb, D] (its parent beam's h), one launch
        where it can (`ops.draft_inputs`)."""
        D = h.shape[-1]
        if ops.fuses_linear(h, self.fc.weight, tokens.numel()):
            return ops.draft_inputs(table, tokens, h, src, self.norm_emb.weight, self.norm_feat.weight,
                                    self.norm_emb.eps, self.fc.weight)
        return self.inputs(F.embedding(tokens, table), h.gather(1, src[..., None].expand(*src.shape, D)))

    def qkv(self, x: torch.Tensor, pos: torch.Tensor | None):
        """x [B, n, D] at positions pos [B, n] -> q, k (rotated), v, each [B, n, H, hd]; pos
        None: q and k unrotated (a draft step's `ops.draft_attention` rotates them)."""
        B, n, _ = x.shape
        if ops.fuses_linear(x, self.qkv_proj.weight):
            qkv = ops.fused_linear(x, self.qkv_proj.weight, self.attn_norm.weight, self.attn_norm.eps)
        else:
            qkv = ops.linear(self.attn_norm(x), self.qkv_proj.weight)
        q, k, v = qkv.reshape(B, n, 3, self.cfg.num_heads, self.cfg.head_dim).unbind(2)
        if pos is None:
            return q, k, v
        f = self.inv_freq(x.device, x.dtype)
        return apply_rotary(q, pos, f), apply_rotary(k, pos, f), v

    def inv_freq(self, device, dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._inv_freq:
            self._inv_freq[key] = rotary_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, dtype).to(device)
        return self._inv_freq[key]

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of the layer after attention: h [B, n, D] (the next step's feature).
        gate_up: the MLP's `gate_up_weight()`, one matmul instead of two; with it, a draft step
        runs as three launches (`ops.fused_linear`) where it can."""
        if gate_up is not None and ops.fuses_linear(attn, gate_up):
            x = ops.fused_linear(attn, self.o_proj.weight, residual=x)
            act = ops.fused_linear(x, gate_up, self.mlp_norm.weight, self.mlp_norm.eps, glu=True)
            return ops.fused_linear(act, self.mlp.down_proj.weight, residual=x)
        x = x + ops.linear(attn, self.o_proj.weight)
        return x + self.mlp(self.mlp_norm(x), gate_up)

    def logits(self, h: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        if ops.fuses_linear(h, lm_head_weight):
            return ops.fused_linear(h, lm_head_weight, self.norm.weight, self.norm.eps)
        return ops.linear(self.norm(h), lm_head_weight)

    # training ---------------------------------------------------------------------------------
    def unroll(self, feats: torch.Tensor, emb: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences: h of every step, [B, T, D] each.

        feats [B, T, D] are the fused target features, emb [B, T, D] the embeddings of the
        sequence's tokens. Step k at anchor t reads token t + k + 1 (zeros past the end) and
        feature F_t (k = 0) or step k−1's h at t, sits at position t + k, and predicts token
        t + k + 2.
        """
        B, T, _ = emb.shape
        pos = torch.arange(T, device=emb.device).expand(B, T)
        feat, keys, values, out = feats, [], [], []
        for k in range(steps):
            x = self.inputs(F.pad(emb[:, k + 1:], (0, 0, 0, k + 1)), feat)
            q, kk, v = (t.transpose(1, 2) for t in self.qkv(x, pos + k))
            if k == 0:
                o = F.scaled_dot_product_attention(q, kk, v, is_causal=True, scale=self.scale)
            else:
                o = _ttt_attention(q, keys[0], values[0], keys[1:] + [kk], values[1:] + [v], self.scale)
            keys.append(kk)
            values.append(v)
            feat = self.finish(x, o.transpose(1, 2).flatten(2))
            out.append(feat)
        return out


# checkpoints ----------------------------------------------------------------------------------

def save_drafter(model: EagleDrafterModel, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a drafter directory (`drafters.checkpoint`)."""
    return checkpoint.save(model, MODEL_TYPE, out_dir, dtype)


def load_drafter(path, target: Model | None = None, device="cpu", dtype=torch.float32) -> EagleDrafterModel:
    """Load a drafter directory; with `target`, check it fits and match its device and dtype."""
    _, cfg = checkpoint.read_config(path, {MODEL_TYPE: EagleConfig}, "EAGLE drafter")
    if target is not None:
        cfg.check(target.cfg)
        device, dtype = target.device, target.dtype
    return checkpoint.load_weights(path, EagleDrafterModel, cfg, device, dtype)


# the drafter ----------------------------------------------------------------------------------

class EagleDrafter(Drafter):
    """Chains (topk 1) or pruned beam trees from an `EagleDrafterModel` over the target's features.

    depth: drafter forwards per round (the deepest draft token), or (shallow, deep): each round's
    depth chosen from the last report read (`tree.DepthPolicy`); width: beams kept a depth
    (default topk; 1 is a chain with each depth's runners-up as leaves, at a chain's drafter
    cost); temperature: of the drafter's distribution in the tree scores q (< 1 ranks the
    likeliest continuation's deeper nodes above unlikely siblings; the beams' tokens do not
    change); budget: draft nodes submitted (default: everything the rollout proposes); tau:
    the pruning window on q, in nats of the tempered distribution (None: none). graphs (CUDA): replay the rollout from a CUDA graph,
    captured at the first round of a generation and again whenever the KV cache grows; it
    runs every depth (no early stop, which would need a host read), the window still applies.
    """

    name = "eagle"
    device_root = True

    def __init__(self, model: EagleDrafterModel, target: Model, topk: int = 1, depth: int | tuple[int, int] = 8,
                 budget: int | None = None, tau: float | None = None, graphs: bool = False,
                 initial_capacity: int = 256, compile: str | None = None, width: int | None = None,
                 temperature: float = TREE_TEMPERATURE):
        self.policy = None
        if isinstance(depth, (tuple, list)):
            if len(depth) != 2 or not 1 <= depth[0] < depth[1]:
                raise InputError(f"an adaptive depth is (shallow, deep) with 1 <= shallow < deep, got {tuple(depth)}")
            self.policy = tree.DepthPolicy(int(depth[0]), int(depth[1]))
            depth = self.policy.deep  # what buffers and graphs are sized for
        if topk < 1 or depth < 1 or (budget is not None and budget < 1):
            raise InputError("drafter top-k, depth and budget must be positive")
        if not temperature > 0:
            raise InputError(f"the tree temperature must be positive, got {temperature}")
        width = topk if width is None else width
        if not 1 <= width <= topk:
            raise InputError(f"the tree width (beams kept a depth) must be between 1 and the top-k {topk}, "
                             f"got {width}")
        if tau is not None and tau < 0:
            raise InputError(f"the pruning window tau must be >= 0, got {tau}")
        if graphs and target.device.type != "cuda":
            raise InputError("drafter CUDA graphs need a target on a CUDA device")
        model.cfg.check(target.cfg)
        self.model, self.target = model, target
        self.topk, self.width, self.depth, self.tau, self.graphs = topk, width, depth, tau, graphs
        self.temperature = temperature
        pool = self._pool_size(depth)
        self.budget = pool if budget is None else min(budget, pool)
        self.max_nodes = self.budget + 1
        self._max_path = depth + 1  # one node a depth
        self.chain = topk == 1
        self.entries = 1 + (depth - 1) * width  # drafter queries per rollout: the root, then w per depth
        self.capture = tuple(model.cfg.feature_layers)
        self.initial_capacity = initial_capacity
        # graphed rollout and extend compiled with this mode (specla.fused); None: the target
        # model's own (compiled when the target is fused, as under SPECLA_COMPILE)
        self.compile = compile
        self._compiled: dict = {}
        model.inv_freq(target.device, target.dtype)  # made here: a compiled rollout only reads it
        # the MLP's gate and up as one matmul a draft step (a launch fewer: ~2.7 µs of a demo
        # draft step on the H200), taken here: the compiled rollout reads it as a constant
        self._gate_up = model.mlp.gate_up_weight()
        self.reset(1)

    @classmethod
    def load(cls, path, target: Model, **options) -> "EagleDrafter":
        return cls(load_drafter(path, target), target, **options)

    # cache ------------------------------------------------------------------------------------
    def reset(self, batch: int, horizon: int | None = None) -> None:
        """Start a generation: the cache empties in place when the batch size is unchanged, so
        its buffers and the captured rollouts are reused across generations."""
        self._horizon = horizon
        self._drafting = False  # host flag: a proposal was made (extends now come from rounds)
        # the depth policy's host state: the depth of each proposal not yet reported, and the
        # accepted drafts of the last reported one (None: no report to go by)
        self._unreported: collections.deque[int] = collections.deque()
        self._accepted: int | None = None
        if getattr(self, "len", None) is not None and self.len.shape[0] == batch:
            self.len.zero_()
            self.pending.zero_()
            self.started = False
            self._bound = 0
            return
        cfg, dev, dt = self.model.cfg, self.target.device, self.target.dtype
        # one spare slot past the capacity: every attention window is then a strided view, so
        # the compiled rollout never specialises on a contiguous window (a recompile, ~20 s on
        # the H200, the first time a window is narrower than the cache)
        self.k = torch.zeros(batch, cfg.num_heads, self.initial_capacity + 1, cfg.head_dim, device=dev, dtype=dt)
        self.v = torch.zeros_like(self.k)
        # updated in place, so a captured rollout reads the current values
        self.len = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pending = torch.zeros(batch, cfg.hidden_size, device=dev, dtype=dt)  # feature whose next token is unknown
        self.started = False  # host flag: `pending` holds a feature
        self._bound = 0  # host-side upper bound of max(self.len): growing needs no sync per round
        self._root = torch.zeros(batch, dtype=torch.long, device=dev)  # the rollout graphs' input
        # the one-beam depths' src, never written: as a tensor of the drafter rather than a zeros
        # inside the compiled rollout, where each depth's copy was a kernel of its own on the GPU
        # (the argmax's reduction kernel could not also write it)
        self._src0 = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self._graphs, self._extend_graphs = {}, {}  # rollouts by attention window and depth; extends by width
        # with a depth policy every depth's rollout graph writes its draft here, so the target's
        # round graph (which reads a graphed draft where it lies) and the extend graph after it
        # are one a window for all depths, as with a fixed depth; None where the depths' drafts
        # differ in size (chains, or a shallow pool smaller than the budget)
        self._drafts = None
        if self.policy is not None and not (self.chain and self.tau is None) and \
                self._pool_size(self.policy.shallow) >= self.budget:
            n = self.budget + 1
            self._drafts = (torch.zeros(batch, n, dtype=torch.long, device=dev),
                            torch.zeros(batch, n, dtype=torch.long, device=dev),
                            torch.zeros(batch, dtype=torch.long, device=dev))

    def _pool_size(self, depth: int) -> int:
        """Nodes a rollout `depth` deep proposes: the root's top-k, then width · top-k a depth."""
        return self.topk + (depth - 1) * self.width * self.topk

    def _graph_fns(self, depth: int | None = None):
        """(rollout of `depth` (default the deepest), extend, capture guard factory, prompt
        extend) for the graphs: compiled when the drafter or its target asks; kept across
        generations and cache growth (a new capacity recompiles, nothing else does)."""
        mode = self.compile or fused.mode_of(self.target)
        depth = depth or self.depth
        if mode not in self._compiled:
            # a round's extend has one width (static); a prompt's chunks several (symbolic)
            extend, guard = fused.compile_for_graph(self._extend, mode)
            prompt, _ = fused.compile_for_graph(self._extend, mode, dynamic=True)
            self._compiled[mode] = (extend, guard, prompt)
        if (mode, depth) not in self._compiled:
            # the attention window (cache slots, dim 2) is symbolic: one compile serves every window
            self._compiled[mode, depth] = fused.compile_for_graph(
                lambda root, k, v: self._into_drafts(self.draft(root, k, v, graphed=True, depth=depth)), mode,
                dynamic=True)[0]
        extend, guard, prompt = self._compiled[mode]
        return self._compiled[mode, depth], extend, guard, prompt

    def _reserve(self, extra: int) -> None:
        self._bound, new = kv_room(self.capacity, self._bound, extra, self.len)
        if new is not None:
            self.k, self.v = grown(self.k, new + 1), grown(self.v, new + 1)
            self._graphs, self._extend_graphs = {}, {}  # captured graphs hold the old buffers

    @property
    def capacity(self) -> int:
        """Cache slots entries may occupy (the spare slot excluded)."""
        return self.k.shape[2] - 1

    def _window(self) -> int:
        """Leading cache slots the next rollout attends over (its entries included)."""
        return attention_window(self.capacity, self._bound, self.entries, self._horizon)

    @staticmethod
    def _store(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        B, n, H, hd = k.shape
        idx = slots[:, None, :, None].expand(B, H, n, hd)
        keys.scatter_(2, idx, k.transpose(1, 2).to(keys.dtype))
        values.scatter_(2, idx, v.transpose(1, 2).to(values.dtype))

    # Drafter API ------------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor,
               static: bool = False) -> None:
        if self.graphs and not self._drafting:
            return self._extend_prompt(tokens, hidden, length)
        if self._drafting and tokens.shape[1] > self.depth + 1:
            # a round's accepted path has at most depth + 1 nodes (the root, one a depth); the
            # rest of the target's node budget is padding, which a tree's extend need not read
            # (17 slots for the demo's 16-node trees, 9 for their paths)
            tokens, hidden = tokens[:, :self.depth + 1], {i: hidden[i][:, :self.depth + 1] for i in self.capture}
        n = tokens.shape[1] - (0 if self.started else 1)
        if n > 0:
            self._reserve(n)  # host-side: may grow the cache (and drop the graphs over it)
        # a round's accepted path replays a graph per width
        if self.graphs and self.started and n > 0:
            self._extend_replay(tokens, hidden, length, static=static)
        else:
            self._extend(tokens, hidden, length, not self.started)
        self._bound += max(n, 0)
        self.started = True

    def _extend_prompt(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor) -> None:
        """The prompt's `extend` (before the first proposal) in the chunks the target's prefill
        takes (`engine.prompt_chunks`: a few fixed widths), a graph replay each. Run eagerly it
        was ~2 ms of host time a prompt (H200 e2e of d302d7f: drafted routes' prefill 12.7-12.9
        ms a prompt against AR's 11.0); a graph per exact width would compile in the middle of a
        generation (2.1 s for a 28-token chunk in bench e2e); 32-token chunks throughout cost a
        replay and five staging copies per 32 tokens (H100, e2e_86782e8_h100.json: drafted
        prefills 1.7 ms over AR's at 512-1,023 prompt tokens, 3.6 ms at 1,024-2,047)."""
        T = tokens.shape[1]
        for s, W in prompt_chunks(T):
            n = min(W, T - s)
            first = not self.started  # the prompt's first token adds no entry: its feature is pending
            self._reserve(W)  # the graph writes all W slots; those past the length are scratch
            self._extend_replay(tokens[:, s:s + n], {i: hidden[i][:, s:s + n] for i in self.capture},
                                length if n == T else (length - s).clamp(0, n), width=W, first=first)
            self._bound += n - first
            self.started = True

    def _extend(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor,
                first: bool = False) -> None:
        """The device work of `extend` (the cache must have room: `_reserve`); `first`: these are
        the first tokens the drafter consumes."""
        m = self.model
        feats = m.features([hidden[i] for i in self.capture])  # [B, n, D]
        if first:  # the first consumed token has no feature before it
            tok, feat, count = tokens[:, 1:], feats[:, :-1], (length - 1).clamp(min=0)
        else:
            tok, feat, count = tokens, torch.cat([self.pending[:, None], feats[:, :-1]], 1), length
        n = tok.shape[1]
        if n > 0:
            # only K/V: nothing else of a history entry is ever read. Entries past count[b]
            # land past the new length, where later writes replace them.
            slots = self.len[:, None] + torch.arange(n, device=tok.device)
            _, k, v = m.qkv(m.inputs(self.target.embeddings(tok), feat), slots)
            self._store(self.k, self.v, slots, k, v)
        self.len.add_(count)
        last = feats[torch.arange(feats.shape[0], device=feats.device), (length - 1).clamp(min=0)]
        self.pending.copy_(last if first else torch.where((length > 0)[:, None], last, self.pending))

    def _extend_replay(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor,
                       width: int | None = None, first: bool = False, static: bool = False) -> None:
        """`_extend` from a CUDA graph over static copies of its inputs, one graph per width and
        `first`: a round's (depth + 1, the longest accepted path) or the prompt chunks' (`width`,
        which a narrower last chunk fills from the front; the rest is stale and past `length`),
        the prompt's first chunk a graph of its own (its first token's feature only becomes
        pending: eager, that was ~20 kernel launches a prompt). `static` inputs (the target's
        round graph's outputs, `engine.Round.static`) are read where they are, by a graph of
        their own: copying them was five launches a round."""
        if static:
            return self._extend_in_place(tokens, hidden, length)
        B, n = tokens.shape
        key = (width or n, first)
        if key not in self._extend_graphs:
            W = key[0]
            bufs = (tokens.new_zeros(B, W), {i: hidden[i].new_zeros(B, W, hidden[i].shape[2]) for i in self.capture},
                    torch.zeros_like(length))
            # warm-up and capture with zero lengths: the only writes land past the committed
            # length (cache slots the next extend or rollout overwrites); len keeps, and so
            # does pending, except in a first chunk's, where it holds nothing yet
            _, extend, guard, prompt = self._graph_fns()
            if width is not None:  # a prompt chunk: one compile serves every chunk width
                extend = prompt
                fused.mark_dynamic(1, bufs[0], *bufs[1].values())
            self._extend_graphs[key] = (graphs.capture(lambda: extend(*bufs, first), guard()), bufs)
        graph, (st_tok, st_hid, st_len) = self._extend_graphs[key]
        st_tok[:, :n].copy_(tokens)
        for i in self.capture:
            st_hid[i][:, :n].copy_(hidden[i])
        st_len.copy_(length)
        graph.replay()

    def _extend_in_place(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor) -> None:
        """`_extend_replay` of a round over inputs that are another graph's outputs: a graph
        that reads them where they are, keyed by where that is. Its warm-up and capture run
        `_extend` on the live inputs, so the drafter's length and pending feature are restored
        after (the cache entries they wrote lie past the committed length: scratch)."""
        ins = (tokens, *(hidden[i] for i in self.capture), length)
        key = ("in place", *((t.data_ptr(), t.shape, t.stride()) for t in ins))
        entry = self._extend_graphs.get(key)
        if entry is None:
            saved = self.len.clone(), self.pending.clone()
            guard = self._graph_fns()[2]
            graph = graphs.capture(lambda: self._graph_fns()[1](tokens, hidden, length, False), guard())
            self.len.copy_(saved[0])
            self.pending.copy_(saved[1])
            entry = self._extend_graphs[key] = (graph, ins)  # the inputs stay alive: their storage is not reused
        entry[0].replay()

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        dev = self.target.device
        root = ctx.root if ctx.root is not None else torch.tensor([h[-1] for h in ctx.history], device=dev)
        self._drafting = True
        if not self.started:  # a one-token prompt: no feature to draft from yet
            if self.policy is not None:
                self._unreported.append(0)
            return Draft(root[:, None], topology.chain(1, root.shape[0], device=dev))
        # selection and packing run on the device, inside the rollout's graph when there is one
        # (which runs every depth: a graph cannot stop early), so a round reads nothing back
        # before the verify
        depth = self._round_depth()
        if self.graphs:
            self._reserve(self.entries)
            tokens, parents, valid = self._replay(root, depth)
            return Draft(tokens, parents, valid=valid, static=True)
        tokens, parents, valid = self.draft(root, *self._rollout_cache(), depth=depth)
        return Draft(tokens, parents, valid=valid)

    def _round_depth(self) -> int:
        """This proposal's rollout depth: the policy's choice from the last report read."""
        if self.policy is None:
            return self.depth
        depth = self.policy.choose(self._accepted)
        self._unreported.append(depth)
        return depth

    def observe(self, accepted: list[int]) -> None:
        if self.policy is not None:
            # a root-only proposal (a one-token prompt's first round) says nothing of the drafts
            self._accepted = min(accepted) if self._unreported.popleft() else None

    @torch.no_grad()
    def pool(self, root: torch.Tensor):
        """The whole rollout from the committed state, before selection: the pool's tokens,
        parents and scores [B, P] (`rollout`), eagerly — for studies of which nodes a tree
        should keep (benchmarks/diagnostics/tree_policy.py)."""
        return self.rollout(root, *self._rollout_cache())

    def _rollout_cache(self):
        """The cache's leading slots a rollout reads and writes, room for its entries reserved."""
        self._reserve(self.entries)
        W = self._window()
        return self.k[:, :, :W], self.v[:, :, :W]

    def draft(self, root: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, graphed: bool = False,
              depth: int | None = None):
        """Rollout (`depth` deep, default the deepest), selection and packing: the verifier's
        (tokens, parents, valid). Eagerly the rollout stops once no beam is inside the window τ;
        a graph cannot stop early. A chain without a window is its own packing: it needs no
        scores and no ranking."""
        if self.chain and self.tau is None:
            tokens = self.rollout(root, keys, values, scored=False, depth=depth)[0]
            B, D = tokens.shape
            parents = torch.arange(-1, D, device=root.device).expand(B, -1).contiguous()
            valid = torch.full((B,), D + 1, dtype=torch.long, device=root.device)
            return torch.cat([root[:, None], tokens], 1), parents, valid
        pool = self.rollout(root, keys, values, None if graphed else self.tau, depth=depth)
        levels = tree.pool_depths(pool[0].shape[1], self.topk, self.width, root.device)
        return tree.build_batch(root, *pool, self.budget, self.tau, depth=levels)

    @torch.no_grad()
    def rollout(self, root: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tau: float | None = None,
                scored: bool = True, depth: int | None = None):
        """`tree.beam_search` from root [B] with this drafter: the pool's tokens, parents, scores
        (scored=False, top-1 only: the scores stay 0, `tree.top1`).

        keys, values: the leading slots of the cache ([B, H, W, hd] views) that hold the
        committed entries and room for this rollout's. Entries (the drafter's queries for
        expanded nodes: the root at depth 0, then k beams per depth) go to the slots right
        after the committed length, where the next `extend` overwrites them; each sees the
        committed entries and its own path (`ops.draft_attention`, which also rotates the
        depth's queries and keys and writes its entries).
        """
        m, tgt, w, E = self.model, self.target, self.width, self.entries
        h = self.pending[:, None]  # the feature each beam's parent hands on (the root's: the target's)
        rows = None  # the previous depth's entries' ancestor-or-self rows
        inv_freq = m.inv_freq(h.device, h.dtype)
        # a tree's depths score their beams' h with the head inside the depth step's kernels
        # (and form the next depth's entries' ancestor rows there)
        head = (tree.Head(tgt.lm_head.weight, m.norm.weight, m.norm.eps, E if w > 1 else 0)
                if scored and self.topk > 1 and ops.fuses_head(h.expand(-1, w, -1), tgt.lm_head.weight) else None)

        def step(d, tokens, src, given):
            nonlocal h, rows
            start = 0 if d == 0 else 1 + (d - 1) * w
            if given is not None:
                rows = given
            elif w > 1 and head is None:
                rows = tree.entry_ancestors(None if d == 0 else rows, src, start, E)
            x = m.step_inputs(tgt.embeddings.weight, tokens, h, src)
            q, kk, v = m.qkv(x, None)
            # the root, and a depth's single beam (w = 1), have every earlier entry on their path:
            # no rows for the op to read (in a compiled rollout, no kernel to build them)
            path = rows if w > 1 and d > 0 else None
            attn = ops.draft_attention(q, kk, v, keys, values, self.len, d, start, path, inv_freq, m.scale)
            h = m.finish(x, attn, self._gate_up)
            # the expand normalises the k tokens it keeps
            return h if head is not None else m.logits(h, tgt.lm_head.weight)

        return tree.beam_search(step, root, self.topk, depth or self.depth, tau, scored, w, 1 / self.temperature,
                                first=self._src0, head=head)

    def _into_drafts(self, draft: tuple) -> tuple:
        """A graphed rollout's (tokens, parents, valid), written into the drafts every depth shares
        when there are such (`reset`)."""
        if self._drafts is None:
            return draft
        for buf, x in zip(self._drafts, draft):
            buf.copy_(x)
        return self._drafts

    def _replay(self, root: torch.Tensor, depth: int):
        """`draft` from a CUDA graph over static buffers (root, len, pending, cache), one graph
        per attention window and depth."""
        W = self._window()
        graph = self._graphs.get((W, depth))
        if graph is None:
            keys, values = self.k[:, :, :W], self.v[:, :, :W]
            fused.mark_dynamic(2, keys, values)
            # the rollout only writes cache slots past the committed length
            draft, _, guard, _ = self._graph_fns(depth)
            graph = self._graphs[W, depth] = graphs.capture(lambda: draft(self._root, keys, values), guard())
        self._root.copy_(root)
        graph.replay()
        return graph.out


def find_drafter(model_dir) -> Path | None:
    """The drafter directory shipped with a target checkpoint, if any."""
    path = Path(model_dir) / DRAFTER_DIR
    return path if checkpoint.holds_drafter(path) else None
