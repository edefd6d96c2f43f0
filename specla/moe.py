"""Sparse mixture-of-experts MLP (Qwen3-Next / Qwen3.5-MoE).

    p        = softmax(W_router x)                       # fp32 (fp64 for fp64 models)
    w, e     = top-k(p)                                  # w /= sum(w) when norm_topk_prob
    y        = Σ_i w_i · down_{e_i}( silu(gate_{e_i} x) * up_{e_i} x )
             + sigmoid(W_sg x) · shared_expert(x)        # when shared_expert_intermediate_size > 0

Expert weights are stacked: `experts_gate_up` [E, 2I, hidden] (gate rows first, then up) and
`experts_down` [E, hidden, I], as transformers 5 stores them. Two ways to run the routed part,
chosen from shapes alone (no host sync, so a decode or verify step stays graph-capturable):

- gather (tokens * k <= E, e.g. batch-1 decode and verify): index the k selected experts'
  weights by id and run batched mat-vecs; only the selected experts' weights are read.
- grouped (prefill): loop over the experts some token selected, each on its own tokens.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.config import ModelConfig
from specla.errors import UnsupportedConfigError
from specla.layers import GatedMLP
from specla.precision import accumulation_dtype


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, k, I, D = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
        if E <= 0 or not 0 < k <= E or I <= 0:
            raise UnsupportedConfigError(
                f"MoE layer needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0 "
                f"(got num_experts={E}, num_experts_per_tok={k}, moe_intermediate_size={I})")
        self.E, self.k, self.I = E, k, I
        self.norm_topk_prob = cfg.norm_topk_prob
        self.router = nn.Linear(D, E, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(E, 2 * I, D))
        self.experts_down = nn.Parameter(torch.empty(E, D, I))
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(D, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(D, 1, bias=False)
        else:
            self.shared_expert = None

    def route(self, x: torch.Tensor):
        """x [N, hidden] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        logits = self.router(x)
        probs = torch.softmax(logits.to(accumulation_dtype(x.dtype)), dim=-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w.to(x.dtype), idx

    def gathers(self, tokens: int) -> bool:
        """Whether `tokens` rows take the gather path (graph-capturable) rather than the grouped
        one, which reads the selected expert ids on the host."""
        return tokens * self.k <= self.E

    def _gather(self, x, w, idx):
        N, D = x.shape
        flat = idx.reshape(-1)  # [N * k]
        xk = x.repeat_interleave(self.k, dim=0)[:, :, None]  # [N * k, D, 1]
        gu = torch.bmm(self.experts_gate_up.index_select(0, flat), xk).squeeze(-1)  # [N * k, 2I]
        g, u = gu.split(self.I, dim=-1)
        hid = (F.silu(g) * u)[:, :, None]
        y = torch.bmm(self.experts_down.index_select(0, flat), hid).squeeze(-1)  # [N * k, D]
        return (y * w.reshape(-1, 1)).reshape(N, self.k, D).sum(1)

    def _grouped(self, x, w, idx):
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            g, u = F.linear(x[tok], self.experts_gate_up[e]).split(self.I, dim=-1)
            y = F.linear(F.silu(g) * u, self.experts_down[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y)
        return out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        w, idx = self.route(x)
        y = self._gather(x, w, idx) if self.gathers(x.shape[0]) else self._grouped(x, w, idx)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(shape)
