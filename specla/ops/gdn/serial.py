"""State-resident serial verifier (SpecLA §4.1) and the kernel the hybrid verifier shares.

One program per (batch row, value head, V-tile) keeps its K×BV fp32 state tile in registers
across every node (full K per program, so o = Sᵀq needs no cross-program reduction), visiting
the nodes in topological order. A node whose parent is not the node just processed restores its
parent's tile from a scratch buffer; only *boundary* nodes — those with a child that is not
their immediate successor — store their tile there, so a chain materialises no state at all.
The serial pass (one program walks every node) walks depth first, each node's leaves before
its other children (`schedule.serial_order`, built once per round). A leaf is verified in
place: its o and u need only its parent's tile, so the pass skips its update and the parent's
tile stays resident for the next sibling. It restores only where it comes back to a node for
a second child with children of its own (2-7 times on Table 1's trees), where index order,
depth by depth, restored at nearly every node. Each visited node, its parent and its kind
(leaf, or a node the walk comes back to, which stores its tile) are read one node ahead as
scalars, not picked out of the topology by a reduction, and the tile a node restores is loaded
while the node before it computes: the parent is an earlier node, whose visit stored the
tile.

Per node j, with the parent's tile S resident and γ = exp(g_j):
    u_j = β_j (v_j - γ Sᵀk_j)                (the corrected update the commit consumes)
    o_j = scale (γ Sᵀq_j + (q_j·k_j) u_j)     (= scale S_jᵀ q_j, without a second pass)
    S_j = γ S + k_j u_jᵀ
Sᵀk, Sᵀq and q·k come out of one reduction over K, so each node costs one cross-warp exchange
and one pass over the tile; node j+1's inputs are loaded while node j computes, hiding their
memory latency behind the recurrence.

`pending = (k, g, u, length)` (delayed update, SpecLA §5.2): the tile is advanced along the
pending accepted path right after it is loaded, written back to `state` (the durable state now
includes the previous round's commit), and verification continues from the advanced tile.

With programmatic dependent launch (`ops.pdl`: chains, the serial pass and the paths, not the
hybrid) the tile is loaded and advanced (and flushed, but by the paths, whose last walking
program writes it back) before the program waits for the prelude that writes the nodes' inputs.

`valid` [B] (chains and the serial tree pass): nodes j >= valid[b] are padding of a fixed-width
verify (`drafters.base.pad_draft`); the recurrence stops there and their o and u are written as zeros.
No real node depends on a padding node, and the serial pass's walk visits `pad_draft`'s padding
(a chain under the last real node) after every real node, so it stops after valid[b] visits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops import pdl
from specla.ops.gdn.commit import advance_tile, decay_update, pending_args, real_nodes
from specla.ops.gdn import schedule
from specla.ops.pdl import wait_previous

# `SerialWalk.kind` values, as constants the kernel can read
_LEAF = tl.constexpr(schedule.LEAF)
_STORE = tl.constexpr(schedule.STORE)


@triton.jit
def _sum3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _pick(vec, idx, i):
    """vec[i] for a register vector (Triton has no dynamic register indexing)."""
    return tl.sum(tl.where(idx == i, vec, 0), 0)


@triton.jit
def _durable_tile(p_S, m_S, b, hv, i_h, pk, pg, pu, plen, P, o_k, mk, o_v, mv, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, PP: tl.constexpr, HAS_PENDING: tl.constexpr,
                  FLUSH: tl.constexpr = True):
    """The root program's state tile: loaded, advanced by the pending update and, with FLUSH,
    written back (the durable state now includes the previous round's commit; the path mode
    writes it back itself, after the walks)."""
    S = tl.load(p_S, mask=m_S, other=0.0)
    if HAS_PENDING:
        S = advance_tile(S, b, hv, i_h, pk, pg, pu, plen, plen, P, P, o_k, mk, o_v, mv, H, HV, K, V, PP, False)
        if FLUSH:
            if tl.load(plen + b) > 0:  # an empty pending buffer leaves the state as it is
                tl.store(p_S, S, mask=m_S)
    return S


@triton.jit
def _node_inputs(p_q, p_k, p_v, g, beta, p_gb, node, ok, s_qn, s_kn, s_vn, mk, mv, HV: tl.constexpr):
    """A node's q, k, v (fp32 rows of the program's head and V-tile), g and beta; zeros where not ok."""
    b_q = tl.load(p_q + node * s_qn, mask=mk & ok, other=0.0).to(tl.float32)
    b_k = tl.load(p_k + node * s_kn, mask=mk & ok, other=0.0).to(tl.float32)
    b_v = tl.load(p_v + node * s_vn, mask=mv & ok, other=0.0).to(tl.float32)
    b_g = tl.load(g + p_gb + node * HV, mask=ok, other=0.0).to(tl.float32)
    b_b = tl.load(beta + p_gb + node * HV, mask=ok, other=0.0).to(tl.float32)
    return b_q, b_k, b_v, b_g, b_b


@triton.jit
def _path_row(chain_len, n_chains, valid, p_tab, b, c, n, HAS_VALID: tl.constexpr):
    """PATHS mode: the c-th path's length (0 past the leaves), the row's leaf count and real
    nodes (what the program's last steps test, read now: a load after the walk's stores would
    hold the program's end for a memory round trip) and the path's second node."""
    L = tl.load(chain_len + b * n + c)
    leaves = tl.load(n_chains + b)
    real = n
    if HAS_VALID:
        real = real_nodes(valid, b, n)
    # masked by n, not by L: the row holds NP >= n entries, so the load need not wait for L's
    # (a walk of one node never uses it)
    node_next = tl.load(p_tab + 1, mask=n > 1, other=0)
    return L, leaves, real, node_next


@triton.jit(do_not_specialize=["n", "P", "n_tiles"])
def tree_verify_kernel(
    q, k, v, g, beta, state, o, u, parents, scratch,
    chain_nodes, chain_len, light, n_chains, flags,
    pk, pg, pu, plen, valid, counters,
    scale, n, P, n_tiles,
    s_qb, s_qn, s_kb, s_kn, s_vb, s_vn,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr,
    TREE: tl.constexpr, HYBRID: tl.constexpr, PATHS: tl.constexpr, HAS_PENDING: tl.constexpr,
    STORE_U: tl.constexpr, WRITE_FINAL: tl.constexpr, HAS_VALID: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """TREE=False: nodes form a chain (parents ignored). TREE, not HYBRID: all n nodes in one
    program per tile (serial verifier), in the order chain_nodes[b] with the visited nodes'
    parents in chain_len[b] and each node's kind in light[b] (`schedule.serial_order`).
    HYBRID: one program per (chain, tile), see hybrid.py.
    PATHS: one program per (tile, table row), walking the row's leaf path if it has one (paths.py)."""
    if PATHS:
        c = tl.program_id(1)
        r = tl.program_id(0)
    elif HYBRID:
        # Work items are handed out in ticket order, chain-major, and chains are ranked
        # topologically: every item waits only on items with smaller tickets, all of which
        # belong to programs already running, so the spin-waits below cannot deadlock.
        # Programs past the real number of items take no ticket (the grid is padded to n chains).
        live = tl.program_id(0) < tl.load(n_chains) * n_tiles
        ticket = tl.where(live, tl.atomic_add(flags, 1, mask=live), n * n_tiles)
        c = ticket // n_tiles
        r = ticket % n_tiles
    else:
        c = 0
        r = tl.program_id(0)
    b = r // (HV * NV)
    hv = (r // NV) % HV
    vt = r % NV
    i_h = hv // (HV // H)

    idx = tl.arange(0, NP)
    if HYBRID:
        prow = tl.load(parents + b * n + idx, mask=idx < n, other=-1).to(tl.int32)
        L = tl.load(chain_len + b * n + c, mask=c < n, other=0)
        nrow = tl.load(chain_nodes + (b * n + c) * n + idx, mask=idx < L, other=-1)
        lrow = tl.load(light + b * n + idx, mask=idx < n, other=0)
        node = _pick(nrow, idx, 0)
    elif PATHS:
        # program c walks the c-th leaf's path root..leaf (`schedule.path_tables`, built once a
        # round, leaves first): its nodes, in index order, read back one node ahead as scalars.
        # With PDL the row is read after the wait: the tables come from the launch just before
        # the first layer's verify
        p_tab = chain_nodes + (b * n + c).to(tl.int64) * NP
        if not PDL:
            L, leaves, real, node_next = _path_row(chain_len, n_chains, valid, p_tab, b, c, n, HAS_VALID)
        node = tl.program_id(0) * 0
    else:
        L = n
        if HAS_VALID:
            L = real_nodes(valid, b, n)
        node = tl.program_id(0) * 0  # a tensor, like the hybrid's: it is loop-carried
        if TREE:  # the walk's next node, read one node ahead (the root always comes first)
            node_next = tl.load(chain_nodes + b * n + 1, mask=L > 1, other=0)

    o_k = tl.arange(0, BK)
    o_v = vt * BV + tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    m_S = mk[:, None] & mv[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    p_S = state + (b * HV + hv).to(tl.int64) * K * V + tile

    if PDL:  # (not the hybrid) the durable tile and its pending update are this layer's own:
        # loaded and advanced (and flushed, but by the paths) while the prelude still writes the
        # inputs. In path mode only the first EARLY table rows do so, walking or not: past them
        # a row rarely holds a leaf (paths.EARLY), and one that does takes its tile after the
        # wait (its path's length is read after it). The write-back stays with the last walking
        # program (below). Outside path mode c is 0: every program goes first
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if c < EARLY:
            S = _durable_tile(p_S, m_S, b, hv, i_h, pk, pg, pu, plen, P, o_k, mk, o_v, mv, H, HV, K, V, PP,
                              HAS_PENDING, FLUSH=not PATHS)
        wait_previous(PDL)
        if PATHS:
            L, leaves, real, node_next = _path_row(chain_len, n_chains, valid, p_tab, b, c, n, HAS_VALID)
            if (c >= EARLY) & (L > 0):
                S = _durable_tile(p_S, m_S, b, hv, i_h, pk, pg, pu, plen, P, o_k, mk, o_v, mv, H, HV, K, V, PP,
                                  HAS_PENDING, FLUSH=False)
    # without PDL the first node's inputs are requested before the state tile, so both loads overlap
    p_q = q + b.to(tl.int64) * s_qb + i_h * K + o_k
    p_k = k + b.to(tl.int64) * s_kb + i_h * K + o_k
    p_v = v + b.to(tl.int64) * s_vb + hv * V + o_v
    p_gb = b * n * HV + hv  # g and beta are contiguous [B, n, HV]
    ok = node >= 0
    b_q, b_k, b_v, b_g, b_b = _node_inputs(p_q, p_k, p_v, g, beta, p_gb, node, ok, s_qn, s_kn, s_vn, mk, mv, HV)

    if PATHS:
        if not PDL:
            # requested before the program knows whether it walks (L), so the two loads overlap;
            # the programs past the leaves come last in the grid and only touch it in L2
            S = tl.load(p_S, mask=m_S, other=0.0)
        start = L > 0
    elif PDL:
        start = False  # the tile is in hand
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        start = node == 0
    ticket = L * 0 - 1
    root = S
    if start:  # this program starts at the root: it owns the durable tile
        if not PATHS:
            S = _durable_tile(p_S, m_S, b, hv, i_h, pk, pg, pu, plen, P, o_k, mk, o_v, mv, H, HV, K, V, PP,
                              HAS_PENDING)
        elif HAS_PENDING:
            if not PDL:  # with PDL the tile was advanced before the wait
                S = advance_tile(S, b, hv, i_h, pk, pg, pu, plen, plen, P, P, o_k, mk, o_v, mv,
                                 H, HV, K, V, PP, False)
            if tl.load(plen + b) > 0:  # an empty pending buffer leaves the state as it is
                # every path advanced its own copy of the tile; the last to have loaded it
                # writes it back after its walk (nobody reads the durable tile then). A
                # release increment: it orders this program's load of the tile before it
                # without holding the walk's loads behind the atomic's round trip.
                tl.debug_barrier()  # every thread's load of the tile is done
                ticket = tl.atomic_add(counters + r, 1, sem="release")
                root = S
    if HYBRID:
        prev = node * 0 - 1
    elif TREE:
        # the serial pass reads the next node's parent one node ahead, so the tile it restores
        # can be loaded while this node computes (module docstring)
        par_next = tl.load(chain_len + b * n + 1, mask=L > 1, other=0)
        par_cur = par_next * 0 - 1
        kind = tl.load(light + b * n)  # the root's
    for t in range(0, L):
        cur, c_q, c_k, c_v, c_g, c_b = node, b_q, b_k, b_v, b_g, b_b
        leaf = False  # only the serial pass and the hybrid verify leaves in place
        # prefetch the next node's inputs; they do not depend on the state
        if HYBRID:
            node = _pick(nrow, idx, t + 1)
        elif PATHS:  # read one node ahead, so the load's latency hides behind a node's work
            node = node_next
            node_next = tl.load(p_tab + t + 2, mask=t + 2 < L, other=0)
        elif TREE:
            node = node_next
            node_next = tl.load(chain_nodes + b * n + t + 2, mask=t + 2 < L, other=0)
        else:
            node = cur + 1
        ok = t + 1 < L
        b_q, b_k, b_v, b_g, b_b = _node_inputs(p_q, p_k, p_v, g, beta, p_gb, node, ok, s_qn, s_kn, s_vn, mk, mv,
                                               HV)

        if HYBRID:
            par = _pick(prow, idx, cur)
            cur_kind = _pick(lrow, idx, cur)
            leaf = cur_kind == _LEAF
            if par != prev:  # the chain's first node: restore its parent's tile once it is ready
                flag = flags + 1 + ((b * n + par) * HV + hv) * NV + vt
                while tl.atomic_add(flag, 0, sem="acquire") == 0:
                    pass
                tl.debug_barrier()
                p_src = scratch + ((b * n + par) * HV + hv).to(tl.int64) * K * V + tile
                S = tl.load(p_src, mask=m_S, other=0.0, cache_modifier=".cg")
        elif TREE:
            # the tile resident after this node is its own, or after a leaf (verified in place)
            # its parent's; the next node restores its parent's tile unless that one is resident.
            # The parent was stored at its own visit, by this program, so the load can start now
            cur_kind = kind
            leaf = cur_kind == _LEAF
            restore = ok & (par_next != tl.where(leaf, par_cur, cur))
            if restore:
                tl.debug_barrier()  # the boundary tiles stored so far are visible to every thread
            p_src = scratch + ((b * n + par_next) * HV + hv).to(tl.int64) * K * V + tile
            S_next = tl.load(p_src, mask=m_S & restore, other=0.0, cache_modifier=".cg")
            par_cur = par_next
            par_next = tl.load(chain_len + b * n + t + 2, mask=t + 2 < L, other=0)
            kind = tl.load(light + b * n + node, mask=ok, other=0)
            boundary = cur_kind == _STORE

        # one reduction pass (one cross-warp exchange) gives Sᵀk, Sᵀq and q·k together; the
        # decay is applied to the reduced vectors, not to the tile first
        gamma = tl.exp(c_g)
        kS, qS, qk = tl.reduce((S * c_k[:, None], S * c_q[:, None], (c_q * c_k)[:, None] + tl.zeros_like(S)),
                               0, _sum3)
        b_u = c_b * (c_v - gamma * kS)
        if not leaf:  # a leaf's tile has no reader: its parent's stays resident
            S = decay_update(S, gamma, c_k, b_u)
        b_o = (gamma * qS + qk * b_u) * scale
        p_out = ((b * n + cur) * HV + hv).to(tl.int64) * V + o_v
        tl.store(o + p_out, b_o, mask=mv)
        if STORE_U:
            tl.store(u + p_out, b_u, mask=mv)

        if HYBRID:
            if cur_kind == _STORE:
                p_dst = scratch + ((b * n + cur) * HV + hv).to(tl.int64) * K * V + tile
                tl.store(p_dst, S, mask=m_S)
                tl.debug_barrier()  # every thread's part of the tile is stored before the flag
                tl.atomic_xchg(flags + 1 + ((b * n + cur) * HV + hv) * NV + vt, 1, sem="release")
        elif TREE:
            if boundary:
                p_dst = scratch + ((b * n + cur) * HV + hv).to(tl.int64) * K * V + tile
                tl.store(p_dst, S, mask=m_S)
            S = tl.where(restore, S_next, S)
        if HYBRID:  # the resident tile's node: a leaf leaves its parent's
            prev = tl.where(leaf, prev, cur)

    if WRITE_FINAL:
        tl.store(p_S, S, mask=m_S)
    if PATHS:
        if ticket == leaves - 1:  # the last path to load the tile writes it back and re-arms
            tl.store(p_S, root, mask=m_S)  # the counter for the next launch
            tl.atomic_xchg(counters + r, 0, sem="relaxed")
        if HAS_VALID:  # a padding node: defined outputs (zeros), written by its own program
            if c >= real:
                p_out = ((b * n + c) * HV + hv).to(tl.int64) * V + o_v
                tl.store(o + p_out, tl.zeros([BV], dtype=tl.float32), mask=mv)
                if STORE_U:
                    tl.store(u + p_out, tl.zeros([BV], dtype=tl.float32), mask=mv)
    elif HAS_VALID:  # padding nodes: defined outputs (zeros) without their recurrence
        for t in range(L, n):
            p_out = ((b * n + t) * HV + hv).to(tl.int64) * V + o_v
            tl.store(o + p_out, tl.zeros([BV], dtype=tl.float32), mask=mv)
            if STORE_U:
                tl.store(u + p_out, tl.zeros([BV], dtype=tl.float32), mask=mv)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, n, heads, D] with each token's [heads, D] block contiguous (batch/token strides free)."""
    if x.stride(3) != 1 or x.stride(2) != x.shape[3]:
        x = x.contiguous()
    return x


def launch(q, k, v, g, beta, state, parents, scale, pending, *, grid, tree, hybrid=None, paths=None,
           store_u=True, write_final=False, valid=None, block_v, num_warps, early: int = 1 << 30):
    """Allocate outputs and run `tree_verify_kernel`; returns (o, u). paths: (table, length,
    leaves, counters) for the path-per-program mode (paths.py, `schedule.path_tables`); early:
    the path rows that take their tile before the wait (`paths.EARLY`)."""
    B, n, HV, V = v.shape
    H, K = k.shape[2], k.shape[3]
    dev = state.device
    q, k, v = _rows(q), _rows(k), _rows(v)
    o = torch.empty(B, n, HV, V, dtype=state.dtype, device=dev)
    u = torch.empty_like(o) if store_u else o
    # boundary tiles, indexed by node id; allocation only: just the boundaries are written
    scratch = torch.empty(B, n, HV, K, V, dtype=torch.float32, device=dev) if tree and paths is None else o
    pk, pg, pu, plen, P, PP, has_pending = pending_args(pending, dev)
    # the hybrid's programs synchronise through flags that the launch before them zeroes: they
    # wait for it whole. The paths' counters are re-armed by the last program of the launch
    # that used them, which finished before this layer's first launch (a cuBLAS matmul, no PDL)
    pdl_options = pdl.launch_options(dev, allowed=hybrid is None)
    if hybrid is not None:
        sched = hybrid
    elif tree and paths is None:
        walk = schedule.plan_for(parents).serial_order(parents)
        sched = (walk.order, walk.parent, walk.kind, parents, parents)
    elif paths is not None:  # the paths, their lengths and the leaf count in the hybrid's slots
        sched = (paths[0], paths[1], parents, paths[2], parents)
    else:
        sched = (parents,) * 5
    tree_verify_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(), state, o, u, parents, scratch, *sched,
        pk, pg, pu, plen, plen if valid is None else valid, o if paths is None else paths[3],
        scale, n, P, B * HV * triton.cdiv(V, block_v),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=block_v, NV=triton.cdiv(V, block_v),
        NP=triton.next_power_of_2(n) if tree else 1, PP=PP, TREE=tree and paths is None,
        HYBRID=hybrid is not None, PATHS=paths is not None,
        HAS_PENDING=has_pending, STORE_U=store_u, WRITE_FINAL=write_final, HAS_VALID=valid is not None,
        EARLY=early, num_warps=num_warps, **pdl_options)
    return o, u


def block_size(V: int, block_v: int) -> int:
    return min(block_v, triton.next_power_of_2(V))


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, valid=None, *,
                    chain: bool = False, block_v: int = 16, num_warps: int = 4):
    """Same contract as `naive.gdn_tree_verify` (fp32 state). `chain=True` promises
    parents[:, j] = j - 1, which skips the topology bookkeeping."""
    B, n, HV, V = v.shape
    BV = block_size(V, block_v)
    grid = (B * HV * triton.cdiv(V, BV),)
    return launch(q, k, v, g, beta, state, parents.contiguous(), scale, pending, grid=grid,
                  tree=not chain, valid=None if valid is None else valid.contiguous(),
                  block_v=BV, num_warps=num_warps)


def gdn_chain_sequence(q, k, v, g, beta, state, scale, *, block_v: int = 16, num_warps: int = 4):
    """AR/prefill contract of `naive.gdn_recurrent`: consume the tokens, advance `state` in place."""
    B, n, HV, V = v.shape
    BV = block_size(V, block_v)
    grid = (B * HV * triton.cdiv(V, BV),)
    o, _ = launch(q, k, v, g, beta, state, state, scale, None, grid=grid, tree=False,
                  store_u=False, write_final=True, block_v=BV, num_warps=num_warps)
    return o
