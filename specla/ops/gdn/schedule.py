"""Device-side topology plans for the Triton verifiers (SpecLA §4.2-4.3).

Everything here is built with batched torch ops on the parent array's own device, with no
host sync, so the same code runs inside a CUDA-graph capture and the schedule replays as data.

- `ancestor_closure`: M̄[b, j, i] = 1 iff i is j or an ancestor of j (the tree mask of the UT form).
- `hld_schedule`: heavy-light decomposition into node-disjoint chains (the hybrid verifier's
  schedule), equal to `specla.topology.heavy_light_chains` row by row.
- `replay_schedule`: the same chains, each extended up to the root, so a chain's program
  recomputes its boundary state from the durable state instead of waiting for it (`skip`:
  the leading ancestors it replays without writing).
- `plan_for`: a per-parents-tensor cache of the above, so the 24 layers of one verify round
  build the plan once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass
class HybridSchedule:
    """The chains of every row, as fixed-size int32 tables (padded to n chains of n nodes).

    Chains are ranked by their first node's index, which is topological: a chain's boundary
    node (its first node's parent) always lies in a chain of lower rank.
    """

    nodes: torch.Tensor  # [B, n, n]: nodes[b, c, p] = p-th node of chain c (valid for p < length)
    length: torch.Tensor  # [B, n]: nodes in chain c; 0 for unused slots
    light: torch.Tensor  # [B, n]: 1 iff node has a child that starts another chain (a boundary)
    count: torch.Tensor  # [1]: the most chains of any row (the launch's grid is padded past it)
    skip: torch.Tensor | None = None  # [B, n] (replay): leading nodes of chain c replayed, not written


def _heads(parents: torch.Tensor, M: torch.Tensor):
    """(is_head [B, n], subtree sizes): heavy-light chain heads (ties: the lower index is heavy)."""
    B, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    size = M.sum(1).long()  # subtree sizes
    par = parents[:, 1:].clamp(min=0)
    score = size * (n + 1) + (n - idx)  # larger subtree first, then lower index
    best = torch.zeros(B, n, dtype=torch.long, device=parents.device).scatter_reduce(1, par, score[:, 1:], "amax")
    heavy = torch.zeros(B, n, dtype=torch.bool, device=parents.device)
    heavy[:, 1:] = score[:, 1:] == best.gather(1, par)
    return ~heavy, size


def hld_schedule(parents: torch.Tensor) -> HybridSchedule:
    """Heavy-light decomposition of every row (ties: the lower node index is heavy)."""
    parents = parents.long()
    B, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)
    M = ancestor_closure(parents)
    is_head, _ = _heads(parents, M)
    depth = M.sum(2).long() - 1
    par = parents[:, 1:].clamp(min=0)
    # a node's chain starts at its deepest ancestor-or-self that is a chain head
    head = torch.where((M > 0) & is_head[:, None, :], idx, -1).amax(-1)
    pos = depth - depth.gather(1, head)
    rank = is_head.long().cumsum(1) - 1
    chain = rank.gather(1, head)
    nodes = torch.zeros(B, n * n, dtype=torch.int32, device=dev)
    nodes.scatter_(1, chain * n + pos, idx.int().expand(B, n).contiguous())
    length = torch.zeros(B, n, dtype=torch.int32, device=dev)
    length.scatter_add_(1, chain, torch.ones(B, n, dtype=torch.int32, device=dev))
    light = torch.zeros(B, n, dtype=torch.int32, device=dev)
    light.scatter_add_(1, par, is_head[:, 1:].int())
    light.clamp_(max=1)
    chains = is_head.sum(1)
    nodes = nodes.view(B, n, n)
    count = chains.max().int().reshape(1)
    return HybridSchedule(nodes, length, light, count)


def replay_schedule(parents: torch.Tensor) -> HybridSchedule:
    """Heavy-light chains extended to the root: nodes[b, c] is the path root..(last node of
    chain c), skip[b, c] the depth of the chain's head (its ancestors, replayed silently), so
    every node is still written by exactly one chain. Every chain starts from the durable
    state: no boundary tile is stored or awaited, and `light` is all zero."""
    parents = parents.long()
    hld = hld_schedule(parents)
    B, n = parents.shape
    dev = parents.device
    M = ancestor_closure(parents)
    used = hld.length > 0
    last = hld.nodes.long().gather(2, (hld.length.long() - 1).clamp(min=0)[:, :, None])[..., 0]  # [B, n]
    on_path = M.gather(1, last[:, :, None].expand(B, n, n)) > 0  # [B, chain, node]: node on root..last
    on_path &= used[:, :, None]
    # ancestors carry smaller indices than their descendants, so index order is path order:
    # sorting by (off path, index) lists the path first (slots past `length` are never read)
    idx = torch.arange(n, device=dev)
    nodes = torch.where(on_path, idx, n + idx).argsort(dim=2).int()
    length = on_path.sum(2).int()
    depth = M.sum(2).long() - 1
    skip = torch.where(used, depth.gather(1, hld.nodes[:, :, 0].long()), 0).int()
    return HybridSchedule(nodes, length, torch.zeros_like(hld.light), hld.count, skip=skip)


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
        self._hld: HybridSchedule | None = None
        self._replay: HybridSchedule | None = None

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
                self._chain = bool((parents.cpu()[:, 1:] == torch.arange(n - 1)).all())
        return self._chain

    def closure(self, parents: torch.Tensor, width: int) -> torch.Tensor:
        if width not in self._closure:
            self._closure[width] = ancestor_closure(parents, width)
        return self._closure[width]

    def hld(self, parents: torch.Tensor) -> HybridSchedule:
        if self._hld is None:
            self._hld = hld_schedule(parents)
        return self._hld

    def replay(self, parents: torch.Tensor) -> HybridSchedule:
        if self._replay is None:
            self._replay = replay_schedule(parents)
        return self._replay


def plan_for(parents: torch.Tensor) -> Plan:
    """The cached plan of this parents tensor, rebuilt when it was written in place.

    A plan built outside a CUDA-graph capture is never reused inside one (its kernels would not
    be in the graph), and vice versa. Limitation: two graphs captured back to back against the
    same, unmodified parents tensor share the first capture's plan tensors; capture each graph
    after an eager warm-up call (which rebuilds the plan) or with its own parents tensor.
    """
    captured = parents.is_cuda and torch.cuda.is_current_stream_capturing()
    plan = getattr(parents, "_specla_plan", None)
    if plan is None or plan.version != parents._version or plan.captured != captured:
        plan = Plan(parents._version, captured)
        parents._specla_plan = plan
    return plan
