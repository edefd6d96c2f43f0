"""The Triton GEMV equals its torch reference (interpreter on CPU), every bench tiling."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla.ops.linear import naive
from specla.ops.linear import triton as linear_triton


@settings(max_examples=25, deadline=None, derandomize=True)
@given(N=st.sampled_from([1, 5, 37, 64, 130]), K=st.sampled_from([3, 16, 50, 130, 256, 600]),
       tiling=st.sampled_from(linear_triton.TILINGS), lead=st.sampled_from([(1,), (1, 1)]),
       seed=st.integers(0, 2**16))
def test_gemv_matches_reference(N, K, tiling, lead, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g)
    w = torch.randn(N, K, generator=g)
    bn, bk, warps = tiling
    out = linear_triton.gemv(x, w, block_n=bn, block_k=bk, num_warps=warps)
    ref = naive.gemv(x, w)
    assert out.shape == ref.shape == (*lead, N)
    assert ((out - ref).abs().max() / ref.abs().max().clamp(min=1)) < 1e-5


def test_gemv_bf16_weights_and_rejects_several_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 96, generator=g).bfloat16()
    w = torch.randn(40, 96, generator=g).bfloat16()
    out = linear_triton.gemv(x, w)
    ref = naive.gemv(x, w)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref.float()).abs() <= 1e-2 * ref.float().abs().max()).all()  # one bf16 rounding apart
    with pytest.raises(ValueError, match="one row"):
        linear_triton.gemv(torch.randn(2, 96).bfloat16(), w)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(M=st.sampled_from([1, 2, 9, 16, 17, 32]), N=st.sampled_from([1, 5, 37, 64, 130]),
       K=st.sampled_from([16, 50, 130, 256]), tiling=st.sampled_from(linear_triton.SKINNY_TILINGS),
       seed=st.integers(0, 2**16))
def test_skinny_matches_reference(M, N, K, tiling, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    bm, bn, bk, warps = tiling
    if bm < M:
        with pytest.raises(ValueError, match="block_m"):
            linear_triton.skinny(x, w, block_m=bm, block_n=bn, block_k=bk, num_warps=warps)
        return
    out = linear_triton.skinny(x, w, block_m=bm, block_n=bn, block_k=bk, num_warps=warps)
    ref = naive.skinny(x, w)
    assert out.shape == ref.shape == (1, M, N)
    assert ((out - ref).abs().max() / ref.abs().max().clamp(min=1)) < 1e-5


def test_skinny_rejects_too_many_rows():
    with pytest.raises(ValueError, match="rows"):
        linear_triton.skinny(torch.randn(1, 33, 64), torch.randn(8, 64))
