"""The building blocks every model here shares: RMS norm and the SwiGLU MLP (the target's
layers, the hybrid attention and MoE layers, the drafters)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(y.dtype)
        return (y * (1 + w if self.zero_centered else w)).to(x.dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        self._gu, self._gu_key = None, None

    def forward(self, x, gate_up: torch.Tensor | None = None):
        """gate_up: `gate_up_weight()`, gate and up as one matmul instead of two."""
        if gate_up is None:
            g, u = ops.linear(x, self.gate_proj.weight), ops.linear(x, self.up_proj.weight)
        else:
            g, u = ops.linear(x, gate_up).chunk(2, -1)
        return ops.linear(F.silu(g) * u, self.down_proj.weight)

    def gate_up_weight(self) -> torch.Tensor:
        """A detached copy of [gate_proj; up_proj] for decoding (training keeps the two), rebuilt
        when the weights change (moved, cast, edited in place); it costs their memory once more."""
        g, u = self.gate_proj.weight, self.up_proj.weight
        key = (g.data_ptr(), g._version, u.data_ptr(), u._version, g.dtype)
        if key != self._gu_key:
            self._gu, self._gu_key = torch.cat([g.detach(), u.detach()], 0), key
        return self._gu
