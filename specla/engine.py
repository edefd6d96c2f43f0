"""Target-side execution for the decode loop: eager, or replayed from CUDA graphs.

The decode loop needs four target operations — prefill, the AR step, verify + greedy
acceptance, and commit. `EagerTarget` runs them as plain PyTorch on any device.
`GraphTarget` (CUDA) captures the last three once, over static buffers: the cache is
allocated once and updated in place, topologies are padded to a fixed node budget, so every
round replays the same graphs; the only host synchronisation in a round is reading what
was accepted (one small copy), which the loop needs to emit tokens anyway.
"""

from __future__ import annotations

import torch

from specla import acceptance
from specla.model import Model, ModelOutput
from specla.state import Cache, GDNLayerState


class EagerTarget:
    def __init__(self, model: Model, batch: int, max_len: int):
        self.model = model
        self.cache: Cache = model.new_cache(batch, max_len=max_len)

    def prefill(self, tokens: torch.Tensor, capture=()) -> ModelOutput:
        return self.model.forward(tokens, self.cache, capture)

    def step(self, root: torch.Tensor) -> torch.Tensor:
        """Consume the root [B]; the next-token logits [B, V]."""
        return self.model.forward(root[:, None], self.cache).logits[:, -1]

    def verify(self, tokens, parents, capture=(), greedy=True):
        """Score a topology; with `greedy`, also accept: (ModelOutput, Acceptance | None)."""
        out = self.model.verify(tokens, parents, self.cache, capture)
        acc = acceptance.greedy(tokens, parents, out.logits) if greedy else None
        return out, acc

    def commit(self, records, path, length, delayed: bool) -> None:
        self.cache.commit(records, path, length, delayed)


class GraphTarget(EagerTarget):
    """CUDA graphs over a static cache; topologies padded to `budget` nodes (root included)."""

    def __init__(self, model: Model, batch: int, max_len: int, budget: int, delayed: bool):
        super().__init__(model, batch, max_len)
        dev = model.device
        self.budget, self.delayed = budget, delayed
        self.root = torch.zeros(batch, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(batch, budget, dtype=torch.long, device=dev)
        self.parents = torch.arange(-1, budget - 1, device=dev).expand(batch, -1).contiguous()
        self.path = torch.zeros(batch, budget, dtype=torch.long, device=dev)
        self.length = torch.zeros(batch, dtype=torch.long, device=dev)
        self.graphs: dict = {}
        self.records = None
        if delayed:  # pending buffers exist from the start so the verify graph reads them
            self._make_pending()

    def _make_pending(self) -> None:
        for st in self.cache.layers:
            if isinstance(st, GDNLayerState):
                B, N = self.tokens.shape
                H, K = self.model.cfg.num_heads, self.model.cfg.head_dim
                HV, V = st.S.shape[1], st.S.shape[3]
                z = lambda *s: torch.zeros(*s, device=st.S.device, dtype=st.S.dtype)  # noqa: E731
                st.pending = (z(B, N, H, K), z(B, N, HV), z(B, N, HV, V),
                              torch.zeros(B, dtype=torch.long, device=st.S.device))

    def _snapshot(self):
        keep = []
        for st in self.cache.layers:
            if isinstance(st, GDNLayerState):
                keep.append([t for t in (st.S, st.conv) if t is not None]
                            + (list(st.pending) if st.pending is not None else []))
            else:
                keep.append([st.k, st.v])
        keep.append([self.cache.length])
        return [[t, t.clone()] for ts in keep for t in ts]

    def _capture(self, key, fn):
        """Warm up and capture `fn` without changing the cache: its state is restored after."""
        saved = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for t, copy in saved:
            t.copy_(copy)
        self.graphs[key] = (graph, out)
        return self.graphs[key]

    def step(self, root):
        self.root.copy_(root)
        graph, out = self.graphs.get("step") or self._capture(
            "step", lambda: self.model.forward(self.root[:, None], self.cache).logits[:, -1])
        graph.replay()
        return out

    def verify(self, tokens, parents, capture=(), greedy=True):
        if not greedy:  # sampling draws random numbers: run eagerly on the same buffers
            return super().verify(tokens, parents, capture, greedy)
        n = tokens.shape[1]
        if n > self.budget:
            raise ValueError(f"draft of {n} nodes exceeds the graph budget of {self.budget}")
        # pad by repeating the last node: a later twin is never accepted ahead of it
        self.tokens[:, :n].copy_(tokens)
        self.tokens[:, n:].copy_(tokens[:, -1:].expand(-1, self.budget - n))
        self.parents[:, :n].copy_(parents)
        self.parents[:, n:].copy_(parents[:, -1:].expand(-1, self.budget - n))
        key = ("verify", tuple(capture))

        def run():
            out = self.model.verify(self.tokens, self.parents, self.cache, capture)
            return out, acceptance.greedy(self.tokens, self.parents, out.logits)

        graph, (out, acc) = self.graphs.get(key) or self._capture(key, run)
        graph.replay()
        self.records = out.records
        return out, acc

    def commit(self, records, path, length, delayed):
        if records is not self.records or delayed != self.delayed:
            return super().commit(records, path, length, delayed)
        self.path.copy_(path)
        self.length.copy_(length)
        graph, _ = self.graphs.get("commit") or self._capture(
            "commit", lambda: self.cache.commit(self.records, self.path, self.length, self.delayed))
        graph.replay()
