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


@settings(max_examples=25, deadline=None, derandomize=True)
@given(M=st.sampled_from([1, 2, 9, 16, 17, 32]), N=st.sampled_from([1, 5, 37, 64, 130, 700]),
       K=st.sampled_from([3, 16, 50, 130, 256]), seed=st.integers(0, 2**16))
def test_rows_matches_reference(M, N, K, seed):
    """The fp32 multiply-add kernel equals the reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    out = linear_triton.rows(x, w)
    ref = naive.skinny(x, w)
    assert out.shape == ref.shape == (1, M, N)
    assert ((out - ref).abs().max() / ref.abs().max().clamp(min=1)) < 1e-5


def test_skinny_rejects_too_many_rows():
    with pytest.raises(ValueError, match="rows"):
        linear_triton.skinny(torch.randn(1, 33, 64), torch.randn(8, 64))


def test_best_tilings_pick_the_fastest_of_cublas_and_each_kernel(tmp_path):
    """`bench gemv` rows -> per (kind, N, K) the fastest way; cuBLAS's variants the model cannot
    use (another layout) never win; the table loads from a gemv.json or a tilings file."""
    import json

    from specla.ops.linear import tilings

    t8 = {"block_n": 8, "block_k": 512, "num_warps": 4}
    t4 = {"block_n": 4, "block_k": 1024, "num_warps": 4}
    rows = [
        {"matmul": "o_proj", "M": 1, "N": 64, "K": 32, "variant": "linear", "us": 6.0},
        {"matmul": "o_proj", "M": 1, "N": 64, "K": 32, "variant": "mm_kn", "us": 1.0},
        {"matmul": "o_proj", "M": 1, "N": 64, "K": 32, "variant": "triton_8_512_w4", "us": 3.0, "kernel": "gemv",
         "tiling": t8},
        {"matmul": "o_proj", "M": 1, "N": 64, "K": 32, "variant": "skinny_16_32_256_w4", "us": 2.0, "kernel": "skinny",
         "tiling": t4},
        {"matmul": "o_proj", "M": 17, "N": 64, "K": 32, "variant": "linear", "us": 5.0},
        {"matmul": "o_proj", "M": 17, "N": 64, "K": 32, "variant": "skinny_32_32_128_w4", "us": 7.0,
         "kernel": "skinny", "tiling": t8},
    ]
    best = {(b["kind"], b["N"], b["K"]): b for b in tilings.best(rows)}
    # one row, yet the skinny GEMM won: the table keeps which kernel the tiling belongs to
    assert (best[("gemv", 64, 32)]["kernel"], best[("gemv", 64, 32)]["tiling"]) == ("skinny", t4)
    assert best[("gemv", 64, 32)]["cublas_us"] == 6.0
    assert best[("skinny", 64, 32)]["kernel"] == "cublas"  # cuBLAS was faster
    (tmp_path / "gemv.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "tilings.json").write_text(json.dumps({"best": tilings.best(rows)}))
    expect = {("gemv", 64, 32): ("skinny", t4), ("skinny", 64, 32): ("cublas", None)}
    assert tilings.load(tmp_path / "gemv.json") == tilings.load(tmp_path / "tilings.json") == expect
    with pytest.raises(FileNotFoundError, match="SPECLA_LINEAR_TILINGS"):
        tilings.load(tmp_path / "missing.json")


def test_skinny_linear_runs_each_shape_its_measured_way(monkeypatch):
    """ops.skinny_linear takes a shape's tiling from the table, F.linear where the table says
    cuBLAS, and the default tiling for shapes the table lacks."""
    from specla import ops

    calls = []
    monkeypatch.setattr(linear_triton, "gemv", lambda x, w, **t: calls.append(("gemv", t)) or naive.gemv(x, w))
    monkeypatch.setattr(linear_triton, "skinny", lambda x, w, **t: calls.append(("skinny", t)) or naive.skinny(x, w))
    t4 = {"block_n": 4, "block_k": 1024, "num_warps": 4}
    monkeypatch.setattr(ops, "LINEAR_TILINGS", {("gemv", 8, 32): ("skinny", t4), ("skinny", 8, 32): ("cublas", None)})
    w, w2 = torch.randn(8, 32), torch.randn(9, 32)
    with ops.backend("triton"):
        for x, wt in ((torch.randn(1, 32), w), (torch.randn(5, 32), w), (torch.randn(1, 32), w2),
                      (torch.randn(5, 32), w2)):
            assert torch.allclose(ops.skinny_linear(x, wt), x @ wt.T, atol=1e-5)
    assert calls == [("skinny", t4), ops.GEMV_TILING, ops.SKINNY_TILING]


@pytest.mark.parametrize("rows", [1, 2, 9, 17, 32, 33])
def test_ops_linear_fp32_rows_match_f_linear(rows, monkeypatch):
    """ops.linear under SPECLA_FP32_LINEAR=rows: fp32 products of 2-32 rows take the
    multiply-add kernel where Triton runs (cuBLAS's fp32 kernels at 9 rows were 8x slower on the
    H200), the rest F.linear; same values."""
    from specla import ops

    monkeypatch.setattr(ops, "FP32_LINEAR", "rows")
    taken = []
    monkeypatch.setattr(linear_triton, "rows", lambda x, w, _f=linear_triton.rows: taken.append(1) or _f(x, w))
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(1, rows, 48, generator=g), torch.randn(20, 48, generator=g)
    with ops.backend("triton"):
        out = ops.linear(x, w)
    ref = torch.nn.functional.linear(x, w)
    assert out.shape == ref.shape
    assert ((out - ref).abs().max() / ref.abs().max()) < 1e-5
    assert bool(taken) == (2 <= rows <= 32)


def test_ops_linear_keeps_autograd(monkeypatch):
    """Training calls the same modules: with gradients wanted ops.linear is F.linear (the
    custom op has no backward)."""
    from specla import ops

    monkeypatch.setattr(ops, "FP32_LINEAR", "rows")
    x = torch.randn(9, 32, requires_grad=True)
    w = torch.randn(8, 32, requires_grad=True)
    with ops.backend("triton"):
        ops.linear(x, w).sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(9, -1))
    assert torch.allclose(w.grad, x.detach().sum(0).expand(8, -1))


# Triton 3.7's interpreter multiplies bf16 `tl.dot` operands as garbage (~1e10 for unit
# inputs), so the kernel is checked in fp32 here; its bf16 rows on the H200 are checked by
# benchmarks/diagnostics/row_invariance.py (row_invariance_*.json)
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                           ("triton", torch.float32)])
def test_invariant_linear_rows_do_not_depend_on_how_many_come(backend, dtype, monkeypatch):
    """ops.invariant_linear: row i of an n-row product is bit for bit the product of row i
    alone for every n up to 32 (exact mode at each route's own width rests on it), and equals
    the reference; more rows go to F.linear."""
    import numpy as np

    from specla import ops

    if backend == "triton":
        # the interpreter's `tl.dot` is numpy's matmul, whose BLAS may round a row by where it
        # sits in the block (OpenBLAS's Haswell kernels on an AVX2 host: rows 6+ of a 32-row
        # block differ from row 0 by an ulp); a tensor core's dot does not. One row a matmul
        # here, so the test checks the kernel's own part: masking, one tiling, one K order
        matmul = np.matmul
        monkeypatch.setattr(np, "matmul", lambda a, b, **kw: np.concatenate(
            [matmul(a[..., i:i + 1, :], b, **kw) for i in range(a.shape[-2])], -2))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 48, generator=g).to(dtype)
    x = torch.randn(1, 33, 48, generator=g).to(dtype)
    with ops.backend(backend):
        alone = torch.cat([ops.invariant_linear(x[:, i:i + 1], w) for i in range(32)], 1)
        for n in (2, 5, 9, 17, 32):
            assert torch.equal(ops.invariant_linear(x[:, :n], w), alone[:, :n])
        assert torch.equal(ops.invariant_linear(x, w), torch.nn.functional.linear(x, w))  # 33 rows
    ref = naive.skinny(x[:, :32], w).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((alone.float() - ref).abs().max() / ref.abs().max()) < tol


@settings(max_examples=30, deadline=None, derandomize=True)
@given(M=st.sampled_from([1, 2, 4, 9, 16]), N=st.sampled_from([1, 5, 37, 64, 130, 700]),
       K=st.sampled_from([3, 16, 50, 130, 256, 600, 1024]), norm=st.booleans(), glu=st.booleans(),
       res=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), block_n=st.sampled_from([None, 1, 4]),
       seed=st.integers(0, 2**16))
def test_fused_matches_reference(M, N, K, norm, glu, res, dtype, block_n, seed):
    """Norm, product, gate and residual in one launch equal the reference composition: fp32 to
    rounding; bf16 within a few bf16 steps (the products' sums run in another order, so a
    product may round to the neighbouring bf16 value, which the gate's silu(g) * u amplifies).
    Rows up to FUSED_ONE_TILE long, each one tile."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, M, K, generator=g).to(dtype)
    w = (torch.randn(2 * N if glu else N, K, generator=g) / K ** 0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype) if norm else None
    r = torch.randn(1, M, N, generator=g).to(dtype) if res else None
    out = linear_triton.fused(x, w, nw, 1e-6, r, glu, block_n=block_n)
    ref = naive.fused(x, w, nw, 1e-6, r, glu)
    assert out.shape == ref.shape == (1, M, N) and out.dtype == dtype
    err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1)).item()
    assert err < (1e-5 if dtype == torch.float32 else 5e-2)
    if dtype == torch.bfloat16:  # most elements agree to a rounding step or two
        close = (out.double() - ref.double()).abs() <= 2 ** -6 * ref.double().abs() + 1e-2
        assert (~close).sum() <= max(2, 0.05 * close.numel())


@settings(max_examples=20, deadline=None, derandomize=True)
@given(B=st.sampled_from([1, 2]), n=st.sampled_from([1, 3, 4]), nb=st.sampled_from([1, 4]),
       D=st.sampled_from([16, 48, 256]), N=st.sampled_from([7, 64, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_draft_inputs_matches_reference(B, n, nb, D, N, dtype, seed):
    """A draft step's input in one launch (embedding lookup, the parent's h by src, both norms,
    fc) equals the reference: fp32 to rounding, bf16 within a few bf16 steps."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(50, D, generator=g).to(dtype)
    tokens = torch.randint(0, 50, (B, n), generator=g)
    h = torch.randn(B, nb, D, generator=g).to(dtype)
    src = torch.randint(0, nb, (B, n), generator=g)
    ne, nf = ((1 + 0.1 * torch.randn(D, generator=g)).to(dtype) for _ in range(2))
    w = (torch.randn(N, 2 * D, generator=g) / D ** 0.5).to(dtype)
    out = linear_triton.draft_inputs(table, tokens, h, src, ne, nf, 1e-6, w)
    ref = naive.draft_inputs(table, tokens, h, src, ne, nf, 1e-6, w)
    assert out.shape == ref.shape == (B, n, N) and out.dtype == dtype
    err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)


def test_fused_rejects_bad_shapes():
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="rows"):
        linear_triton.fused(torch.randn(17, 32), torch.randn(8, 32))
    with pytest.raises(ValueError, match="at most 1024 values"):
        linear_triton.fused(torch.randn(1, 1100), torch.randn(8, 1100))
    with pytest.raises(ValueError, match="even"):
        linear_triton.fused(x, torch.randn(7, 32), glu=True)
    with pytest.raises(ValueError, match="residual"):
        linear_triton.fused(x, torch.randn(8, 32), residual=torch.randn(1, 3, 4))


@pytest.mark.parametrize("shape", [dict(topk=1, depth=4), dict(topk=3, depth=3, budget=8)])
def test_drafter_step_with_fused_linear_equals_its_modules(shape, monkeypatch):
    """The EAGLE drafter's step on `ops.draft_inputs` and `ops.fused_linear` (norm + qkv,
    o_proj + residual, norm + gate|up + gate, down + residual, norm + LM head; a tree's norm +
    LM head + depth step as `ops.head_expand`) drafts what its modules draft (fp32, a random
    drafter over a random target), and the training path keeps autograd's modules."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import random_model, tiny_config
    from specla import ops
    from specla.drafters.eagle import EagleConfig, EagleDrafter, EagleDrafterModel

    cfg = tiny_config(5)
    model = random_model(cfg, 5).float()
    torch.manual_seed(5)
    dm = EagleDrafterModel(EagleConfig.for_target(cfg)).float().eval()
    x = torch.randint(3, cfg.vocab_size, (1, 9))
    calls = []
    from specla.ops.beam import triton as beam_triton

    for mod, fn in ((linear_triton, "fused"), (linear_triton, "draft_inputs"), (beam_triton, "head_expand")):
        monkeypatch.setattr(mod, fn, lambda *a, _f=getattr(mod, fn), _n=fn, **k: calls.append(_n) or _f(*a, **k))
    out = {}
    for mode in ("auto", "torch"):
        monkeypatch.setattr(ops, "DRAFT_FUSED", mode)
        with ops.backend("triton"):
            d = EagleDrafter(dm, model, **shape)
            d.reset(1)
            h = model(x[:, :-1], model.new_cache(1), capture=d.capture).hidden
            d.extend(x[:, :-1], h, torch.tensor([8]))
            out[mode] = d.rollout(x[:, -1], d.k, d.v)
        fused = {"fused", "draft_inputs"} | ({"head_expand"} if shape["topk"] > 1 else set())
        assert set(calls) == (fused if mode == "auto" else set())
        calls.clear()
    (tok, par, score), (tok0, par0, score0) = out["auto"], out["torch"]
    assert torch.equal(tok, tok0) and torch.equal(par, par0)
    torch.testing.assert_close(score, score0, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(ops, "DRAFT_FUSED", "auto")
    with ops.backend("triton"):  # training: gradients flow through the modules, no custom op
        feat = torch.randn(1, 6, cfg.hidden_size)
        hs = dm.unroll(feat, torch.randn(1, 6, cfg.hidden_size), 2)
        hs[-1].sum().backward()
    assert not calls and dm.qkv_proj.weight.grad is not None


def test_fused_op_keeps_rows_longer_than_a_tile_on_the_reference():
    """`ops.fused_linear` / `ops.draft_inputs` on rows the kernels do not take (longer than a
    tile, too many, fp64) compute the reference."""
    from specla import ops

    g = torch.Generator().manual_seed(0)
    x, w, nw = torch.randn(1, 2, 1100, generator=g), torch.randn(8, 1100, generator=g), torch.rand(1100, generator=g)
    with ops.backend("triton"):
        assert torch.equal(ops.fused_linear(x, w, nw), naive.fused(x, w, nw))
        table, h, fc = torch.randn(9, 600, generator=g), torch.randn(1, 1, 600, generator=g), torch.randn(8, 1200)
        tok, src, ones = torch.tensor([[3]]), torch.zeros(1, 1, dtype=torch.long), torch.ones(600)
        assert torch.equal(ops.draft_inputs(table, tok, h, src, ones, ones, 1e-6, fc),
                           naive.draft_inputs(table, tok, h, src, ones, ones, 1e-6, fc))


def test_fuses_linear_only_where_measured(monkeypatch):
    """The drafter takes the fused kernels for few rows of one tile, outside autograd, on
    Triton; a wide LM head of several rows, rows longer than a tile (never timed on the GPU),
    training and SPECLA_DRAFT_FUSED=torch keep the modules."""
    from specla import ops

    x1, x4 = torch.randn(1, 1, 256), torch.randn(1, 4, 256)
    head, qkv, wide = torch.randn(8192, 256), torch.randn(768, 256), torch.randn(256, 2048)
    assert not ops.fuses_linear(x1, qkv)  # CPU: no Triton
    with ops.backend("triton"), torch.no_grad():
        assert ops.fuses_linear(x1, qkv) and ops.fuses_linear(x4, qkv) and ops.fuses_linear(x1, head)
        assert not ops.fuses_linear(x4, head)
        assert not ops.fuses_linear(torch.randn(1, 1, 2048), wide)
        assert not ops.fuses_linear(torch.randn(1, 17, 256), qkv)
        assert not ops.fuses_linear(x1.double(), qkv.double())
        monkeypatch.setattr(ops, "DRAFT_FUSED", "torch")
        assert not ops.fuses_linear(x1, qkv)
    monkeypatch.setattr(ops, "DRAFT_FUSED", "auto")
    with ops.backend("triton"):
        assert torch.is_grad_enabled() and not ops.fuses_linear(x1, qkv)  # gradients wanted
