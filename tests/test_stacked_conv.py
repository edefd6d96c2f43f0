"""The GDN layers' conv states stacked in one buffer (`Cache.conv`) and advanced together
(`state.commit_convs`), on CPU."""

import pytest
import torch

from specla.ops.conv import naive as conv_ref
from specla.state import commit_convs

from conftest import random_model, tiny_config


def test_cache_stacks_the_conv_states():
    model = random_model(tiny_config(1, num_hidden_layers=3, use_short_conv=True), 1)
    cache = model.new_cache(2, 64)
    assert cache.conv is not None and cache.conv.shape[0] == 3
    for j, i in enumerate(cache.conv_layers):  # each layer's state is a view of the stack
        assert cache.layers[i].conv.data_ptr() == cache.conv[j].data_ptr()
    clone = cache.clone()
    assert clone.conv is not None and clone.conv.data_ptr() != cache.conv.data_ptr()


@pytest.mark.parametrize("compiled", [False, True])  # True: as a fused GraphTarget commits (Inductor)
@pytest.mark.parametrize("W", [2, 4])
def test_commit_convs_equals_per_layer(compiled, W):
    g = torch.Generator().manual_seed(W)
    L, B, n, C, P = 3, 3, 7, 5, 4
    conv = torch.randn(L, B, C, W - 1, generator=g)
    xs = [torch.randn(B, n, C, generator=g) for _ in range(L)]
    path = torch.stack([torch.randperm(n, generator=g)[:P] for _ in range(B)])
    length = torch.tensor([0, 2, P])  # nothing accepted, part of the path, all of it
    ref = conv.clone()
    for i in range(L):
        conv_ref.conv_commit(ref[i], xs[i], path, length)
    fn = torch.compile(commit_convs, fullgraph=True, dynamic=False) if compiled else commit_convs
    fn(conv, xs, path, length)
    assert torch.equal(conv, ref)
    assert torch.equal(conv[:, 0], ref[:, 0])  # the row that accepted nothing kept its state


def test_rounds_through_the_stacked_commit_equal_per_layer_commits():
    """A model's verify + commit rounds: the stacked commit leaves the conv states the
    per-layer kernel leaves."""
    model = random_model(tiny_config(1, num_hidden_layers=2, use_short_conv=True), 1)
    g = torch.Generator().manual_seed(3)
    cache = model.new_cache(2, 64)
    model.forward(torch.randint(0, model.cfg.vocab_size, (2, 5), generator=g), cache)
    ref = cache.clone()  # the per-layer kernels (no stack_convs)
    cache.stack_convs = True
    parents = torch.tensor([[-1, 0, 1, 0, 3, 1], [-1, 0, 0, 1, 2, 4]])
    for path, length in ((torch.tensor([[0, 3, 4], [0, 1, 3]]), torch.tensor([3, 2])),
                         (torch.tensor([[0, 1, 2], [0, 2, 4]]), torch.tensor([1, 3]))):
        tokens = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=g)
        for c in (cache, ref):
            out = model.verify(tokens, parents, c)
            c.commit(out.records, path, length)
    for i in cache.conv_layers:
        assert torch.equal(cache.layers[i].conv, ref.layers[i].conv)
        assert torch.equal(cache.layers[i].S, ref.layers[i].S)
