"""CUDA-graph capture, shared by the target (`engine.GraphTarget`) and the drafters."""

from __future__ import annotations

import contextlib

import torch

_captured = 0


def captured() -> int:
    """Graphs captured so far in this process: the benches read it around each timed
    generation, so a capture that lands inside a timing (its warm-up and capture, tens of ms)
    is recorded rather than only seen as a slow figure."""
    return _captured


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (no host reads then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture(fn, guard=None) -> torch.cuda.CUDAGraph:
    """fn warmed up twice on a side stream (lazy caches, cuBLAS workspaces, kernel compilation
    happen there), then captured on the current device; `graph.out` is what the capture
    returned, refreshed in place by every replay. guard: a context held around the capture."""
    global _captured
    _captured += 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with guard or contextlib.nullcontext(), torch.cuda.graph(graph):
        graph.out = fn()
    return graph
