"""`ops.beam_expand`: the reference's top-k and tie rules, and the Triton kernels against the
reference (interpreter on CPU)."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla import ops
from specla.drafters import tree
from specla.ops.beam import naive as beam_naive
from specla.ops.beam import triton as beam_triton
from specla.ops.linear import naive as linear_naive


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 40), st.integers(1, 4), st.integers(0, 10**6))
def test_top_k_is_topk_with_lowest_ids_first_on_ties(B, nb, V, k, seed):
    """`top_k` = torch.topk's values, best first; among equal values (ties are frequent
    here: few distinct values) the lowest index first, also at the cut."""
    k = min(k, V)
    x = torch.randint(0, 4, (B, nb, V), generator=torch.Generator().manual_seed(seed)).float()
    vals, idx = beam_naive.top_k(x, k)
    assert torch.equal(vals, x.topk(k, dim=-1).values)
    assert torch.equal(x.gather(-1, idx), vals)
    # the lowest ids among equal values: rank by (-value, index)
    order = torch.argsort(-x * (V + 1) + torch.arange(V), dim=-1, stable=True)[..., :k]
    assert torch.equal(idx, order)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 600, 1024, 1025, 2048, 5000, 32000]), st.integers(2, 50),
       st.booleans(), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 10**6))
def test_first_max_is_torch_max(B, V, levels, neg_inf, dtype, seed):
    """`first_max` (chunked) = torch's max: the value and the first maximal index, with ties
    across chunks and rows of -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (B, 2, V), generator=g).to(dtype)
    if neg_inf:
        x[0, 0] = float("-inf")  # masked out entirely: index 0, as torch
        x[:, 1, : V // 2] = float("-inf")
    v, i = beam_naive.first_max(x)
    ref = x.max(-1)
    assert torch.equal(v, ref.values)
    first = (x == ref.values[..., None]).int().argmax(-1)  # the first index holding the max
    assert torch.equal(i, first)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(B=st.integers(1, 2), nb=st.integers(1, 5), V=st.sampled_from([4, 17, 1024, 1500, 2049, beam_triton.ROW_MAX + 3]),
       k=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), tied_beams=st.booleans(), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 2.0, 0.37]))
def test_beam_expand_kernels_match_reference(B, nb, V, k, dtype, tied_beams, seed, scale):
    """Tokens and beams equal, scores to float32 rounding; ties inside a row (equal logits,
    lowest id first) and across beams (equal rows and scores, earlier child first) included.
    Vocabularies over one chunk (1024) merge candidates from several chunks; one beam over at
    most ROW_MAX logits takes the one-launch row kernel, over more the chunks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, nb, V, generator=g) * 3
    x[..., V // 2] = x[..., V // 3] = x.amax(-1) + 1  # a tie at the top of every row
    scores = torch.randn(B, nb, generator=g)
    if tied_beams:  # every beam the same: the best children tie across beams
        x[:, 1:] = x[:, :1]
        scores[:, 1:] = scores[:, :1]
    x = x.to(dtype)
    tok, sc, beams = beam_triton.beam_expand(x, scores, k, scale)
    rtok, rsc, rbeams = beam_naive.beam_expand(x, scores, k, scale)
    assert tok.shape == rtok.shape == (B, nb * k) and beams.shape == rbeams.shape == (B, k)
    assert torch.equal(tok, rtok) and torch.equal(beams, rbeams)
    assert sc.dtype == rsc.dtype == torch.float32
    torch.testing.assert_close(sc, rsc, rtol=1e-6, atol=1e-5)


def test_beam_expand_reference_is_the_log_softmax_rollout_step():
    """Scores are beam score + log-softmax of the chosen tokens, in float64 for float64 logits
    (the exactness tests' dtype), and the dispatcher keeps float64 on the reference."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 50, generator=g, dtype=torch.float64)
    s = torch.randn(2, 3, generator=g, dtype=torch.float64)
    tok, sc, beams = ops.beam_expand(x, s, 4)
    lp = torch.log_softmax(x, -1)
    assert sc.dtype == torch.float64
    torch.testing.assert_close(sc, (s[..., None] + lp.gather(-1, tok.view(2, 3, 4))).flatten(1), rtol=0, atol=1e-12)
    assert torch.equal(tok.view(2, 3, 4), lp.topk(4, -1).indices)
    assert torch.equal(beams, sc.topk(4, -1).indices)
    # scale: the scores of the tempered distribution, the same tokens
    tok2, sc2, _ = ops.beam_expand(x, s, 4, 0.5)
    assert torch.equal(tok2, tok)
    torch.testing.assert_close(sc2, (s[..., None] + torch.log_softmax(0.5 * x, -1).gather(-1, tok.view(2, 3, 4))).flatten(1),
                               rtol=0, atol=1e-12)


def test_expand_switch_traces_the_reference(monkeypatch):
    """`SPECLA_BEAM_EXPAND=torch`, and top-1 always: `tree.expand` calls the reference itself,
    not the custom op."""
    from specla.drafters import tree

    calls = []
    with monkeypatch.context() as m:
        m.setattr(beam_naive, "beam_expand", lambda *a: calls.append("ref") or ("t", "s", "b"))
        m.setattr(ops, "BEAM_EXPAND", "torch")
        assert tree.expand(torch.zeros(1, 1), torch.zeros(1, 1, 8), 2) == ("t", "s", "b") and calls == ["ref"]
        m.setattr(ops, "BEAM_EXPAND", "auto")
        m.setattr(ops, "beam_expand", lambda *a: calls.append("op"))
        assert tree.expand(torch.zeros(1, 1), torch.zeros(1, 1, 8), 1) == ("t", "s", "b") and calls == ["ref", "ref"]
    tok, sc, beams = tree.expand(torch.zeros(1, 1), torch.arange(8.0)[None, None], 2)  # the custom op
    assert tok.tolist() == [[7, 6]] and beams.tolist() == [[0, 1]]


def test_beam_expand_custom_op_traces():
    """The custom op's schema and fake shapes hold (`torch.library.opcheck`), and a compiled
    function calling it, as the drafter's compiled rollout does, returns the eager result."""
    g = torch.Generator().manual_seed(2)
    x, s = torch.randn(1, 4, 40, generator=g), torch.randn(1, 4, generator=g)
    torch.library.opcheck(ops.beam_expand, (x, s, 3))
    torch.library.opcheck(ops.beam_expand, (x, s, 3, 0.5))
    compiled = torch.compile(lambda a, b: ops.beam_expand(a, b, 3), backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x, s), ops.beam_expand(x, s, 3)):
        assert torch.equal(got, want)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(B=st.integers(1, 2), nb=st.integers(1, 5), V=st.sampled_from([16, 100, 1000]), D=st.sampled_from([16, 40, 64]),
       k=st.integers(1, 4), tied=st.booleans(), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 2.0]))
def test_head_expand_kernel_matches_reference(B, nb, V, D, k, tied, seed, scale):
    """fp32: the fused norm + head + chunked top-k picks the reference's tokens and beams
    (heads of several chunks, beams of several rows, a partial last chunk), scores to fp32
    rounding; tied: two head rows equal, so every beam's top logit ties (lowest id first)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, nb, D, generator=g)
    weight = torch.randn(V, D, generator=g)
    if tied:
        weight[V // 2] = weight[V // 3] = weight.sum(0) / 4  # large: at the top of most rows, tied
    norm_w = 1 + 0.1 * torch.randn(D, generator=g)
    scores = torch.randn(B, nb, generator=g)
    # the beams' ancestor rows over 1 + 3·nb entries: random, each beam's own entry set
    E, start = 1 + 3 * nb, 1 + nb
    rows = torch.rand(B, nb, E, generator=g) < 0.4
    tok, sc, beams, ntok, nsc, nsrc, nrows = beam_triton.head_expand(h, weight, norm_w, 1e-6, scores, k, scale,
                                                                     rows, start, E, block=16)
    rtok, rsc, rbeams, rntok, rnsc, rnsrc, rnrows = beam_naive.head_expand(h, weight, norm_w, 1e-6, scores, k, scale,
                                                                          rows, start, E)
    assert torch.equal(tok, rtok) and torch.equal(beams, rbeams)
    torch.testing.assert_close(sc, rsc, rtol=1e-5, atol=1e-4)
    # the next beams: the picked children's tokens, scores and parents, as the rollout would find them
    assert torch.equal(ntok, rntok) and torch.equal(ntok, tok.gather(1, beams))
    assert torch.equal(nsrc, rnsrc) and torch.equal(nsrc, beams // k)
    # the next beams' rows: their parent beam's, and their own entry
    assert nrows.dtype == torch.bool and torch.equal(nrows, rnrows)
    assert torch.equal(rnrows, tree.entry_ancestors(rows, nsrc, start, E))
    assert torch.equal(nsc, sc.gather(1, beams))
    torch.testing.assert_close(nsc, rnsc, rtol=1e-5, atol=1e-4)


def test_head_expand_kernel_bf16_picks_the_reference_logits():
    """bf16: the kernel's logits round as the modules' do, so each pick's reference logit is
    the reference's value at that rank (a near-tie may swap two tokens, never their values by
    more than one bf16 step) and the scores agree to bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 4, 64, generator=g).bfloat16()
    weight = (torch.randn(300, 64, generator=g) / 8).bfloat16()
    norm_w = torch.ones(64).bfloat16()
    scores = torch.zeros(1, 4)
    tok, sc, *_ = beam_triton.head_expand(h, weight, norm_w, 1e-6, scores, 4, 1.0, block=64)
    logits = linear_naive.fused(h, weight, norm_w, 1e-6).float()
    rvals = beam_naive.top_k(logits, 4)[0].flatten(1)
    picked = logits.flatten(1).gather(1, (tok.view(1, 4, 4) + 300 * torch.arange(4)[None, :, None]).flatten(1))
    torch.testing.assert_close(picked, rvals, rtol=0, atol=0.02)
    rsc = beam_naive.head_expand(h, weight, norm_w, 1e-6, scores, 4, 1.0)[1]
    torch.testing.assert_close(sc, rsc, rtol=0, atol=0.03)


def test_head_expand_op_dispatch():
    """The op runs the kernel where `fuses_head` (Triton backend, not fp64, D within a program's
    tile) and the reference elsewhere; both give the reference's picks on fp32."""
    g = torch.Generator().manual_seed(1)
    h, weight, norm_w = torch.randn(1, 3, 32, generator=g), torch.randn(200, 32, generator=g), torch.ones(32)
    scores = torch.randn(1, 3, generator=g)
    ref = beam_naive.head_expand(h, weight, norm_w, 1e-6, scores, 2)
    with ops.backend("triton"), torch.no_grad():
        assert ops.fuses_head(h, weight) and not ops.fuses_head(h.double(), weight.double())
        out = ops.head_expand(h, weight, norm_w, 1e-6, scores, 2)
    with ops.backend("triton"):
        assert not ops.fuses_head(h, weight)  # under autograd (training): the modules
    assert not ops.fuses_head(h, weight)  # CPU tensors under the auto backend: the reference
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    # no beam scores (the root's depth): zeros, in the kernel and the reference
    zero = beam_naive.head_expand(h, weight, norm_w, 1e-6, torch.zeros(1, 3), 2)
    for impl in (beam_naive.head_expand, beam_triton.head_expand):
        for a, b in zip(impl(h, weight, norm_w, 1e-6, None, 2), zero):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    # the root's depth (one beam, no rows): the children's rows are the root's entry and their own
    root = h[:, :1]
    for impl in (beam_naive.head_expand, beam_triton.head_expand):
        out = impl(root, weight, norm_w, 1e-6, None, 2, 1.0, None, 1, 5)
        assert torch.equal(out[6], tree.entry_ancestors(tree.entry_ancestors(None, out[5][:, :1], 0, 5), out[5], 1, 5))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile on CPU needs a C++ compiler (none found)")
def test_compiled_tree_rollout_scores_with_head_expand(monkeypatch):
    """The EAGLE drafter's tree rollout compiled as its graph is, on the Triton backend: every
    depth scores through `ops.head_expand` (an opaque op inside the compiled rollout) and the
    drafted tokens, parents and valid counts equal the eager rollout's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_attention_kernels import _drafter
    from specla import fused

    calls = []
    monkeypatch.setattr(beam_triton, "head_expand", lambda *a, _f=beam_triton.head_expand, **k:
                        calls.append(1) or _f(*a, **k))
    with ops.backend("triton"), torch.no_grad():
        d, root = _drafter(torch.float32, dict(topk=3, depth=3), graphs_compile="default")
        W = d._window()
        eager = d.draft(root, d.k.clone()[:, :, :W], d.v.clone()[:, :, :W], graphed=True)
        assert len(calls) == d.depth
        keys, values = d.k[:, :, :W], d.v[:, :, :W]
        fused.mark_dynamic(2, keys, values)
        compiled = d._graph_fns()[0](root, keys, values)
    assert len(calls) == 2 * d.depth
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
