"""Reference greedy walk (`acceptance.greedy`'s topology walk), vectorised over the batch."""

from __future__ import annotations

import torch


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor,
                valid: torch.Tensor | None = None):
    """Walk each row from the root, moving to the first child (lowest index) whose token is the
    target's choice at the current node. tokens, parents, target [B, n] (target[b, j]: the
    target's token after node j); valid [B]: real nodes (padding is never accepted). Returns
    (path [B, n] accepted node ids, root first, padded with 0; length [B]; last [B] the path's
    last node). Nodes are visited once in index order (parents[j] < j), so a row moves to node j
    only when j is a child of its current node."""
    B, n = tokens.shape
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    live = torch.arange(n, device=dev)[None] < (valid[:, None] if valid is not None else n)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.zeros(B, n, dtype=torch.long, device=dev)
    length = torch.ones(B, dtype=torch.long, device=dev)
    for j in range(1, n):
        move = (parents[:, j] == cur) & (tokens[:, j] == target[rows, cur]) & live[:, j]
        path[rows, length.clamp(max=n - 1)] = torch.where(move, j, path[rows, length.clamp(max=n - 1)])
        length = length + move.long()
        cur = torch.where(move, j, cur)
    return path, length, cur
