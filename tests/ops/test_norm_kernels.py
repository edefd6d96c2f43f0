"""The Triton GDN output norm equals its torch reference (interpreter on CPU)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla import ops
from specla.ops.norm import naive
from specla.ops.norm import triton as norm_triton

from .kernel_cases import close


@settings(max_examples=20, deadline=None, derandomize=True)
@given(B=st.sampled_from([1, 2]), n=st.sampled_from([1, 3, 17]), HV=st.sampled_from([1, 4]), V=st.sampled_from([4, 6, 32]),
       gate=st.sampled_from([None, "silu", "sigmoid"]), strided=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_gated_rms_norm_matches_reference(B, n, HV, V, gate, strided, dtype, seed):
    """Per token and value head; z as the split view of a projection the fused path passes."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(B, n, HV, V, generator=g) * 3
    wide = torch.randn(B, n, HV * V + 7, generator=g).to(dtype)
    z = None if gate is None else (wide[..., 7:] if strided else wide[..., :HV * V].contiguous())
    w = torch.randn(V, generator=g).to(dtype)
    out = norm_triton.gated_rms_norm(o, z, w, 1e-6, gate or "silu", dtype)
    ref = naive.gated_rms_norm(o, z, w, 1e-6, gate or "silu", dtype)
    assert out.shape == ref.shape == (B, n, HV * V) and out.dtype == ref.dtype == dtype
    if dtype == torch.float32:
        close(out, ref, "gated_rms_norm")
    else:  # one bf16 rounding of the result: at most one ulp apart
        assert ((out.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs()).all()


def test_gated_rms_norm_dispatch_keeps_fp64_on_the_reference():
    o = torch.randn(1, 2, 2, 4, dtype=torch.float64)
    z, w = torch.randn(1, 2, 8, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    with ops.backend("triton"):
        out = ops.gated_rms_norm(o, z, w, 1e-6, "silu", torch.float64)
    assert torch.equal(out, naive.gated_rms_norm(o, z, w, 1e-6, "silu", torch.float64))
