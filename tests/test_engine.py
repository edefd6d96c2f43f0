"""GraphTarget's static-buffer logic (padding, snapshots, pending buffers) on CPU.

CUDA graphs need a GPU; here each 'replay' reruns the captured function into the same output
objects, which is what a graph replay does to its static outputs (`graph_emulation`).
Everything else — the static inputs, the padded topology, the in-place state — is the real
code path.
"""

import pytest
import torch

import specla.engine as engine
from specla.decode import Decoder
from specla.drafters.ngram import NgramDrafter

from conftest import random_model, tiny_config
from drafters import OracleTreeDrafter
from graph_emulation import emulate_graphs


@pytest.fixture
def emulated_graphs(monkeypatch):
    emulate_graphs(monkeypatch)


@pytest.mark.parametrize("delayed", [True, False])
def test_graph_target_matches_eager(emulated_graphs, delayed):
    cfg = tiny_config(2)
    model = random_model(cfg, 2)
    prompt = [5, 1, 7, 3, 5, 1, 7, 3, 9, 2, 5, 1]
    ar, _, ar_cache = Decoder(model, graphs=False).run(torch.tensor([prompt]), 40)
    assert Decoder(model, graphs=True).run(torch.tensor([prompt]), 40)[0] == ar
    oracle = [prompt + ar[0]]
    for drafter in (NgramDrafter(length=4, topk=3, budget=10), OracleTreeDrafter(oracle, cfg.vocab_size)):
        rows, res, cache = Decoder(model, drafter, graphs=True, delayed=delayed).run(torch.tensor([prompt]), 40)
        assert rows == ar
        for a, b in zip(cache.layers, ar_cache.layers):
            assert (a.S - b.S).abs().max() < 1e-10
    # rounds with a lone root (padded to the budget, nothing acceptable) happened
    assert any(r.drafted == 0 for r in res.rounds) and any(r.accepted > 0 for r in res.rounds)


@pytest.mark.parametrize("graphs", [False, True])
def test_reused_target_starts_clean(emulated_graphs, graphs):
    """A target reused across generations (cache reset in place) gives a fresh run's tokens."""
    cfg = tiny_config(6)
    model = random_model(cfg, 6)
    a, b = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]
    fresh = Decoder(model, NgramDrafter(length=4, topk=2, budget=8), graphs=graphs).generate(b, 30).tokens
    shared: dict = {}
    drafter = NgramDrafter(length=4, topk=2, budget=8)
    Decoder(model, drafter, graphs=graphs, targets=shared).generate(a, 30)
    assert Decoder(model, drafter, graphs=graphs, targets=shared).generate(b, 30).tokens == fresh
    assert len(shared) == 1


def test_flush_runs_only_when_something_may_be_pending(emulated_graphs, monkeypatch):
    """A reset cache is clean: the prefill's flush launches nothing. A delayed round (here a
    replayed graph) makes it unclean, and the next flush applies the pending update."""
    from specla.model import GDNLayerState

    calls = []
    real = GDNLayerState.flush
    monkeypatch.setattr(GDNLayerState, "flush", lambda self: calls.append(1) or real(self))
    model = random_model(tiny_config(2), 2)
    prompt = torch.tensor([[5, 1, 7, 3, 5, 1, 7, 3, 9, 2, 5, 1]])
    target = engine.GraphTarget(model, 1, 64, 10, delayed=True)
    target.reset()
    target.prefill(prompt[:, :-1])
    assert target.cache.clean and calls == []
    target.begin(prompt[:, -1], 8, set())
    tokens = torch.tensor([[1, 7, 3, 9]])
    target.round(tokens, torch.tensor([[-1, 0, 1, 2]]))
    assert not target.cache.clean
    target.flush()
    assert target.cache.clean and len(calls) == len(model.layers)
    ar = model.new_cache(1, 64)
    model(prompt[:, :-1], ar)
    n = int(target.cache.length[0]) - prompt.shape[1] + 1  # the round's accepted tokens
    model(torch.cat([prompt[:, -1:], tokens[:, 1:n]], 1), ar)
    for a, b in zip(target.cache.layers, ar.layers):
        assert (a.S - b.S).abs().max() < 1e-10


@pytest.mark.parametrize("exact", [False, True])
def test_exact_target_verifies_under_exact_arithmetic(emulated_graphs, monkeypatch, exact):
    """Every GDN verify of an exact-mode target (eager and graph) runs inside
    `ops.exact_arithmetic`, which keeps trees off the parallel verifier; other targets' don't."""
    from specla import ops

    seen, real = [], ops.gdn_tree_verify
    monkeypatch.setattr(ops, "gdn_tree_verify", lambda *a, **kw: seen.append(ops._exact) or real(*a, **kw))
    model = random_model(tiny_config(2), 2)
    tokens, parents = torch.tensor([[3, 5, 6, 7]]), torch.tensor([[-1, 0, 0, 1]])
    for tgt in (engine.EagerTarget(model, 1, 64, width=6 if exact else None),
                engine.GraphTarget(model, 1, 64, 6, delayed=True, exact=exact)):
        tgt.prefill(torch.tensor([[1, 2, 3]]))
        tgt.verify(tokens, parents)
    assert seen and all(x == exact for x in seen)
    assert ops._exact is False
