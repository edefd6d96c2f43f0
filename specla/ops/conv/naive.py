"""Pure-torch references for the short causal convolution over ancestor windows (DESIGN §1-2).

x holds pre-conv inputs [B, n, C]; the conv state [B, C, W-1] holds the last W-1 consumed
inputs, oldest first; weight is [C, W] (fla's depthwise Conv1d weight squeezed), the last tap
multiplying the current token. Outputs go through SiLU, as in every GDN mixer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specla.ops.gdn.naive import factors
from specla.topology import ancestor_table


def tree_conv(x, conv_state, weight, bias, parents):
    """y_j = silu(Σ_t weight[:, W-1-t] · (t-th ancestor input of j) + bias), [B, n, C].

    Ancestors past the root come from the conv state, so each node sees exactly its own
    history. Nothing is written.
    """
    B, n, C = x.shape
    W = weight.shape[1]
    hist = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, W-1+n, C]
    anc = ancestor_table(parents, W) + (W - 1)  # index into hist; [B, n, W], t = 0 is self
    win = hist.gather(1, anc.reshape(B, n * W, 1).expand(-1, -1, C)).reshape(B, n, W, C)
    y = torch.einsum("bntc,ct->bnc", win, weight.flip(1).to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    return F.silu(y)


def _state_after(hist, length, conv_state):
    """Write into conv_state [B, C, W-1] the W-1 inputs of hist [B, W-1+T, C] (the old state
    then T new inputs) that end with the length[b]-th new one."""
    idx = length[:, None] + torch.arange(conv_state.shape[2], device=hist.device)[None]  # [B, W-1]
    conv_state.copy_(hist.gather(1, idx[..., None].expand(-1, -1, hist.shape[2])).transpose(1, 2).to(conv_state.dtype))


def conv_commit(conv_state, x, path, length):
    """Advance the conv state in place: its last W-1 inputs after consuming x[path[:length]]."""
    B, P = path.shape
    rows = torch.arange(B, device=x.device)[:, None]
    xp = x[rows, path].to(conv_state.dtype)  # [B, P, C]
    _state_after(torch.cat([conv_state.transpose(1, 2), xp], dim=1), length, conv_state)


def conv_sequence(x, conv_state, weight, bias, valid=None):
    """AR/prefill reference: causal conv over a plain sequence, updating the conv state in place.
    valid [B]: only the first valid[b] inputs are real; the state ends after the last of them."""
    B, T, C = x.shape
    W = weight.shape[1]
    hist = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, W-1+T, C]
    y = F.conv1d(hist.transpose(1, 2), weight.to(x.dtype)[:, None, :], bias.to(x.dtype) if bias is not None else None,
                 groups=C)
    if W > 1:
        if valid is None:
            conv_state.copy_(hist[:, T:].transpose(1, 2).to(conv_state.dtype))
        else:
            _state_after(hist, valid, conv_state)
    return F.silu(y.transpose(1, 2))



def conv_taps(x, conv_state, weight, bias, valid=None):
    """`conv_sequence` written as W multiply-adds (so a compiler fuses it), accumulated in fp32
    (fp64 for fp64 inputs) in tap order like cuDNN's conv and rounded once to x's dtype, then
    SiLU; the conv state advanced in place (to the valid[b]-th input, as `conv_sequence`). The
    fused path's sequence region (prefill) computes the conv this way; decode steps take
    `step_prelude`, a verify's arithmetic."""
    T, W = x.shape[1], weight.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    hist = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, W-1+T, C], oldest first
    y = hist[:, 0:T].to(acc) * weight[:, 0].to(acc)
    for j in range(1, W):
        y = y + hist[:, j:j + T].to(acc) * weight[:, j].to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    if valid is None:
        conv_state.copy_(hist[:, T:].transpose(1, 2).to(conv_state.dtype))
    else:
        _state_after(hist, valid, conv_state)
    return F.silu(y.to(x.dtype))


def step_conv(x, conv_state, weight, bias):
    """An AR step's conv, one token per row (x [B, 1, C]): `tree_conv` of the token as a
    one-node chain, so a step computes what a verify computes for that position, then the conv
    state moved on by the token in place."""
    B = x.shape[0]
    if x.shape[1] != 1:
        raise ValueError(f"step_conv takes one token per row, got {x.shape[1]}")
    root = torch.full((B, 1), -1, dtype=torch.long, device=x.device)
    y = tree_conv(x, conv_state, weight, bias, root)
    conv_commit(conv_state, x, torch.zeros_like(root), torch.ones(B, dtype=torch.long, device=x.device))
    return y


def step_prelude(x, conv_state, weight, bias, a, b, A_log, dt_bias, num_heads: int, head_dim: int,
                 neg_eigval: bool, state_dtype=torch.float32):
    """An AR step's GDN inputs from its projection, one token per row: `step_conv` (the conv
    state advanced in place), then the factors, as `tree_prelude` computes them for a one-node
    verify.

    x [B, 1, C] pre-conv inputs (C = 2·H·K + HV·V: q, k, v), a, b [B, 1, HV]; returns q, k
    [B, 1, H, K] (l2-normalised), v [B, 1, HV, V], g and beta [B, 1, HV], in `state_dtype`.
    """
    xc = step_conv(x, conv_state, weight, bias).to(state_dtype)
    return factors(xc, a, b, A_log, dt_bias, num_heads, head_dim, neg_eigval, state_dtype)


def tree_prelude(x, conv_state, weight, bias, parents, a, b, A_log, dt_bias, num_heads: int, head_dim: int,
                 neg_eigval: bool, state_dtype=torch.float32):
    """A verify's GDN inputs from its projection: `tree_conv` over each node's ancestors (the
    conv state is only read), then the factors, as `step_prelude` returns them for n nodes."""
    xc = tree_conv(x, conv_state, weight, bias, parents).to(state_dtype)
    return factors(xc, a, b, A_log, dt_bias, num_heads, head_dim, neg_eigval, state_dtype)

