"""Triton short-conv kernels equal their torch references (interpreter on CPU)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from .kernel_cases import KINDS, close, parents_of

from specla import ops
from specla.ops.conv import naive
from specla.ops.conv import triton as conv_triton

HYP = settings(max_examples=15, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture])


@HYP
@given(B=st.sampled_from([1, 2]), n=st.integers(1, 12), kinds=st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)),
       C=st.sampled_from([8, 40, 130]), W=st.sampled_from([2, 3, 4]), bias=st.booleans(), strided=st.booleans(),
       seed=st.integers(0, 2**16))
def test_tree_conv_matches_reference(B, n, kinds, C, W, bias, strided, seed, poison):
    g = torch.Generator().manual_seed(seed)
    par = torch.tensor([parents_of(kinds[b], n, seed + b) for b in range(B)])
    wide = torch.randn(B, n, 2 * C + 3, generator=g)
    x = wide[:, :, 3:C + 3] if strided else wide[:, :, :C].contiguous()  # the model passes a split view
    conv_state = torch.randn(B, C, W - 1, generator=g)
    weight = torch.randn(C, W, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    ref = naive.tree_conv(x, conv_state, weight, b, par)
    out = conv_triton.tree_conv(x, conv_state, weight, b, par)
    close(out, ref, "tree_conv")


@HYP
@given(B=st.sampled_from([1, 2]), n=st.integers(1, 8), P=st.integers(1, 6), C=st.sampled_from([8, 130]),
       W=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
def test_conv_commit_matches_reference(B, n, P, C, W, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, C, generator=g)
    conv_state = torch.randn(B, C, W - 1, generator=g)
    path = torch.randint(0, n, (B, P), generator=g)
    for length in (torch.zeros(B, dtype=torch.long), torch.full((B,), P), torch.randint(0, P + 1, (B,), generator=g)):
        ref, out = conv_state.clone(), conv_state.clone()
        naive.conv_commit(ref, x, path, length)
        conv_triton.conv_commit(out, x, path, length)
        assert torch.equal(out, ref), f"length {length.tolist()}"


def test_conv_dispatch_and_bf16():
    g = torch.Generator().manual_seed(0)
    B, n, C, W = 1, 6, 24, 4
    par = torch.tensor([[-1, 0, 1, 1, 0, 4]])
    x = torch.randn(B, n, C, generator=g).bfloat16()
    conv_state = torch.randn(B, C, W - 1, generator=g).bfloat16()
    weight = torch.randn(C, W, generator=g).bfloat16()
    ref = naive.tree_conv(x.float(), conv_state.float(), weight.float(), None, par)
    with ops.backend("triton"):
        out = ops.tree_conv(x, conv_state, weight, None, par)
        assert out.dtype == torch.bfloat16
        assert (out.float() - ref).abs().max() < 2e-2 * ref.abs().max()
        st_ref, st_out = conv_state.clone(), conv_state.clone()
        naive.conv_commit(st_ref, x, torch.tensor([[0, 4, 5]]), torch.tensor([3]))
        ops.conv_commit(st_out, x, torch.tensor([[0, 4, 5]]), torch.tensor([3]))
        assert torch.equal(st_out, st_ref)


@HYP
@given(B=st.sampled_from([1, 2]), H=st.sampled_from([1, 2]), gva=st.sampled_from([1, 2]), K=st.sampled_from([4, 8, 12]),
       V=st.sampled_from([4, 8, 6]), W=st.sampled_from([2, 3, 4]), bias=st.booleans(), neg=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_step_prelude_matches_reference(B, H, gva, K, V, W, bias, neg, dtype, seed):
    """An AR step's conv + factors in one kernel (GVA: HV = 2H covered; K, V not powers of two):
    the fp32 outputs and the advanced conv state equal the reference's."""
    g = torch.Generator().manual_seed(seed)
    HV = H * gva
    C = 2 * H * K + HV * V
    proj = (torch.randn(B, 1, C + 2 * HV + 5, generator=g) * 2).to(dtype)  # x, a, b: views of one projection
    x, a, b = proj[..., :C], proj[..., C:C + HV], proj[..., C + HV:C + 2 * HV]
    conv_state = torch.randn(B, C, W - 1, generator=g).to(dtype)
    weight = torch.randn(C, W, generator=g).to(dtype)
    bias_ = torch.randn(C, generator=g).to(dtype) if bias else None
    A_log, dt_bias = torch.randn(HV, generator=g), torch.randn(HV, generator=g) * 8  # softplus both ways
    s_ref, s_out = conv_state.clone(), conv_state.clone()
    ref = naive.step_prelude(x, s_ref, weight, bias_, a, b, A_log, dt_bias, H, K, neg)
    out = conv_triton.step_prelude(x, s_out, weight, bias_, a, b, A_log, dt_bias, H, K, neg)
    assert torch.equal(s_out, s_ref)  # the window moved by one token: a copy, no arithmetic
    for name, o, r in zip(("q", "k", "v", "g", "beta"), out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype == torch.float32, name
        if dtype == torch.float32:
            close(o, r, name)
        else:  # one bf16 rounding of the conv and of its SiLU: the fp32 sums may round the other way
            assert (o - r).abs().max() <= 2 ** -6 * r.abs().max().clamp(min=1), name


def test_step_prelude_dispatch_takes_the_reference_for_fp64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 2 * 4 + 2 * 4, generator=g, dtype=torch.float64)
    st_a, st_b = torch.randn(1, 16, 3, dtype=torch.float64, generator=g), None
    st_b = st_a.clone()
    args = (torch.randn(16, 4, dtype=torch.float64, generator=g), None, torch.randn(1, 1, 2, dtype=torch.float64),
            torch.randn(1, 1, 2, dtype=torch.float64), torch.randn(2), torch.randn(2), 1, 4, False)
    with ops.backend("triton"):
        out = ops.step_prelude(x, st_a, *args, state_dtype=torch.float64)
    ref = naive.step_prelude(x, st_b, *args, state_dtype=torch.float64)
    assert all(torch.equal(o, r) and o.dtype == torch.float64 for o, r in zip(out, ref))
    assert torch.equal(st_a, st_b)


@HYP
@given(B=st.sampled_from([1, 2]), n=st.integers(1, 40), kinds=st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)),
       H=st.sampled_from([1, 2]), gva=st.sampled_from([1, 2]), K=st.sampled_from([4, 12]), V=st.sampled_from([4, 6]),
       W=st.sampled_from([2, 4]), bias=st.booleans(), neg=st.booleans(), seed=st.integers(0, 2**16))
def test_tree_prelude_matches_reference(B, n, kinds, H, gva, K, V, W, bias, neg, seed):
    """A verify's tree conv + factors in one kernel, on random topologies of 1 to 40 nodes (past
    the 33 of the largest tree a verifier takes); the conv state is only read."""
    g = torch.Generator().manual_seed(seed)
    HV = H * gva
    C = 2 * H * K + HV * V
    par = torch.tensor([parents_of(kinds[i], n, seed + i) for i in range(B)])
    proj = torch.randn(B, n, C + 2 * HV + 5, generator=g) * 2
    x, a, b = proj[..., :C], proj[..., C:C + HV], proj[..., C + HV:C + 2 * HV]
    conv_state = torch.randn(B, C, W - 1, generator=g)
    weight = torch.randn(C, W, generator=g)
    bias_ = torch.randn(C, generator=g) if bias else None
    A_log, dt_bias = torch.randn(HV, generator=g), torch.randn(HV, generator=g) * 8
    before = conv_state.clone()
    ref = naive.tree_prelude(x, conv_state, weight, bias_, par, a, b, A_log, dt_bias, H, K, neg)
    out = conv_triton.tree_prelude(x, conv_state, weight, bias_, par, a, b, A_log, dt_bias, H, K, neg)
    assert torch.equal(conv_state, before)
    for name, o, r in zip(("q", "k", "v", "g", "beta"), out, ref):
        assert o.shape == r.shape and o.dtype == torch.float32, name
        close(o, r, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_step_prelude_is_row_zero_of_every_chain_verify(dtype, bias):
    """An AR step's factors are bit for bit row 0 of a chain verify's, and a chain's rows do not
    depend on how many nodes it has (1 to 17 here; 17 takes another tile and warp count than 9):
    the conv, its rounding and the l2 norm are one code path in a fixed order, so the default
    routes compute each position as AR does. The conv state a step leaves is the one a commit
    of that node leaves."""
    g = torch.Generator().manual_seed(7)
    B, H, K, HV, V, W, n = 2, 2, 12, 4, 6, 4, 17
    C = 2 * H * K + HV * V
    proj = (torch.randn(B, n, C + 2 * HV, generator=g) * 2).to(dtype)
    x, a, b = proj[..., :C], proj[..., C:C + HV], proj[..., C + HV:]
    conv_state = torch.randn(B, C, W - 1, generator=g).to(dtype)
    weight = torch.randn(C, W, generator=g).to(dtype)
    bias_ = torch.randn(C, generator=g).to(dtype) if bias else None
    A_log, dt_bias = torch.randn(HV, generator=g), torch.randn(HV, generator=g) * 8
    consts = (A_log, dt_bias, H, K, False)
    chain = torch.arange(-1, n - 1).expand(B, -1).contiguous()
    full = conv_triton.tree_prelude(x, conv_state, weight, bias_, chain, a, b, *consts)
    for m in (1, 2, 9):
        part = conv_triton.tree_prelude(x[:, :m], conv_state, weight, bias_, chain[:, :m].contiguous(), a[:, :m],
                                        b[:, :m], *consts)
        for name, p_, f in zip("qkvgb", part, full):
            assert torch.equal(p_, f[:, :m]), (m, name)
    for tiling in ((2, 2), (8, 4), (32, 8)):  # nodes a program, warps: the same bits from any split
        for name, t_, f in zip("qkvgb", conv_triton.tree_prelude(x, conv_state, weight, bias_, chain, a, b, *consts,
                                                                 tiling=tiling), full):
            assert torch.equal(t_, f), (tiling, name)
    stepped = conv_state.clone()
    step = conv_triton.step_prelude(x[:, :1], stepped, weight, bias_, a[:, :1], b[:, :1], *consts)
    for name, s_, f in zip("qkvgb", step, full):
        assert torch.equal(s_, f[:, :1]), name
    committed = conv_state.clone()
    conv_triton.conv_commit(committed, x, torch.zeros(B, 1, dtype=torch.long), torch.ones(B, dtype=torch.long))
    assert torch.equal(stepped, committed)
    # the plain path's step conv: the one-node tree conv's bits, the same state, the reference's values
    conv_stepped, ref_stepped = conv_state.clone(), conv_state.clone()
    y = conv_triton.step_conv(x[:, :1], conv_stepped, weight, bias_)
    root = torch.full((B, 1), -1)
    assert torch.equal(y, conv_triton.tree_conv(x[:, :1], conv_state, weight, bias_, root))
    assert torch.equal(conv_stepped, committed)
    ref = naive.step_conv(x[:, :1], ref_stepped, weight, bias_)
    assert torch.equal(ref_stepped, committed)
    assert (y.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max().clamp(min=1)


def test_tree_prelude_rejects_a_low_precision_state():
    n = 3
    with pytest.raises(ValueError, match="fp32 state"):
        conv_triton.tree_prelude(torch.randn(1, n, 16), torch.randn(1, 16, 3), torch.randn(16, 4), None,
                                 torch.arange(-1, n - 1)[None], torch.randn(1, n, 2), torch.randn(1, n, 2),
                                 torch.randn(2), torch.randn(2), 1, 4, False, torch.bfloat16)
