"""`ops.greedy_walk`: the Triton walk against the reference (interpreter on CPU), and the
reference against the walk's definition on the host."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla.ops.accept import naive as accept_naive
from specla.ops.accept import triton as accept_triton

from .kernel_cases import KINDS, parents_of


def _case(kinds, n, seed, vocab, cut):
    """Two rows of random topologies whose tokens often equal the target's choice at the
    parent (so walks go deep), with duplicate siblings (the first must win), and `valid`."""
    g = torch.Generator().manual_seed(seed)
    par = torch.tensor([parents_of(kinds[0], n, seed), parents_of(kinds[1], n, seed + 1)])
    target = torch.randint(0, vocab, (2, n), generator=g)
    hit = torch.rand(2, n, generator=g) < 0.7
    tokens = torch.where(hit, target.gather(1, par.clamp(min=0)), torch.randint(0, vocab, (2, n), generator=g))
    valid = torch.tensor([max(1, min(c, n)) for c in cut])
    return tokens, par, target, valid


def _host_walk(tokens, par, target, real):
    cur, path = 0, [0]
    for j in range(1, real):
        if par[j] == cur and tokens[j] == target[cur]:
            cur = j
            path.append(j)
    return path


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), kinds=st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)),
       seed=st.integers(0, 2**16), vocab=st.sampled_from([2, 3, 50]), cut=st.tuples(st.integers(1, 40), st.integers(1, 40)),
       padded=st.booleans())
def test_greedy_walk_kernel_matches_reference(n, kinds, seed, vocab, cut, padded):
    tokens, par, target, valid = _case(kinds, n, seed, vocab, cut)
    valid = valid if padded else None
    want = accept_naive.greedy_walk(tokens, par, target, valid)
    got = accept_triton.greedy_walk(tokens, par, target, valid)
    for w, o in zip(want, got):
        assert torch.equal(w, o)
    path, length, last = want
    for b in range(2):
        host = _host_walk(tokens[b].tolist(), par[b].tolist(), target[b].tolist(), n if valid is None else int(valid[b]))
        assert int(length[b]) == len(host) and path[b, :len(host)].tolist() == host and int(last[b]) == host[-1]
        assert not path[b, len(host):].any()
