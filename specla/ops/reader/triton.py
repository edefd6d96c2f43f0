"""Fused ReaDy state reader: gather the source layers' committed states, flush, read.

Same contract as `naive.state_read` (fp32 states; see there for shapes). One launch covers
every source layer: one program per (row b, source layer l, value head hv, V-tile of BV
columns) loads its K×BV state tile once and, in registers,

1. advances it by the layer's pending accepted update, if any (`advance_tile`, the factor
   commit of `ops.gdn_commit` as a device function) and writes the advanced tile back when
   `flush` and the row has something pending — so this pass is also the flush;
2. reads it: r = Qᵀ S for the NQ draft-position queries of (b, l, hv) (one [NQ, K] × [K, BV]
   product, IEEE fp32);
3. compresses the reads by the value map (rank R) on the fly: the tile's share Σ_{v in tile}
   r[:, v] W_l[v, :] goes to a per-V-tile partial sum, reduced over the V-tiles after the
   launch (deterministic; with one V-tile it is the result) — or, without a value map, stores
   r itself;
4. adds the tile's Σ S² to a per-V-tile partial of the state-scale feature ‖S‖².

The source layers' states are separate tensors (one per layer of the target's cache); the
kernel reaches them through a small device table (int64 [L, 6]: the state's offset in elements
from the first source state — which keeps the compiler's alignment facts, so tile loads stay
vectorised — then the pending k, g, u, length addresses and the pending width), built once per
set of buffers and cached, so a CUDA graph that captured the launch keeps reading the same
(in place updated) buffers. Reads use tf32x3 dots (fp32-level accuracy; IEEE fp32 dots spill
registers at K = 128 with a pending update).

Tiling: BV = 16, 4 warps by default; `block_v`, `num_warps` are parameters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops.gdn.commit import advance_tile


@triton.jit(do_not_specialize=["NQ", "B"])
def _state_read_kernel(table, base, q, vmap, reads, sqn, NQ, B, s_qb, s_qp, s_ql,
                       L: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                       PQ: tl.constexpr, RR: tl.constexpr, PP: tl.constexpr, USE_DOT: tl.constexpr,
                       HAS_PENDING: tl.constexpr, HAS_VMAP: tl.constexpr,
                       FLUSH: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    vt = pid % NV
    hv = (pid // NV) % HV
    lay = (pid // (NV * HV)) % L
    b = pid // (NV * HV * L)
    i_h = hv // (HV // H)
    row = table + lay * 6

    o_k = tl.arange(0, BK)
    o_v = vt * BV + tl.arange(0, BV)
    o_p = tl.arange(0, PQ)
    mk, mv, mp = o_k < K, o_v < V, o_p < NQ
    m_S = mk[:, None] & mv[None, :]
    # the queries are requested before the state tile, so both loads overlap
    Q = tl.load(q + b.to(tl.int64) * s_qb + o_p[:, None] * s_qp + lay * s_ql + hv * K + o_k[None, :],
                mask=mp[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [PQ, BK]
    # the state's address as an element offset from `base` (the first source state), so the
    # compiler keeps base's 16-byte alignment (vectorised tile loads) when the host saw it hold
    off = tl.load(row)
    if ALIGNED:
        off = tl.multiple_of(off, 4)
    p_S = base + off + (b * HV + hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.load(p_S, mask=m_S, other=0.0)
    if HAS_PENDING:
        pk = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        pg = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        pu = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        plen = tl.load(row + 4).to(tl.pointer_type(tl.int64))
        P = tl.load(row + 5)
        S = advance_tile(S, b, hv, i_h, pk, pg, pu, plen, plen, P, P, o_k, mk, o_v, mv,
                         H, HV, K, V, PP, False)
        if FLUSH:
            if tl.load(plen + b) > 0:  # nothing pending: the state stays as it is
                tl.store(p_S, S, mask=m_S)

    if USE_DOT:
        r = tl.dot(Q, S, input_precision="tf32x3")  # [PQ, BV]
    else:
        r = tl.sum(Q[:, :, None] * S[None, :, :], 1)
    tl.store(sqn + ((vt * B + b) * L + lay) * HV + hv, tl.sum(tl.sum(S * S, 1), 0))
    if HAS_VMAP:
        o_r = tl.arange(0, RR)
        mr = o_r < R
        W = tl.load(vmap + (lay * V + o_v[:, None]) * R + o_r[None, :], mask=mv[:, None] & mr[None, :],
                    other=0.0).to(tl.float32)  # [BV, RR]
        if USE_DOT:
            part = tl.dot(r, W, input_precision="tf32x3")  # [PQ, RR]
        else:
            part = tl.sum(r[:, :, None] * W[None, :, :], 1)
        p_out = reads + ((((vt * B + b) * NQ + o_p[:, None]).to(tl.int64) * L + lay) * HV + hv) * R + o_r[None, :]
        tl.store(p_out, part, mask=mp[:, None] & mr[None, :])
    else:
        p_out = reads + (((b * NQ + o_p[:, None]).to(tl.int64) * L + lay) * HV + hv) * V + o_v[None, :]
        tl.store(p_out, r, mask=mp[:, None] & mv[None, :])


_TABLES: dict = {}
_DUMMIES: dict = {}


def _dummy(device, B: int):
    key = (str(device), B)
    if key not in _DUMMIES:
        _DUMMIES[key] = (torch.zeros(1, device=device), torch.zeros(B, dtype=torch.long, device=device))
    return _DUMMIES[key]


def address_table(states, pendings) -> torch.Tensor:
    """int64 [L, 6] device table: per source layer the state's offset in elements from the first
    state, then the pending buffers' addresses and width (cached per set of buffers).

    Built outside a CUDA-graph capture (its first call for a set of buffers copies to the
    device); later calls with the same buffers return the cached tensor without any copy.
    """
    B = states[0].shape[0]
    fz, lz = _dummy(states[0].device, B)
    base = states[0].data_ptr()
    rows = []
    for S, pend in zip(states, pendings):
        off = (S.data_ptr() - base) // S.element_size()  # fp32 tensors: whole elements apart
        if pend is None or pend[0].shape[1] == 0:
            rows.append((off, fz.data_ptr(), fz.data_ptr(), fz.data_ptr(), lz.data_ptr(), 0))
        else:
            pk, pg, pu, plen = pend
            rows.append((off, pk.data_ptr(), pg.data_ptr(), pu.data_ptr(), plen.data_ptr(), pk.shape[1]))
    key = (str(states[0].device), base, tuple(rows))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 256:
            _TABLES.clear()
        table = torch.tensor(rows, dtype=torch.int64).to(states[0].device)
        _TABLES[key] = table
    return table


def _check(states, pendings, queries, value_map):
    L = len(states)
    if L == 0 or queries.shape[2] != L or len(pendings) != L:
        raise ValueError(f"{L} states, {len(pendings)} pendings, queries for {queries.shape[2]} layers")
    shape = states[0].shape
    for S in states:
        if S.shape != shape or S.dtype != torch.float32 or not S.is_contiguous():
            raise ValueError("source states must be contiguous fp32 tensors of one shape")
    H = None
    for pend in pendings:
        if pend is None:
            continue
        pk, pg, pu, plen = pend
        if not all(t.is_contiguous() for t in pend) or pk.dtype != torch.float32 or plen.dtype != torch.long:
            raise ValueError("pending buffers must be contiguous (fp32 factors, int64 length)")
        if H is not None and pk.shape[2] != H:
            raise ValueError("pending keys of the source layers have different head counts")
        H = pk.shape[2]
    if value_map is not None and (value_map.shape[0] != L or value_map.shape[1] != shape[3]):
        raise ValueError(f"value map of shape {tuple(value_map.shape)} for {L} layers of value dim {shape[3]}")
    return H if H is not None else shape[1]


def state_read(states, pendings, queries, value_map=None, flush: bool = True, *,
               block_v: int = 16, num_warps: int = 4):
    """Same contract as `naive.state_read` (fp32 states, no autograd)."""
    states, pendings = list(states), list(pendings)
    H = _check(states, pendings, queries, value_map)
    B, HV, K, V = states[0].shape
    L, NQ = len(states), queries.shape[1]
    dev = states[0].device
    if queries.stride(4) != 1 or queries.stride(3) != K:
        queries = queries.contiguous()
    BV = min(block_v, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    BK = triton.next_power_of_2(K)
    use_dot = BV >= 16 and BK >= 16
    P = max([p[0].shape[1] for p in pendings if p is not None] or [0])
    PP = max(P, 1)  # the pending rows advance_tile visits
    PQ = triton.next_power_of_2(max(NQ, 1))
    R = value_map.shape[2] if value_map is not None else V
    RR = triton.next_power_of_2(R)
    if use_dot:
        PQ, RR = max(PQ, 16), max(RR, 16)
    table = address_table(states, pendings)
    sqn = torch.empty(NV, B, L, HV, dtype=torch.float32, device=dev)
    if value_map is not None:
        value_map = value_map.to(torch.float32).contiguous()
        reads = torch.empty(NV, B, NQ, L, HV, R, dtype=torch.float32, device=dev)
    else:
        reads = torch.empty(B, NQ, L, HV, V, dtype=torch.float32, device=dev)
    if B * NQ > 0:
        _state_read_kernel[(B * L * HV * NV,)](
            table, states[0], queries, value_map if value_map is not None else sqn, reads, sqn, NQ, B,
            queries.stride(0), queries.stride(1), queries.stride(2),
            L=L, H=H, HV=HV, K=K, V=V, R=R, BK=BK, BV=BV, NV=NV, PQ=PQ, RR=RR, PP=PP, USE_DOT=use_dot,
            HAS_PENDING=P > 0, HAS_VMAP=value_map is not None, FLUSH=flush,
            ALIGNED=all(S.data_ptr() % 16 == 0 for S in states), num_warps=num_warps)
    if value_map is not None:
        reads = reads[0] if NV == 1 else reads.sum(0)
    return reads, (sqn[0] if NV == 1 else sqn.sum(0))


# ahead-of-time compile check (no GPU needed) -------------------------------------------------

def aot_variants():
    """(name, constexprs, num_warps): the demo shape and a Qwen3-Next-like one (HV 32, dk = dv = 128)."""
    for HV, K, V in ((4, 64, 64), (32, 128, 128)):
        for R, vmap in ((8, True), (32, True), (V, False)):
            for pending in (True, False):
                for BV in (16,):  # the default tile (BV = 32 spills at K = 128, R = 8)
                    yield (f"state_read HV={HV} K={K} BV={BV} R={R if vmap else 'full'}{' +pending' if pending else ''}",
                           dict(L=2, H=HV, HV=HV, K=K, V=V, R=R, BK=K, BV=BV, NV=V // BV, PQ=16, RR=max(16, R),
                                PP=16, USE_DOT=True, HAS_PENDING=pending, HAS_VMAP=vmap, FLUSH=True,
                                ALIGNED=True), 4)


def aot_check(arch: int = 90) -> list[tuple[str, int, int]]:
    """Compile every variant for sm_`arch`; (name, registers, spill bytes)."""
    from specla.ops.aot_check import compile_variant

    def type_of(arg: str) -> str:
        return ("i32" if arg in ("NQ", "B", "s_qb", "s_qp", "s_ql") else "*i64" if arg == "table" else
                "*bf16" if arg == "q" else "*fp32")

    out = []
    for name, consts, warps in aot_variants():
        _, info = compile_variant(_state_read_kernel, consts, warps, arch, type_of)
        out.append((name, info["registers"], info["spill_bytes"]))
    return out


if __name__ == "__main__":  # python -m specla.ops.reader.triton   (TRITON_INTERPRET unset)
    import sys

    worst = 0
    for name, regs, spills in aot_check():
        print(f"{name:56s} registers {regs:3d}  spill bytes {spills}")
        worst = max(worst, spills)
    sys.exit(1 if worst else 0)
