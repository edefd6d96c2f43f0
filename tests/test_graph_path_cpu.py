"""The CUDA-graph decode path, emulated on CPU: `GraphTarget`'s static buffers, padded
topologies, `valid` counts, one target shared by drafters that capture different layers, and
the Triton kernels' in-capture dispatch (plans built as inside a capture: no host reads of the
topology, hybrid schedules computed on the device), all under TRITON_INTERPRET=1 in fp32.

A "graph" here records the function at capture and re-runs it at replay, copying the results
into the tensors the capture returned; that is what a replay does to its static outputs.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch

import specla.decode as decode_mod
from specla import ops
from specla.decode import Decoder
from specla.drafters.ngram import NgramDrafter
from specla.engine import GraphTarget
from specla.ops.gdn import schedule

from conftest import random_model, tiny_config
from drafters import OracleTreeDrafter


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


class _Replay:
    """A real graph reads the tensors its capture saw: `bound` are (name, object) pairs of the
    target's mutable references at capture, which must be the same objects at every replay."""

    def __init__(self, fn, out, target, bound):
        self.fn, self.out, self.target, self.bound = fn, out, target, bound

    def replay(self):
        for name, obj in self.bound:
            assert getattr(self.target, name) is obj, f"a replay would read stale {name!r}"
        with _as_captured():
            _copy_into(self.out, self.fn())


_CAPTURED = [False]


@contextmanager
def _as_captured():
    _CAPTURED[0] = True
    try:
        yield
    finally:
        _CAPTURED[0] = False


class EmulatedGraphTarget(GraphTarget):
    def _capture(self, key, fn):
        saved = self._snapshot()
        for _ in range(2):  # the warm-up, eager as on the GPU
            fn()
        with _as_captured():
            out = fn()
        for t, backup in saved:
            t.copy_(backup)
        bound = [("records", self.records)] if key[0] == "commit" else []
        self.graphs[key] = (_Replay(fn, out, self, bound), out)
        return self.graphs[key]


@pytest.fixture
def graph_path(monkeypatch):
    real_plan_for = schedule.plan_for

    def plan_for(parents):
        if not _CAPTURED[0]:
            return real_plan_for(parents)
        plan = getattr(parents, "_specla_plan", None)
        if plan is None or plan.version != parents._version or not plan.captured:
            plan = schedule.Plan(parents._version, True)
            parents._specla_plan = plan
        return plan

    monkeypatch.setattr(schedule, "plan_for", plan_for)
    monkeypatch.setattr(decode_mod, "GraphTarget", EmulatedGraphTarget)
    with ops.backend("triton"):
        yield


class FeatureReadingOracle(OracleTreeDrafter):
    """Reads a target layer's features, so its verify graph differs from the n-gram drafter's
    on the same shared target (as the EAGLE drafter's does)."""

    capture = (0,)


def _prompt(vocab, seed, length=10):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (length,), generator=g).tolist()
    return base + base[: length // 2]


def test_graph_path_equals_ar(graph_path):
    seed = 0  # GVA, short conv, gate: the interpreter makes every seed cost about a minute
    cfg = tiny_config(seed, num_hidden_layers=2)
    model = random_model(cfg, seed, dtype=torch.float32)
    prompt = _prompt(cfg.vocab_size, seed)
    new = 16
    ar = Decoder(model, graphs=False).run(torch.tensor([prompt]), new)[0]
    oracle = [prompt + ar[0]]
    targets: dict = {}  # shared, as `specla.api` shares them: routes of one budget share a target
    for delayed in (True,):
        for make in (lambda: NgramDrafter(length=4, topk=3, budget=9),
                     lambda: FeatureReadingOracle(oracle, cfg.vocab_size, max_nodes=10, seed=seed),
                     lambda: NgramDrafter(length=9, topk=1)):
            rows, res, _ = Decoder(model, make(), "tree", graphs=True, delayed=delayed,
                                   targets=targets).run(torch.tensor([prompt]), new)
            assert rows == ar, (make().name, delayed)
    assert any(isinstance(t, EmulatedGraphTarget) for t in targets.values())
