"""Delayed commits through the stacked pending buffers (`state.PendingBank`), on CPU."""

import pytest
import torch

from specla.fused import fuse
from specla.state import GDNLayerState, commit_stacked

from conftest import random_model, tiny_config


def _verify_round(model, cache, g, n=6):
    V = model.cfg.vocab_size
    tokens = torch.randint(0, V, (2, n), generator=g)
    parents = torch.tensor([[-1, 0, 1, 0, 3, 1], [-1, 0, 0, 1, 2, 4]])
    return model.verify(tokens, parents, cache)


@pytest.mark.parametrize("P", [6, 3])  # P == nodes: gathered straight into the buffers; else copied
@pytest.mark.parametrize("compiled", [False, True])  # True: as a fused GraphTarget stores (Inductor)
def test_bank_store_equals_per_layer(P, compiled):
    model = random_model(tiny_config(1, num_hidden_layers=3), 1)
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(2, 64)
    model.forward(torch.randint(0, model.cfg.vocab_size, (2, 5), generator=g), cache)
    out = _verify_round(model, cache, g)
    path = torch.tensor([[0, 3, 4, 0, 0, 0], [0, 1, 3, 0, 0, 0]])[:, :P]
    length = torch.tensor([3, 2])
    ref = cache.clone()
    if compiled:
        cache.commit_tensors = torch.compile(commit_stacked, fullgraph=True, dynamic=False)
    cache.make_bank(out.records, 2, 6)
    cache.commit(out.records, path, length, delayed=True)
    assert cache.bank is not None and cache.bank.attached(cache)
    for st, rec in zip(ref.layers, out.records):  # reference: the per-layer gather
        st.set_pending(rec, path, length)
    for a, b in zip(cache.layers, ref.layers):
        assert isinstance(a, GDNLayerState)
        for x, y in zip(a.pending[:3], b.pending[:3]):
            assert torch.equal(x[:, :P], y[:, :P])
        assert torch.equal(a.pending[3], b.pending[3])
    # flushing both gives the same state
    cache.flush()
    ref.flush()
    for a, b in zip(cache.layers, ref.layers):
        assert torch.allclose(a.S, b.S, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True])
def test_delayed_rounds_with_bank_equal_immediate(fused):
    """Several rounds: the bank is built on the first delayed commit, grows with a longer path,
    and every verify (plain or fused, which clears the lengths with one kernel) folds it."""
    model = random_model(tiny_config(2, num_hidden_layers=3), 2)
    if fused:
        fuse(model, compile=False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 5), generator=g)
    caches = {d: model.new_cache(2, 64) for d in (True, False)}
    for c in caches.values():
        model.forward(prompt, c)
    for r, (path, length) in enumerate([([[0, 1], [0, 2]], [2, 1]), ([[0, 3, 4], [0, 1, 3]], [3, 3]),
                                        ([[0, 1, 5], [0, 2, 0]], [1, 2])]):
        state = g.get_state()
        outs = {}
        for d, c in caches.items():
            g.set_state(state)
            outs[d] = _verify_round(model, c, g)
            c.commit(outs[d].records, torch.tensor(path), torch.tensor(length), delayed=d)
        assert torch.allclose(outs[True].logits, outs[False].logits, atol=1e-9), r
        bank = caches[True].bank
        assert bank is not None and bank.nodes >= len(path[0])
        assert torch.equal(bank.length, torch.tensor(length).expand(bank.length.shape[0], -1))
    caches[True].flush()
    for a, b in zip(caches[True].layers, caches[False].layers):
        assert torch.allclose(a.S, b.S, atol=1e-10)
        assert int(a.pending[3].abs().sum()) == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_chain_store_equals_the_gather(compiled):
    """A chain round's accepted path is a prefix (0, 1, ...): `store(chain=True)` stacks the
    records into the buffers without a gather; what a flush reads (the first `length` nodes)
    and the state it leaves equal the per-layer gather's."""
    model = random_model(tiny_config(3, num_hidden_layers=3), 3)
    g = torch.Generator().manual_seed(2)
    cache = model.new_cache(2, 64)
    model.forward(torch.randint(0, model.cfg.vocab_size, (2, 5), generator=g), cache)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=g)
    out = model.verify(tokens, torch.arange(-1, 5).expand(2, -1), cache)
    path, length = torch.tensor([[0, 1, 2, 0, 0, 0], [0, 1, 2, 3, 4, 0]]), torch.tensor([3, 5])
    ref = cache.clone()
    if compiled:
        cache.commit_tensors = torch.compile(commit_stacked, fullgraph=True, dynamic=False)
    cache.make_bank(out.records, 2, 6)
    cache.commit(out.records, path, length, delayed=True, chain=True)
    for st, rec in zip(ref.layers, out.records):
        st.set_pending(rec, path, length)
    for a, b in zip(cache.layers, ref.layers):
        for x, y in zip(a.pending[:3], b.pending[:3]):
            for row, n in enumerate(length.tolist()):
                assert torch.equal(x[row, :n], y[row, :n])
        assert torch.equal(a.pending[3], b.pending[3])
    cache.flush()
    ref.flush()
    for a, b in zip(cache.layers, ref.layers):
        assert torch.equal(a.S, b.S)
