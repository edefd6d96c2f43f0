"""Draft topologies: parent arrays in topological order (DESIGN §2).

Node 0 is the root (the last emitted token, not yet consumed by the target); nodes 1..n-1 are
draft tokens. `parents[0] = -1` and `0 <= parents[j] < j`. Tensors carry a leading batch
dimension, [B, n]; every row is its own topology.
"""

from __future__ import annotations

import torch

from specla.errors import TopologyError


def as_parents(parents, batch: int | None = None, device=None) -> torch.Tensor:
    """Validate a parent array (list, [n] or [B, n]) and return it as a [B, n] int64 tensor."""
    p = torch.as_tensor(parents, dtype=torch.long, device=device)
    if p.dim() == 1:
        p = p.unsqueeze(0)
    if p.dim() != 2 or p.shape[1] == 0:
        raise TopologyError(f"a parent array must have shape [n] or [B, n] with n >= 1, got {tuple(p.shape)}")
    if batch is not None and p.shape[0] != batch:
        if p.shape[0] != 1:
            raise TopologyError(f"parent array has batch {p.shape[0]}, expected {batch}")
        p = p.expand(batch, -1)
    check = p.detach().cpu()
    if bool((check[:, 0] != -1).any()):
        raise TopologyError("parents[0] must be -1 (node 0 is the root)")
    idx = torch.arange(check.shape[1])
    bad = (check[:, 1:] < 0) | (check[:, 1:] >= idx[1:])
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise TopologyError(
            f"parent array is not topological: parents[{j + 1}] = {int(check[b, j + 1])} "
            f"(each node's parent must come before it)"
        )
    return p


def chain(n: int, batch: int = 1, device=None) -> torch.Tensor:
    """Parents of a chain root -> 1 -> ... -> n-1."""
    return torch.arange(-1, n - 1, device=device).expand(batch, n).contiguous()


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root 0), [B, n]."""
    B, n = parents.shape
    d = torch.zeros(B, n, dtype=torch.long, device=parents.device)
    for j in range(1, n):
        d[:, j] = d.gather(1, parents[:, j : j + 1]).squeeze(1) + 1
    return d


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """M̄[b, j, i] = True iff i is j or an ancestor of j. [B, n, n] bool."""
    B, n = parents.shape
    m = torch.zeros(B, n, n, dtype=torch.bool, device=parents.device)
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    m[:, 0] = eye[0]
    rows = torch.arange(B, device=parents.device)
    for j in range(1, n):
        m[:, j] = m[rows, parents[:, j]] | eye[j]
    return m


def ancestor_table(parents: torch.Tensor, width: int) -> torch.Tensor:
    """anc[b, j, t] = the t-th ancestor of j (t = 0 is j itself).

    Past the root the walk continues into the committed history as -1, -2, ...
    (-1 = the last consumed token), which is how short-conv windows index the conv state.
    """
    B, n = parents.shape
    anc = torch.empty(B, n, width, dtype=torch.long, device=parents.device)
    anc[:, :, 0] = torch.arange(n, device=parents.device)
    for t in range(1, width):
        prev = anc[:, :, t - 1]
        up = parents.gather(1, prev.clamp(min=0))
        anc[:, :, t] = torch.where(prev >= 0, up, prev - 1)
    return anc


def children(parents: torch.Tensor) -> list[list[int]]:
    """Children of each node of a single topology ([n] or [1, n]), in index order."""
    p = parents.reshape(-1).tolist()
    kids: list[list[int]] = [[] for _ in p]
    for j, q in enumerate(p[1:], start=1):
        kids[q].append(j)
    return kids


def root_to_leaf_paths(parents: torch.Tensor) -> list[list[int]]:
    """Every root-to-leaf path of a single topology, each a list of node ids from the root."""
    p = parents.reshape(-1).tolist()
    kids = children(parents)
    paths = []
    for leaf, ks in enumerate(kids):
        if ks:
            continue
        path = [leaf]
        while p[path[-1]] >= 0:
            path.append(p[path[-1]])
        paths.append(path[::-1])
    return paths


def heavy_light_chains(parents: torch.Tensor) -> list[list[int]]:
    """The hybrid verifier's decomposition of a single topology (SpecLA §4.3) into
    node-disjoint chains, each listed in visiting order.

    Leaves (nodes other than the root with no children) are verified in place by their
    parent's chain, right after their parent, lower index first. The inner nodes are split by
    heavy-light decomposition: a chain follows the inner child with the largest subtree (ties:
    the lower index); the other inner children start chains of their own, whose first node
    hangs off a node of an earlier chain (its boundary). Chains are returned in an order where
    every chain's boundary node lies in an earlier chain.
    """
    p = parents.reshape(-1).tolist()
    n = len(p)
    kids = children(parents)
    size = [1] * n
    for j in range(n - 1, 0, -1):
        size[p[j]] += size[j]
    chains: list[list[int]] = []
    starts = [0]
    while starts:
        node = starts.pop(0)
        ch = []
        while node is not None:
            ch.append(node)
            ch.extend(c for c in kids[node] if not kids[c])
            inner = [c for c in kids[node] if kids[c]]
            heavy = max(inner, key=lambda c: (size[c], -c)) if inner else None
            starts.extend(c for c in inner if c != heavy)
            node = heavy
        chains.append(ch)
    return chains
