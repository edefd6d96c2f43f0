"""CUDA graphs emulated on CPU, for tests of the graph path (`specla.graphs.capture` replaced).

A capture warms the function up twice and runs it once more "under capture"; a replay re-runs
it under capture and copies the results into the outputs the capture returned, which is what
a replay does to a graph's static outputs. The function keeps its closure, so a replay reads
exactly the objects the capture saw, as a real graph does. A drafter in the closure must
also still hold the cache tensors it held at capture: a real graph would use the old ones.
`captured()` says whether code runs under (emulated) capture.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from specla.drafters.base import Drafter

_CAPTURED = [False]


def captured() -> bool:
    return _CAPTURED[0]


@contextlib.contextmanager
def _as_captured():
    _CAPTURED[0] = True
    try:
        yield
    finally:
        _CAPTURED[0] = False


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        assert dst.shape == src.shape and dst.dtype == src.dtype, "a replay must keep every output's shape"
        dst.copy_(src)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))
    elif isinstance(dst, (list, tuple)):
        assert len(dst) == len(src)
        for a, b in zip(dst, src):
            _copy_into(a, b)
    elif isinstance(dst, dict):
        assert dst.keys() == src.keys()
        for k in dst:
            _copy_into(dst[k], src[k])
    else:
        assert dst == src or dst is None


class EmulatedGraph:
    def __init__(self, fn, guard=None):
        self.fn = fn
        owner = next((c.cell_contents for c in fn.__closure__ or () if isinstance(c.cell_contents, Drafter)), None)
        self.owner = owner
        self.bound = {n: getattr(owner, n) for n in ("k", "v", "len", "pending") if hasattr(owner, n)}
        for _ in range(2):  # the warm-up, eager as on the GPU
            fn()
        with guard or contextlib.nullcontext(), _as_captured():
            self.out = fn()

    def replay(self):
        for n, t in self.bound.items():
            assert getattr(self.owner, n) is t, f"a replay would use a stale {n!r}"
        with _as_captured():
            _copy_into(self.out, self.fn())


def emulate_graphs(monkeypatch) -> None:
    """`specla.graphs.capture` (the target's and the drafters' graphs) emulated for this test."""
    from specla import graphs

    monkeypatch.setattr(graphs, "capture", EmulatedGraph)
