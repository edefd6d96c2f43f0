"""The target model in plain PyTorch: embeddings, Gated DeltaNet mixers, SwiGLU MLPs, LM head.

Two entry points share every weight:
- `forward(tokens, cache)`: a plain causal sequence (prefill, AR decode); updates the cache.
- `verify(tokens, parents, cache)`: logits for every node of a draft topology plus factor
  records (DESIGN §2); the durable state is only read (pending delayed updates aside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla import ops
from specla.ops.gdn.naive import factors as gdn_factors
from specla.ops.gdn.naive import mask_padding
from specla.ops.norm.naive import gated as gated_rms_norm  # the GDN output norm
from specla.attention import GatedAttention
from specla.config import ATTENTION, ModelConfig
from specla.layers import GatedMLP, RMSNorm
from specla.moe import SparseMoE
from specla.precision import accumulation_dtype
from specla.state import Cache, GDNLayerState, GDNRecord, KVLayerState


class GatedDeltaNet(nn.Module):
    """GDN mixer (DESIGN §1) with one fused input projection [q | k | v | z | a | b]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.H, self.HV, self.K, self.V = cfg.num_heads, cfg.num_v_heads, cfg.head_dim, cfg.head_v_dim
        self.split = [cfg.key_dim, cfg.key_dim, cfg.value_dim, cfg.value_dim if cfg.use_gate else 0, self.HV, self.HV]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        if cfg.use_short_conv:
            self.conv_weight = nn.Parameter(torch.empty(cfg.conv_dim, cfg.conv_size))
            self.conv_bias = nn.Parameter(torch.zeros(cfg.conv_dim)) if cfg.conv_bias else None
        self.A_log = nn.Parameter(torch.zeros(self.HV))
        self.dt_bias = nn.Parameter(torch.zeros(self.HV))
        self.o_norm_weight = nn.Parameter(torch.ones(self.V))
        self.o_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)
        self.scale = self.K ** -0.5

    def new_state(self, batch: int, device, dtype) -> GDNLayerState:
        S = torch.zeros(batch, self.HV, self.K, self.V, device=device, dtype=accumulation_dtype(dtype))
        conv = None
        if self.cfg.use_short_conv:
            conv = torch.zeros(batch, self.cfg.conv_dim, self.cfg.conv_size - 1, device=device, dtype=dtype)
        return GDNLayerState(S, conv)

    def _project(self, h):
        x, z, a, b = torch.split(self.in_proj(h), [sum(self.split[:3])] + self.split[3:4] + self.split[4:], dim=-1)
        return x, (z if self.cfg.use_gate else None), a, b

    def _factors(self, xc, a, b, sdt):
        """Conv output -> per-head q, k (l2-normalised), v, log-decay g, beta, in state precision."""
        return gdn_factors(xc.to(sdt), a, b, self.A_log, self.dt_bias, self.H, self.K,
                           bool(self.cfg.allow_neg_eigval), sdt)

    def _output(self, o, z, dtype):
        B, n = o.shape[:2]
        zz = None if z is None else z.reshape(B, n, self.HV, self.V)
        y = gated_rms_norm(o, zz, self.o_norm_weight, self.cfg.norm_eps, self.cfg.gate_activation)
        return self.o_proj(y.reshape(B, n, -1).to(dtype))

    def forward(self, h, st: GDNLayerState, valid=None):
        """Consume h as a plain sequence from the committed state: the caller flushes any
        pending update first (`Cache.flush`, as `Model.forward` does). `valid` [B]: only the
        first valid[b] tokens are real; the padding after them leaves both states as they were."""
        x, z, a, b = self._project(h)
        if st.conv is None:
            xc = F.silu(x)
        elif h.shape[1] == 1 and valid is None:
            # an AR step convolves as a verify's one-node chain, so it computes the bits a verify
            # computes for that position (docs/exact.md)
            xc = ops.step_conv(x, st.conv, self.conv_weight, self.conv_bias)
        else:
            xc = ops.conv_sequence(x, st.conv, self.conv_weight, self.conv_bias, valid)
        q, k, v, g, beta = self._factors(xc, a, b, st.S.dtype)
        if valid is not None:
            g, beta = mask_padding(g, beta, valid)
        o = ops.gdn_sequence(q, k, v, g, beta, st.S, self.scale, chunked=valid is not None)
        return self._output(o, z, h.dtype)

    def train_forward(self, h):
        """Differentiable forward from a zero state (training)."""
        from specla.ops.gdn.train import gdn_train

        x, z, a, b = self._project(h)
        if self.cfg.use_short_conv:
            W = self.cfg.conv_size
            xc = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), self.conv_weight[:, None, :].to(x.dtype),
                          None if self.conv_bias is None else self.conv_bias.to(x.dtype), groups=x.shape[-1])
            xc = F.silu(xc.transpose(1, 2))
        else:
            xc = F.silu(x)
        q, k, v, g, beta = self._factors(xc, a, b, torch.float32)
        return self._output(gdn_train(q, k, v, g, beta, self.scale).float(), z, h.dtype)

    def verify(self, h, parents, st: GDNLayerState, chain: bool = False, valid=None):
        x, z, a, b = self._project(h)
        if st.conv is not None:
            xc = ops.tree_conv(x, st.conv, self.conv_weight, self.conv_bias, parents)
        else:
            xc = F.silu(x)
        q, k, v, g, beta = self._factors(xc, a, b, st.S.dtype)
        o, u = ops.gdn_tree_verify(q, k, v, g, beta, st.S, parents, self.scale, st.pending, chain, valid)
        if st.pending is not None:  # folded into S by the verify
            st.pending[3].zero_()
        rec = GDNRecord(x=x if st.conv is not None else None, k=k, g=g, u=u)
        return self._output(o, z, h.dtype), rec


def make_mixer(cfg: ModelConfig, layer: int) -> nn.Module:
    if cfg.layer_types[layer] == ATTENTION:
        return GatedAttention(cfg)
    return GatedDeltaNet(cfg)


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    if cfg.is_moe_layer(layer):
        return SparseMoE(cfg)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        zc = cfg.norm_style == "zero_centered"
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, zc)
        self.mixer = make_mixer(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, zc)
        self.mlp = make_mlp(cfg, layer)

    def run(self, x, st, cache_length, parents=None, chain=False, valid=None):
        """The block on x: a plain sequence (parents None; advances `st`) or a verify of the
        topology `parents` (`Model.verify`). Returns (x, the verify's record or None)."""
        h = self.attn_norm(x)
        kv = isinstance(st, KVLayerState)
        if parents is None:  # padding past `valid` is harmless to K/V: later slots are rewritten
            o, rec = (self.mixer(h, st, cache_length) if kv else self.mixer(h, st, valid)), None
        else:
            o, rec = (self.mixer.verify(h, parents, st, cache_length, chain) if kv
                      else self.mixer.verify(h, parents, st, chain, valid))
        x = x + o
        return x + self.mlp(self.mlp_norm(x)), rec


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, n, vocab]; None from a prefill that asked for none
    hidden: dict[int, torch.Tensor]  # residual stream after the captured layers, [B, n, D]
    records: list | None = None  # verify only: one record per layer


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_style == "zero_centered")
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight

    @property
    def device(self):
        return self.embeddings.weight.device

    @property
    def dtype(self):
        return self.embeddings.weight.dtype

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> Cache:
        max_len = max_len or self.cfg.max_position_embeddings
        layers = [blk.mixer.new_state(batch, self.device, self.dtype) if isinstance(blk.mixer, GatedDeltaNet)
                  else blk.mixer.new_state(batch, max_len, self.device, self.dtype) for blk in self.layers]
        return Cache(layers, torch.zeros(batch, dtype=torch.long, device=self.device))

    def _head(self, x, hidden, logits: bool = True):
        return ModelOutput(self.lm_head(self.norm(x)) if logits else None, hidden)

    def train_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Differentiable logits [B, T, vocab] from an empty state (training; pure GDN stacks)."""
        x = self.embeddings(tokens)
        for blk in self.layers:
            x = x + blk.mixer.train_forward(blk.attn_norm(x))
            x = x + blk.mlp(blk.mlp_norm(x))
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: Cache, capture: tuple[int, ...] = (),
                valid: torch.Tensor | None = None, logits: bool = True) -> ModelOutput:
        """Consume tokens [B, T] as a plain sequence, advancing `cache` by T; with `valid` [B]
        (a padded chunk of a graph-captured prefill, `GraphTarget.prefill`) by valid[b]: the
        padding leaves every state as it was and its outputs are not meaningful. `logits`
        False: no LM head (a prompt's prefill reads only the state and the captured layers)."""
        fused = getattr(self, "_fused", None)
        if fused is not None and fused.takes(tokens, verify=False):
            return fused.forward(tokens, cache, capture, valid, logits)
        cache.flush()  # a plain sequence starts from the committed state (free when clean)
        x = self.embeddings(tokens)
        hidden = {}
        for i, blk in enumerate(self.layers):
            x, _ = blk.run(x, cache.layers[i], cache.length, valid=valid)
            if i in capture:
                hidden[i] = x
        cache.length.add_(tokens.shape[1] if valid is None else valid)
        return self._head(x, hidden, logits)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, parents: torch.Tensor, cache: Cache,
               capture: tuple[int, ...] = (), chain: bool = False, valid=None) -> ModelOutput:
        """Score every node of the topology `parents` [B, n] (node 0 = root) from `cache`.
        `chain`: the caller promises a chain (attention then reads keys in position order).
        `valid` [B]: real nodes per row; the rest is padding (`drafters.base.pad_draft`) whose outputs
        nobody reads, which lets the GDN recurrence stop early."""
        fused = getattr(self, "_fused", None)
        if fused is not None and fused.takes(tokens, verify=True):
            return fused.verify(tokens, parents, cache, capture, chain, valid)
        x = self.embeddings(tokens)
        hidden, records = {}, []
        for i, blk in enumerate(self.layers):
            x, rec = blk.run(x, cache.layers[i], cache.length, parents, chain, valid)
            records.append(rec)
            if i in capture:
                hidden[i] = x
        out = self._head(x, hidden)
        out.records = records
        return out
