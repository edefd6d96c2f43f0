"""Device-side topology plans for the Triton verifiers (SpecLA §4.2-4.3).

Everything here is built with batched torch ops on the parent array's own device, with no
host sync, so the same code runs inside a CUDA-graph capture and the schedule replays as data.

- `ancestor_closure`: M̄[b, j, i] = 1 iff i is j or an ancestor of j (the tree mask of the UT form);
  the plans build it through `ops.ancestor_closure` (the Triton kernel of `closure.py` where
  Triton runs).
- `hld_schedule`: the hybrid verifier's schedule: heavy-light decomposition of the inner nodes
  into node-disjoint chains, each node's leaves verified in place right after it; equal to
  `specla.topology.heavy_light_chains` row by row.
- `SERIAL_COST`/`prefer_serial`: a cost model that sends a row to one serial pass (one
  program per V-tile walking every node depth first) when heavy-light chains would not pay
  for their overhead; `hld_schedule(..., fallback=True)` writes that serial pass as the row's
  single "chain", so the choice is data too.
- `serial_order`: the serial pass's depth-first walk (leaves in place) and the nodes it must
  store a tile for.
- `path_tables`: every leaf's root-to-leaf path (the path verifier's schedule).
- `plan_for`: a per-parents-tensor cache of the above, so the 24 layers of one verify round
  build the plan once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specla import ops
from specla.graphs import capturing


def ancestor_closure(parents: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Float mask [B, W, W] (W = width or n): 1 where column i is row j or one of its ancestors.

    Reflexive-transitive closure of the parent relation by repeated squaring: ceil(log2(n - 1))
    small batched matmuls. Entries stay 0/1 (clamped after each product), so any matmul
    precision is exact. Rows and columns past n are 0.
    """
    B, n = parents.shape
    W = width or n
    idx = torch.arange(n, device=parents.device)
    R = (parents[:, :, None] == idx).float() + torch.eye(n, device=parents.device)
    for _ in range(max(0, n - 2).bit_length()):
        R = torch.bmm(R, R).clamp_(max=1.0)
    if W > n:
        R = torch.nn.functional.pad(R, (0, W - n, 0, W - n))
    return R


def path_tables(parents: torch.Tensor, valid: torch.Tensor | None = None):
    """The path verifier's schedule: (table [B, n, TS] int32, length [B, n] int32, leaves [B]
    int32), TS = next_power_of_2(n), in leaf order. Node c is a leaf when it is real (c < valid[b])
    and no real node's parent; row j < leaves[b] describes the j-th leaf by index:
    table[b, j, :length[b, j]] lists its path root..leaf in index order (entries past the length
    are unspecified); length is 0 in the rows past the leaves. Leaf order puts the verifier's
    walking programs first in its grid (the GPU hands blocks out in order).
    """
    B, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)
    real = torch.full((B,), n, device=dev) if valid is None else valid.long().clamp(0, n)
    live = idx[None] < real[:, None]
    par = torch.where(live, parents.long(), -1)
    on = (ancestor_closure(par) > 0) & live[:, None, :]
    leaf = live & ~((par[:, :, None] == idx) & live[:, :, None]).any(1)
    TS = 1 << max(0, n - 1).bit_length()
    pos = torch.where(on & leaf[:, :, None], on.long().cumsum(2) - 1, TS)
    table = torch.zeros(B, n, TS + 1, dtype=torch.int32, device=dev)
    table.scatter_(2, pos, idx.int().expand(B, n, n).contiguous())
    length = torch.where(leaf, on.sum(2), 0).int()
    order = torch.argsort((~leaf).int(), dim=1, stable=True)  # leaves first, by index
    table = table[:, :, :TS].gather(1, order[:, :, None].expand(B, n, TS))
    return table.contiguous(), length.gather(1, order).contiguous(), leaf.sum(1).int()


@dataclass
class HybridSchedule:
    """The chains of every row, as fixed-size int32 tables (padded to n chains of n nodes).

    Chains are ranked by their first node's index, which is topological: a chain's boundary
    node (its first node's parent) always lies in a chain of lower rank.
    """

    nodes: torch.Tensor  # [B, n, n]: nodes[b, c, p] = p-th node of chain c (valid for p < length)
    length: torch.Tensor  # [B, n]: nodes in chain c; 0 for unused slots
    light: torch.Tensor  # [B, n] per node: LEAF (verified in place), STORE (a boundary: a child starts another chain) or 0
    count: torch.Tensor  # [1]: the most chains of any row (the launch's grid is padded past it)
    serial_rows: torch.Tensor | None = None  # [B] bool: rows scheduled as one serial pass (fallback)


# Cost model, in µs per layer at the paper shape (HV = 8, dk = dv = 256, BV = 8, 1 warp),
# fitted by `bench kernels` (`cost_fit`, least squares over Table 1's 12 beam trees) on the
# H200 at 658292c (kernels_658292c_h200.json), where the serial pass walks depth first with
# leaves in place and the hybrid's chains verify leaves in place: a visited node costs ~0.93 µs
# and a restore nothing measurable (the parent's tile is loaded while the node before it
# computes); the hybrid ~8.3 µs plus ~0.33 µs a node of total work (programs, boundary traffic)
# plus its critical path of visits. With these constants the model sends each of the 12 trees
# to the route that measured faster (the constants before, fitted when the serial pass walked
# in index order, 8 of 12); the (4, 4, 32) and (4, 24, 32) trees, where it picks chains, are
# within 2% either way.
SERIAL_COST = {"node": 0.93, "restore": 0.0, "hybrid_fixed": 8.3, "hybrid_node": 0.33}


def serial_restores(parents: torch.Tensor) -> torch.Tensor:
    """Float [B]: the tiles the serial pass's walk (`serial_order`) restores a layer. It comes
    back to a node once for each of its children with children of their own but the first."""
    par = parents[:, 1:].long().clamp(min=0)
    inner = torch.zeros(parents.shape, device=parents.device).scatter_(1, par, 1.0)
    per_node = torch.zeros(parents.shape, device=parents.device).scatter_add_(1, par, inner[:, 1:])
    return (per_node - 1).clamp(min=0).sum(1)


def _terms(parents: torch.Tensor, M: torch.Tensor, is_head: torch.Tensor, leaf: torch.Tensor,
           n_leaves: torch.Tensor):
    """What the costs are linear in: (restores [B], visits [B, n], hops [B, n]): the serial
    pass's restores, and per node the hybrid's visits until its chain has verified it and its
    leaves, and the chain starts on its root path (a chain continues once its boundary node is
    visited, so a boundary's later leaves are not on that path)."""
    restores = serial_restores(parents)
    par = parents.long().clamp(min=0)
    n_leaves = n_leaves.float()
    hop = is_head.float().clone()
    hop[:, 0] = 0.0  # the root chain starts from the state, not from a boundary tile
    # a chain node after the first waits for its chain predecessor's leaves too
    behind = torch.where(is_head | leaf, 0.0, n_leaves.gather(1, par))
    visits = torch.bmm(M, (1.0 + behind)[:, :, None])[..., 0] + n_leaves
    hops = torch.bmm(M, hop[:, :, None])[..., 0]  # chain starts on that path
    return restores, visits, hops


def cost_terms(parents: torch.Tensor):
    """`_terms` of a parent array [B, n] (for fitting `SERIAL_COST` to measured times)."""
    parents = parents.long()
    M = ancestor_closure(parents)
    return _terms(parents, M, *_heads(parents, M))


def _costs(parents: torch.Tensor, M: torch.Tensor, is_head: torch.Tensor, leaf: torch.Tensor,
           n_leaves: torch.Tensor, cost: dict | None = None):
    """(serial, hybrid) estimated cost per row, [B] each."""
    c = SERIAL_COST if cost is None else cost
    n = parents.shape[1]
    restores, visits, hops = _terms(parents, M, is_head, leaf, n_leaves)
    serial = c["node"] * n + c["restore"] * restores
    crit = (c["node"] * visits + c["restore"] * hops).amax(1)
    hybrid = c["hybrid_fixed"] + c["hybrid_node"] * n + crit
    return serial, hybrid


def prefer_serial(parents: torch.Tensor, cost: dict | None = None) -> torch.Tensor:
    """Bool [B]: the cost model expects one serial pass to beat heavy-light chains on the row."""
    parents = parents.long()
    M = ancestor_closure(parents)
    serial, hybrid = _costs(parents, M, *_heads(parents, M), cost)
    return serial <= hybrid


def _heads(parents: torch.Tensor, M: torch.Tensor):
    """(is_head [B, n], leaf [B, n], n_leaves [B, n]): the hybrid's chain heads, the leaves it
    verifies in place and each node's count of leaf children. Leaves (nodes other than the root with no children) join their parent's chain; the
    inner nodes are split by heavy-light decomposition (the inner child with the largest
    subtree continues the chain, ties to the lower index), so a head is the root or an inner
    node that is not its parent's heavy child."""
    B, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    size = M.sum(1).long()  # subtree sizes
    par = parents[:, 1:].clamp(min=0)
    leaf = (size == 1) & (idx > 0)
    score = torch.where(leaf, -1, size * (n + 1) + (n - idx))  # larger subtree first, then lower index
    best = torch.full((B, n), -1, dtype=torch.long, device=parents.device).scatter_reduce(1, par, score[:, 1:], "amax")
    heavy = torch.zeros(B, n, dtype=torch.bool, device=parents.device)
    heavy[:, 1:] = (score[:, 1:] == best.gather(1, par)) | leaf[:, 1:]
    n_leaves = torch.zeros(B, n, dtype=torch.long, device=parents.device).scatter_add_(1, par, leaf[:, 1:].long())
    return ~heavy, leaf, n_leaves


LEAF, STORE = 2, 1  # `SerialWalk.kind`


@dataclass
class SerialWalk:
    """The serial pass's walk of every row, int32 tables (see `serial_order`)."""

    order: torch.Tensor  # [B, n]: the t-th node visited
    parent: torch.Tensor  # [B, n]: the parent of order[t] (-1 for the root)
    kind: torch.Tensor  # [B, n] per node: LEAF, STORE (the walk returns to it later) or 0


def serial_order(parents: torch.Tensor) -> SerialWalk:
    """A depth-first preorder (root first) for the serial pass.

    A node's children go leaves first, then the others by the largest index in their subtrees,
    so the chain `pad_draft` hangs under a row's last real node comes last and the real nodes
    fill the first valid[b] positions. A leaf is verified in place: its output needs only its
    parent's tile, so the pass leaves that tile resident (kind LEAF), and the next sibling
    starts from it without a restore. A restore happens only where the walk returns to a node
    for its second child with children of its own: sum over nodes of (such children - 1). The
    index order the pass used before (drafters number nodes depth by depth) restored at nearly
    every node of a beam tree.
    """
    parents = parents.long()
    B, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)
    M = ops.ancestor_closure(parents) > 0  # M[b, j, i]: i is j or one of j's ancestors
    size = M.sum(1)
    par = parents.clamp(min=0)
    nonroot = idx > 0
    inner = torch.zeros(B, n, dtype=torch.bool, device=dev).scatter_(1, par[:, 1:], True)
    # siblings go by key: leaves first, then by the largest index in their subtrees
    key = torch.where(M, idx[None, :, None], -1).amax(1) + n * inner
    earlier = (par[:, :, None] == par[:, None, :]) & (key[:, None, :] < key[:, :, None]) \
        & nonroot[None, :, None] & nonroot[None, None, :]  # [b, a, s]: s's subtree comes before a's
    skip = (earlier * size[:, None, :]).sum(2)
    # a node's position: one step per ancestor-or-self below the root, plus the subtrees of
    # each one's earlier siblings
    pos = (M * torch.where(nonroot, 1 + skip, 0)[:, None, :]).sum(2)
    order = torch.zeros(B, n, dtype=torch.long, device=dev).scatter_(1, pos, idx.expand(B, n))
    parent = parents.gather(1, order)
    # the tile resident after visiting order[t]: its own, or its parent's after a leaf
    prev = order[:, :-1]
    resident = torch.where(inner.gather(1, prev), prev, parents.gather(1, prev))
    restore = (parent[:, 1:] != resident).int()
    store = torch.zeros(B, n, dtype=torch.int32, device=dev).scatter_add_(1, par.gather(1, order)[:, 1:], restore)
    kind = torch.where(inner, STORE * (store > 0).int(), LEAF).int()
    return SerialWalk(order.int(), parent.int(), kind)


def hld_schedule(parents: torch.Tensor, fallback: bool = False, cost: dict | None = None) -> HybridSchedule:
    """The hybrid's chains for every row: the inner nodes by heavy-light decomposition (ties:
    the lower node index is heavy), each chain visiting a node's leaves in place right after
    the node (`_heads`). Equal to `topology.heavy_light_chains` row by row.

    fallback: rows the cost model (`SERIAL_COST`) expects to run faster as one serial pass get
    a single item holding every node in the serial pass's walk (`serial_order`, with its kinds:
    the kernel restores a parent's tile whenever it is not the resident one); `serial_rows`
    says which rows did.
    """
    parents = parents.long()
    B, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)
    M = ops.ancestor_closure(parents)
    is_head, leaf, n_leaves = _heads(parents, M)
    par = parents.clamp(min=0)
    # a node's chain starts at its deepest ancestor-or-self that is a chain head
    head = torch.where((M > 0) & is_head[:, None, :], idx, -1).amax(-1)
    # position in the chain: one visit per chain node above, plus each one's leaves; a leaf
    # comes after its parent and its lower-numbered leaf siblings
    above = (M > 0) & (head[:, :, None] == head[:, None, :]) & (idx[:, None] != idx[None, :])
    pos = (above.long() * torch.where(leaf, 0, 1 + n_leaves)[:, None, :]).sum(2)
    sib = leaf[:, None, :] & (par[:, None, :] == par[:, :, None]) & (idx[None, :] < idx[:, None])
    pos = pos + torch.where(leaf, sib.long().sum(2) - n_leaves.gather(1, par), 0)
    rank = is_head.long().cumsum(1) - 1
    chain = rank.gather(1, head)
    nodes = torch.zeros(B, n * n, dtype=torch.int32, device=dev)
    nodes.scatter_(1, chain * n + pos, idx.int().expand(B, n).contiguous())
    length = torch.zeros(B, n, dtype=torch.int32, device=dev)
    length.scatter_add_(1, chain, torch.ones(B, n, dtype=torch.int32, device=dev))
    store = torch.zeros(B, n, dtype=torch.int32, device=dev).scatter_add_(1, par[:, 1:], is_head[:, 1:].int())
    light = torch.where(leaf, LEAF, STORE * (store > 0).int()).int()
    chains = is_head.sum(1)
    serial_rows = torch.zeros(B, dtype=torch.bool, device=dev)
    nodes = nodes.view(B, n, n)
    if fallback:
        cs, ch = _costs(parents, M, is_head, leaf, n_leaves, cost)
        serial_rows = cs <= ch
        walk = serial_order(parents)
        s_nodes = torch.zeros(B, n, n, dtype=torch.int32, device=dev)
        s_nodes[:, 0] = walk.order
        s_length = torch.zeros(B, n, dtype=torch.int32, device=dev)
        s_length[:, 0] = n
        sel = serial_rows[:, None]
        nodes = torch.where(sel[:, :, None], s_nodes, nodes)
        length = torch.where(sel, s_length, length)
        light = torch.where(sel, walk.kind, light)
        chains = torch.where(serial_rows, torch.ones_like(chains), chains)
    count = chains.max().int().reshape(1)
    return HybridSchedule(nodes, length, light, count, serial_rows)


class Plan:
    """Lazily built topology facts for one parent array, shared by every layer of a round.

    The plan is stored on the parents tensor and takes it as an argument (holding it would
    make a reference cycle that delays freeing device memory).
    """

    def __init__(self, version: int, captured: bool):
        self.version = version
        self.captured = captured
        self._chain: bool | None = None
        self._closure: dict[int, torch.Tensor] = {}
        self._paths: dict = {}
        self._hld: dict[bool, HybridSchedule] = {}
        self._walk: SerialWalk | None = None
        self._prefer_serial: bool | None = None
        self._host: torch.Tensor | None = None

    def is_chain(self, parents: torch.Tensor) -> bool | None:
        """True/False, or None when unknowable without a host sync (inside a graph capture).

        On CUDA outside capture this costs one host sync, once per parent array.
        """
        if self._chain is None:
            n = parents.shape[1]
            if n == 1:
                self._chain = True
            elif self.captured:
                return None
            else:
                host = self._host_copy(parents)
                self._chain = bool((host[:, 1:] == torch.arange(n - 1)).all())
        return self._chain

    def _host_copy(self, parents: torch.Tensor) -> torch.Tensor:
        """The parents on the host: one sync for CUDA, shared by `is_chain` and `prefer_serial`."""
        if self._host is None:
            self._host = parents.cpu()
        return self._host

    def closure(self, parents: torch.Tensor, width: int) -> torch.Tensor:
        if width not in self._closure:
            self._closure[width] = ops.ancestor_closure(parents, width)
        return self._closure[width]

    def paths(self, parents: torch.Tensor, valid: torch.Tensor | None):
        """`path_tables` for these parents and `valid` (as it was when first asked)."""
        key = None if valid is None else (valid.data_ptr(), valid._version)
        if key not in self._paths:
            self._paths[key] = ops.path_tables(parents, valid)
        return self._paths[key]

    def hld(self, parents: torch.Tensor, fallback: bool = False) -> HybridSchedule:
        if fallback not in self._hld:
            self._hld[fallback] = hld_schedule(parents, fallback)
        return self._hld[fallback]

    def serial_order(self, parents: torch.Tensor) -> SerialWalk:
        if self._walk is None:
            self._walk = serial_order(parents)
        return self._walk

    def prefer_serial(self, parents: torch.Tensor) -> bool | None:
        """Whether every row is expected faster on the serial verifier; None inside a capture.
        Computed on a host copy of the parents (the one host sync `is_chain` also pays)."""
        if self._prefer_serial is None:
            if self.captured:
                return None
            self._prefer_serial = bool(prefer_serial(self._host_copy(parents)).all())
        return self._prefer_serial


def plan_for(parents: torch.Tensor) -> Plan:
    """The cached plan of this parents tensor, rebuilt when it was written in place.

    A plan built outside a CUDA-graph capture is never reused inside one (its kernels would not
    be in the graph), and vice versa. Limitation: two graphs captured back to back against the
    same, unmodified parents tensor share the first capture's plan tensors; capture each graph
    after an eager warm-up call (which rebuilds the plan) or with its own parents tensor.
    """
    captured = parents.is_cuda and capturing()
    plan = getattr(parents, "_specla_plan", None)
    if plan is None or plan.version != parents._version or plan.captured != captured:
        plan = Plan(parents._version, captured)
        parents._specla_plan = plan
    return plan
