"""`ops.masked_attention`: the reference against SDPA, and the Triton kernels against the reference
(interpreter on CPU): one launch (a window of one stretch) and stretches merged by the combine
kernel, at the default tiling (one block a program) and a looping one."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specla import ops
from specla.ops.attention import naive as attention_naive
from specla.ops.attention import triton as attention_triton


def _case(B, n, H, D, W, cap, dtype, seed, empty_row=False):
    """Keys and values as strided views of a larger cache (as the drafter's window is), a random
    mask in which every query keeps at least one slot unless `empty_row`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H, D, generator=g).to(dtype)
    cache_k = torch.randn(B, H, cap, D, generator=g).to(dtype)
    cache_v = torch.randn(B, H, cap, D, generator=g).to(dtype)
    mask = torch.rand(B, n, W, generator=g) < 0.6
    mask[..., torch.randint(0, W, (1,), generator=g)] = True
    if empty_row:
        mask[0, 0] = False
    return q, cache_k[:, :, :W], cache_v[:, :, :W], mask


def test_reference_is_sdpa():
    """Where every query keeps a slot, the reference is SDPA with a boolean mask."""
    q, k, v, mask = _case(2, 3, 4, 16, 40, 48, torch.float64, 0)
    ref = attention_naive.masked_attention(q, k, v, mask, 0.25)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=0.25)
    torch.testing.assert_close(ref, sdpa.transpose(1, 2).flatten(2), rtol=0, atol=1e-12)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(B=st.integers(1, 2), n=st.integers(1, 5), H=st.integers(1, 3), D=st.sampled_from([8, 24, 64]),
       W=st.sampled_from([1, 37, 128, 256, 300, 700]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       empty_row=st.booleans(), tiling=st.sampled_from([{}, {"split": 256, "block": 64}]),
       seed=st.integers(0, 2**16))
def test_masked_attention_kernels_match_reference(B, n, H, D, W, dtype, empty_row, tiling, seed):
    """fp32 to 1e-5 relative, bf16 outputs to bf16 rounding; windows of several stretches (two
    launches), programs that loop over blocks, and a query with nothing to attend to (zeros)."""
    q, k, v, mask = _case(B, n, H, D, W, W + 5, dtype, seed, empty_row)
    out = attention_triton.masked_attention(q, k, v, mask, D ** -0.5, **tiling)
    ref = attention_naive.masked_attention(q, k, v, mask, D ** -0.5)
    assert out.shape == ref.shape == (B, n, H * D) and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    if empty_row:
        assert not out[0, 0].any()


def test_dispatch_keeps_float64_on_the_reference():
    q, k, v, mask = _case(1, 2, 2, 8, 20, 20, torch.float64, 3)
    with ops.backend("triton"):
        out = ops.masked_attention(q, k, v, mask, 0.5)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, attention_naive.masked_attention(q, k, v, mask, 0.5), rtol=0, atol=0)
