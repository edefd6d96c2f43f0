"""`ops.build_tree`: the Triton selection and packing against the reference (interpreter on
CPU), on pools of real rollouts (`drafters.tree.beam_search`) with tied scores and windows."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla.drafters import tree
from specla.ops.tree import naive as tree_naive
from specla.ops.tree import triton as tree_triton


def _pool(B, topk, depth, width, vocab, seed):
    """A batch of full rollouts whose log-probabilities are coarse (many ties)."""
    g = torch.Generator().manual_seed(seed)

    def step(d, tokens, src, rows):
        return (torch.randn(tokens.shape[0], tokens.shape[1], vocab, generator=g) * 2).round() / 2

    return tree.beam_search(step, torch.zeros(B, dtype=torch.long), topk, depth, width=width)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), topk=st.integers(1, 4), depth=st.integers(1, 8), width=st.integers(1, 4),
       vocab=st.integers(4, 9), seed=st.integers(0, 2**16), budget=st.integers(1, 30),
       tau=st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.5, 4.0])))
def test_build_kernel_matches_reference(B, topk, depth, width, vocab, seed, budget, tau):
    width = min(width, topk)
    tok, par, score = _pool(B, topk, depth, width, vocab, seed)
    root = torch.arange(7, 7 + B)
    dep = tree.pool_depths(tok.shape[1], topk, width, tok.device)
    want = tree_naive.build_batch(root, tok, par, score, budget, tau, dep)
    got = tree_triton.build_batch(root, tok, par, score, budget, tau, dep)
    for w, o in zip(want, got):
        assert torch.equal(w, o)
