"""Synthetic draft topologies shaped like beam top-k proposals (DESIGN §9, SpecLA §6.1, §8.3)."""

from __future__ import annotations

import heapq
import math

import torch


def beam_tree(topk: int, depth: int, nodes: int, seed: int = 0, vocab: int = 64,
              sharpness: float = 4.0) -> list[int]:
    """Parent array (root first, n = nodes + 1) of an EAGLE-style beam top-k draft tree.

    Per depth, each of the `topk` best beams proposes its top-k next tokens under a random
    next-token distribution (softmax of N(0, sharpness²) logits over `vocab` tokens); the
    `topk` best of those by cumulative log-probability become the next beams. All proposals up
    to `depth` are then ranked by cumulative log-probability and the best `nodes` kept: scores
    never increase along a path, so the kept set is ancestor-closed. Nodes are numbered depth
    by depth (best score first), a topological order.
    """
    gen = torch.Generator().manual_seed(seed)
    cand = []  # (score, depth, id, parent id); the root has id 0
    beams = [(0.0, 0)]
    next_id = 1
    for d in range(1, depth + 1):
        props = []
        for score, nid in beams:
            logp = torch.log_softmax(torch.randn(vocab, generator=gen) * sharpness, 0)
            top = torch.topk(logp, topk).values.tolist()
            for lp in top:
                props.append((score + lp, next_id, nid))
                next_id += 1
        cand += [(s, d, i, p) for s, i, p in props]
        beams = [(s, i) for s, i, _ in heapq.nlargest(topk, props)]
    # ties (a child of probability 1.0 scores like its parent): the shallower node first
    if len(cand) < nodes:
        raise ValueError(f"top-{topk} beams of depth {depth} propose only {len(cand)} nodes, not {nodes}")
    kept = heapq.nlargest(nodes, cand, key=lambda c: (c[0], -c[1], -c[2]))
    kept.sort(key=lambda c: (c[1], -c[0], c[2]))
    index = {0: 0}
    parents = [-1]
    for j, (_, _, nid, pid) in enumerate(kept, start=1):
        index[nid] = j
        parents.append(index[pid])
    return parents


def tree_stats(parents: list[int]) -> dict:
    """Leaves, depth and width of a parent array (for benchmark tables)."""
    n = len(parents)
    depth = [0] * n
    has_child = [False] * n
    for j in range(1, n):
        depth[j] = depth[parents[j]] + 1
        has_child[parents[j]] = True
    return {"n": n, "leaves": n - sum(has_child), "depth": max(depth),
            "log2_n": math.log2(n)}
