"""Triton `beam_expand` (same contract as `naive.py`): one rollout depth in one or two launches.

Inductor made one depth's log-softmax, the per-beam top-k (k max-reductions with a scatter
between them) and the top-k of the children into a dozen or more kernels. Here:
1. `_chunk_kernel`, one program per (beam row, vocabulary chunk): the chunk's k best logits
   (lowest id first among equal values) and its max and sum of exponentials;
2. `_merge_kernel`, one program per batch row: each beam's log-sum-exp from its chunks, its k
   best tokens from the chunks' candidates (every id sits in one chunk, so no candidate
   repeats), the children's scores, and the k best children.
A single beam (the root's depth, and every depth of a width-1 tree) over a vocabulary of at
most ROW_MAX takes one launch, `_row_kernel`: one program per batch row holds the whole row,
and its children are the next beams in their own order (scores fall with the logits).
The chunks find each pick's value and lowest index in one reduction over packed keys
(`_keys`; H200: 2.5 → 2.3 µs a chunk launch); the row kernel keeps two reductions a pick.

`head_expand` starts one step earlier, from the beams' hidden states: `_head_chunk_kernel`, one
program per (batch row, HEAD_CHUNK tokens of the vocabulary), RMS-normalises the row's beams,
forms their logits for its tokens against that slice of the LM head (`tl.dot`) and reduces them
as `_chunk_kernel` does, so the logits are never written; `_merge_kernel` follows and also hands
the rollout its next beams (tokens, scores, parents, ancestor rows). A tree depth was six
launches on the demo drafter (the norm, cuBLAS's LM head over the beams, the chunks, the merge,
Inductor's gather and ancestor rows: ~11 µs of GPU time a depth on the H200,
tree_shapes_8f57fb9_profile.json); now two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops.linear.triton import _rms_normed

CHUNK = 1024
# vocabulary a head-chunk program scores: the demo's 8,192-token head in 128 programs of 32 KiB of
# weights each (one program per chunk of 1024 would leave the head's read to 8 SMs)
HEAD_CHUNK = 64
HEAD_WARPS = 4
# "native": bf16 / fp16 operands straight into the dot (H100, b964ef6: 10.6 against 11.1 µs a
# 4-beam depth, the same outputs); "fp32": the operands widened first
HEAD_DOT = "native"
MAX_HEAD_WIDTH = 1024  # a head-chunk program holds its beams' whole rows (as `ops.linear`'s fused kernels)
ROW_MAX = 16384  # one program holds a row of up to this many logits (64 KiB of fp32 registers)
BIG = tl.constexpr(2 ** 31 - 1)  # an index past any vocabulary (a jitted global must be a constexpr)
NO_KEY = tl.constexpr(-2 ** 63)  # below every key of `_keys`: lanes past the row, and taken ones


@triton.jit
def _keys(xv, offs, live):
    """int64 keys ordered as (value, then lower index first): the float's bits made
    order-preserving as a signed int in the high half, the complement of the index in the low
    half, so one max-reduction finds the best value and its lowest index (two reductions
    without the packing). -0.0 is made +0.0 first: they tie as floats."""
    xv = tl.where(xv == 0.0, 0.0, xv)
    bits = xv.to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    return tl.where(live, key, NO_KEY)


@triton.jit
def _unkey(key):
    """(value, index) of a key of `_keys`."""
    sv = (key >> 32).to(tl.int32)
    v = (sv ^ ((sv >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return v, 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _chunk_kernel(x, cand_v, cand_i, cmax, csum, V, NC, s_row, scale, K: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    live = offs < V
    xv = tl.load(x + row.to(tl.int64) * s_row + offs, mask=live, other=float("-inf")).to(tl.float32) * scale
    m = tl.max(xv, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf only: its sum is 0
    tl.store(cmax + row * NC + c, m)
    tl.store(csum + row * NC + c, tl.sum(tl.where(live, tl.exp(xv - m_safe), 0.0), 0))
    key = _keys(xv, offs, live)
    out = (row * NC + c) * K
    for j in tl.static_range(K):
        best = tl.max(key, 0)
        v, i = _unkey(best)
        tl.store(cand_v + out + j, v)
        tl.store(cand_i + out + j, i)
        key = tl.where(key == best, NO_KEY, key)


@triton.jit
def _head_chunk_kernel(h, norm_w, weight, cand_v, cand_i, cmax, csum, nb, V, D, NC, eps, scale,
                       K: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                       FP32_DOT: tl.constexpr):
    b, c = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, NB)
    cols = tl.arange(0, BD)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mr, mk, live = rows < nb, cols < D, offs < V
    wt = tl.load(weight + offs[:, None].to(tl.int64) * D + cols[None, :], mask=live[:, None] & mk[None, :],
                 other=0.0)
    xf = tl.load(h + (b * nb + rows)[:, None] * D + cols[None, :], mask=mr[:, None] & mk[None, :],
                 other=0.0).to(tl.float32)
    # as the modules: the norm's output rounded to h's dtype, the logits to it too
    xn = _rms_normed(xf, tl.load(norm_w + cols, mask=mk, other=0.0).to(tl.float32), D, eps, h.dtype.element_ty)
    if FP32_DOT:  # fp32 operands (PREC tf32 holds bf16 values exactly): fp32 models, and the
        # interpreter, which computes bf16 dots wrongly (triton 3.7.1)
        acc = tl.dot(xn, tl.trans(wt.to(tl.float32)), input_precision=PREC)
    else:  # the operands as loaded: the products are exact in fp32 either way
        acc = tl.dot(xn.to(wt.dtype), tl.trans(wt))
    xv = acc.to(h.dtype.element_ty).to(tl.float32) * scale  # [NB, BLOCK]
    xv = tl.where(live[None, :], xv, float("-inf"))
    m = tl.max(xv, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    r = b * nb + rows
    tl.store(cmax + r * NC + c, m, mask=mr)
    tl.store(csum + r * NC + c, tl.sum(tl.where(live[None, :], tl.exp(xv - m_safe[:, None]), 0.0), 1), mask=mr)
    key = _keys(xv, offs[None, :], live[None, :])
    out = (r * NC + c) * K
    for j in tl.static_range(K):
        best = tl.max(key, 1)
        v, i = _unkey(best)
        tl.store(cand_v + out + j, v, mask=mr)
        tl.store(cand_i + out + j, i, mask=mr)
        key = tl.where(key == best[:, None], NO_KEY, key)


@triton.jit
def _merge_kernel(cand_v, cand_i, cmax, csum, beam_scores, tok, scores, beams, next_tok, next_score, next_src,
                  prev_rows, next_rows, nb, NC, start, E, s_rb,
                  K: tl.constexpr, KP: tl.constexpr, NB: tl.constexpr, NCP: tl.constexpr, NCK: tl.constexpr,
                  NEXT: tl.constexpr, HAS_BS: tl.constexpr, ROWS: tl.constexpr, HAS_ROWS: tl.constexpr,
                  EP: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, NB)
    live = rows < nb
    r = b * nb + rows
    cols = tl.arange(0, NCK)
    m_c = live[:, None] & (cols < NC * K)[None, :]
    v = tl.load(cand_v + r[:, None] * NC * K + cols[None, :], mask=m_c, other=float("-inf"))
    ix = tl.load(cand_i + r[:, None] * NC * K + cols[None, :], mask=m_c, other=BIG)
    cc = tl.arange(0, NCP)
    m_s = live[:, None] & (cc < NC)[None, :]
    cm = tl.load(cmax + r[:, None] * NC + cc[None, :], mask=m_s, other=float("-inf"))
    cs = tl.load(csum + r[:, None] * NC + cc[None, :], mask=m_s, other=0.0)
    top = tl.max(cm, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    lse = top + tl.log(tl.where(live, tl.sum(cs * tl.exp(cm - top[:, None]), 1), 1.0))
    if HAS_BS:
        bs = tl.load(beam_scores + r, mask=live, other=0.0).to(tl.float32)
    else:  # the root's depth: every beam scores 0
        bs = tl.zeros([NB], tl.float32)
    kk = tl.arange(0, KP)
    child = tl.full([NB, KP], float("-inf"), tl.float32)
    ctok = tl.zeros([NB, KP], tl.int32)
    if ROWS:
        e = tl.arange(0, EP)
    if ROWS and HAS_ROWS:  # the beams' rows, requested before the picks: no pick waits on a load
        prow = tl.load(prev_rows + b * s_rb + rows[:, None] * E + e[None, :],
                       mask=live[:, None] & (e < E)[None, :], other=0).to(tl.int32)
    for j in tl.static_range(K):
        mv = tl.max(v, 1)
        mi = tl.min(tl.where(v == mv[:, None], ix, BIG), 1)
        sc = bs + (mv - lse)
        tl.store(tok + b * nb * K + rows * K + j, mi, mask=live)
        tl.store(scores + b * nb * K + rows * K + j, sc, mask=live)
        child = tl.where((kk == j)[None, :] & live[:, None], sc[:, None], child)
        ctok = tl.where((kk == j)[None, :], mi[:, None], ctok)
        v = tl.where(ix == mi[:, None], float("-inf"), v)
    flat = rows[:, None] * K + kk[None, :]
    for j in tl.static_range(K):
        best = tl.max(tl.max(child, 1), 0)
        f = tl.min(tl.min(tl.where(child == best, flat, BIG), 1), 0)
        tl.store(beams + b * K + j, f)
        if NEXT:  # the next beam's token, score and parent beam: no gather or division follows the launch
            tl.store(next_tok + b * K + j, tl.sum(tl.sum(tl.where(flat == f, ctok, 0), 1), 0))
            tl.store(next_score + b * K + j, best)
            tl.store(next_src + b * K + j, f // K)
        if ROWS:  # the next entry's ancestor-or-self row: its parent entry's (the root's at the
            # root's depth), and itself
            if HAS_ROWS:
                row = tl.max(tl.where((rows == f // K)[:, None], prow, 0), 0) != 0
            else:
                row = e == 0
            tl.store(next_rows + (b * K + j) * E + e, (row | (e == start + j)).to(tl.uint8), mask=e < E)
        child = tl.where(flat == f, float("-inf"), child)


@triton.jit
def _row_kernel(x, beam_scores, tok, scores, beams, V, s_row, scale, K: tl.constexpr, BLOCK: tl.constexpr):
    # value and lowest index by two float/int reductions, not `_keys`: over a whole row in one
    # program the int64 reductions cost more (H200: 4.9 against 4.5 µs a call)
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < V
    xv = tl.load(x + b.to(tl.int64) * s_row + offs, mask=live, other=float("-inf")).to(tl.float32) * scale
    m = tl.max(xv, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse = m_safe + tl.log(tl.sum(tl.where(live, tl.exp(xv - m_safe), 0.0), 0))
    bs = tl.load(beam_scores + b).to(tl.float32)
    for j in tl.static_range(K):
        v = tl.max(xv, 0)
        i = tl.min(tl.where(live & (xv == v), offs, BIG), 0)
        tl.store(tok + b * K + j, i)
        tl.store(scores + b * K + j, bs + (v - lse))
        tl.store(beams + b * K + j, j)
        xv = tl.where(offs == i, float("-inf"), xv)


def beam_expand(logits: torch.Tensor, beam_scores: torch.Tensor, topk: int, scale: float = 1.0):
    """Same contract as `naive.beam_expand` (float32 or lower-precision logits; V >= topk)."""
    B, nb, V = logits.shape
    dev = logits.device
    x = logits.contiguous()
    if nb == 1 and V <= ROW_MAX:
        tok = torch.empty(B, topk, dtype=torch.long, device=dev)
        scores = torch.empty(B, topk, dtype=torch.float32, device=dev)
        beams = torch.empty(B, topk, dtype=torch.long, device=dev)
        BLOCK = triton.next_power_of_2(V)
        _row_kernel[(B,)](x, beam_scores.float().contiguous(), tok, scores, beams, V, V, scale, K=topk, BLOCK=BLOCK,
                          num_warps=max(4, min(16, BLOCK // 1024)))
        return tok, scores, beams
    BLOCK = min(CHUNK, triton.next_power_of_2(V))
    NC = triton.cdiv(V, BLOCK)
    cand_v = torch.empty(B * nb, NC, topk, dtype=torch.float32, device=dev)
    cand_i = torch.empty(B * nb, NC, topk, dtype=torch.int32, device=dev)
    cmax = torch.empty(B * nb, NC, dtype=torch.float32, device=dev)
    csum = torch.empty_like(cmax)
    _chunk_kernel[(B * nb, NC)](x, cand_v, cand_i, cmax, csum, V, NC, V, scale, K=topk, BLOCK=BLOCK)
    return _merge(cand_v, cand_i, cmax, csum, beam_scores, B, nb, NC, topk)


def merge_warps(nb: int, NC: int, topk: int) -> int:
    """Warps of a merge: 4, more once its candidates ([nb, NC·topk] values and ids) outgrow
    them (4 beams of the head-chunk's 128 chunks spilled on 4 warps, `aot_check`)."""
    return max(4, min(16, triton.next_power_of_2(nb) * triton.next_power_of_2(NC * topk) // 256))


def _merge(cand_v, cand_i, cmax, csum, beam_scores, B: int, nb: int, NC: int, topk: int, nxt: bool = False,
           rows: torch.Tensor | None = None, start: int = 0, entries: int = 0):
    """The merge launch: (tok, scores, beams), and with nxt the next beams' tokens, scores,
    parent beams and ancestor rows ([B, topk, entries], `naive.head_expand`)."""
    dev = cand_v.device
    tok = torch.empty(B, nb * topk, dtype=torch.long, device=dev)
    scores = torch.empty(B, nb * topk, dtype=torch.float32, device=dev)
    beams = torch.empty(B, topk, dtype=torch.long, device=dev)
    out = (tok, scores, beams)
    if nxt:
        out += (torch.empty(B, topk, dtype=torch.long, device=dev), torch.empty(B, topk, dtype=torch.float32, device=dev),
                torch.empty(B, topk, dtype=torch.long, device=dev),
                torch.empty(B, topk, entries, dtype=torch.bool, device=dev))
    r = cand_v if rows is None else (rows if rows.stride(-1) == 1 and rows.stride(1) == entries
                                     else rows.contiguous()).view(torch.uint8)
    bs = cand_v if beam_scores is None else beam_scores.float().contiguous()
    _merge_kernel[(B,)](cand_v, cand_i, cmax, csum, bs, tok, scores, beams,
                        *(out[3:6] if nxt else (tok, scores, beams)), r, out[6].view(torch.uint8) if nxt and entries else tok,
                        nb, NC, start, entries, r.stride(0) if rows is not None else 0,
                        K=topk, KP=triton.next_power_of_2(topk), NB=triton.next_power_of_2(nb),
                        NCP=triton.next_power_of_2(NC), NCK=triton.next_power_of_2(NC * topk), NEXT=nxt,
                        HAS_BS=beam_scores is not None, ROWS=nxt and entries > 0, HAS_ROWS=rows is not None,
                        EP=max(16, triton.next_power_of_2(entries)), num_warps=merge_warps(nb, NC, topk))
    return out


def head_chunks(h: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float, topk: int,
                scale: float = 1.0, *, block: int | None = None, num_warps: int | None = None,
                fp32_dot: bool | None = None):
    """`head_expand`'s first launch: each (batch row, `block` tokens of the vocabulary)'s top-k
    candidates of every beam and their max and sum of exponentials, (cand_v, cand_i, cmax, csum).
    block, num_warps: default HEAD_CHUNK and HEAD_WARPS, read at the call; fp32_dot: the
    operands in fp32 (default: on fp32 or mixed inputs and off the GPU, HEAD_DOT == "fp32")."""
    block = block or HEAD_CHUNK
    B, nb, D = h.shape
    V = weight.shape[0]
    if D > MAX_HEAD_WIDTH or nb > 16 or weight.shape[1] != D:
        raise ValueError(f"head_expand takes up to 16 beams of at most {MAX_HEAD_WIDTH} values and a [V, D] head, "
                         f"got h {tuple(h.shape)}, weight {tuple(weight.shape)}")
    if fp32_dot is None:
        fp32_dot = (HEAD_DOT == "fp32" or h.device.type != "cuda" or h.dtype == torch.float32
                    or weight.dtype != h.dtype)
    NC = triton.cdiv(V, block)
    dev = h.device
    cand_v = torch.empty(B * nb, NC, topk, dtype=torch.float32, device=dev)
    cand_i = torch.empty(B * nb, NC, topk, dtype=torch.int32, device=dev)
    cmax = torch.empty(B * nb, NC, dtype=torch.float32, device=dev)
    csum = torch.empty_like(cmax)
    _head_chunk_kernel[(B, NC)](h.contiguous(), norm_weight.contiguous(), weight.contiguous(), cand_v, cand_i, cmax,
                                csum, nb, V, D, NC, eps, scale, K=topk, NB=16, BLOCK=block,
                                BD=triton.next_power_of_2(D), PREC="ieee" if h.dtype == torch.float32 else "tf32",
                                FP32_DOT=fp32_dot, num_warps=num_warps or HEAD_WARPS)
    return cand_v, cand_i, cmax, csum


def head_expand(h: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                beam_scores: torch.Tensor | None, topk: int, scale: float = 1.0, rows: torch.Tensor | None = None,
                start: int = 0, entries: int = 0, **tiling):
    """Same contract as `naive.head_expand` (seven outputs): h [B, nb, D] the beams' hidden states
    (fp32 or lower precision, D <= MAX_HEAD_WIDTH, nb <= 16), weight [V, D] the LM head (V >= topk),
    beam_scores None for zeros; tiling: `head_chunks`'s keywords."""
    B, nb, _ = h.shape
    cand_v, cand_i, cmax, csum = head_chunks(h, weight, norm_weight, eps, topk, scale, **tiling)
    return _merge(cand_v, cand_i, cmax, csum, beam_scores, B, nb, cand_v.shape[1], topk, True, rows, start, entries)
