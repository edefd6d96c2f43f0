"""`ops.masked_attention`: the reference against SDPA, and the Triton kernels against the reference
(interpreter on CPU): one launch (a window of one stretch) and stretches merged by the combine
kernel, at the default tiling (one block a program) and a looping one. `ops.draft_attention`
(RoPE, cache writes and mask in the same launches): the kernel against the reference, the
reference against its definition, and the drafter's rollout through it against the path it
replaced, eager and compiled."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specla import fused, ops
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


# `ops.draft_attention`: RoPE, the entries' cache writes and the mask inside the attention launch

def _draft_case(B, H, D, R, depth, width, lengths, W, dtype, seed):
    """A draft step at `depth` of a rollout of `width` beams a depth: q, k, v as the unbound views
    of one qkv tensor (as the drafter's), a cache of W + 3 slots whose window is its first W,
    per-row lengths, and the entries' ancestor rows (`tree.entry_ancestors` over random beam
    choices: ancestor-closed), None for a chain (width 1) or the root."""
    from specla.rotary import rotary_inv_freq
    from specla.drafters import tree

    g = torch.Generator().manual_seed(seed)
    n = 1 if depth == 0 else width
    E = 1 + max(depth, 1) * width
    q, k, v = torch.randn(B, n, 3, H, D, generator=g).to(dtype).unbind(2)
    cache = [torch.randn(B, H, W + 3, D, generator=g).to(dtype) for _ in range(2)]
    rows = None
    for dd in range(depth + 1 if width > 1 else 0):
        m = 1 if dd == 0 else width
        src = torch.randint(0, 1 if dd <= 1 else width, (B, m), generator=g)
        rows = tree.entry_ancestors(rows, src, 0 if dd == 0 else 1 + (dd - 1) * width, E)
    start = 0 if depth == 0 else 1 + (depth - 1) * width
    inv_freq = rotary_inv_freq(2 * R, 10000.0, dtype)
    return (q, k, v, *cache, torch.tensor(lengths), depth, start, rows if depth > 0 else None, inv_freq, D ** -0.5)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(B=st.integers(1, 2), H=st.integers(1, 2), dims=st.sampled_from([(64, 32), (24, 8), (40, 20)]),
       depth=st.integers(0, 3), width=st.integers(1, 3), short=st.booleans(),
       tiling=st.sampled_from([{}, {"split": 64, "block": 32}]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_draft_attention_kernel_matches_reference(B, H, dims, depth, width, short, tiling, dtype, seed):
    """Outputs and written cache slots (rotated keys; values exactly), fp32 to 1e-5 (the
    angle's cos and sin differ by an ulp), bf16 to its rounding; every other slot of the
    cache, past the window too, is untouched. Chains and trees (random ancestor rows), a window of one
    stretch and of several, full and partial rotary (dims: head, rotated pairs), rows with no
    committed entry (length 0) and rows with ~100."""
    D, R = dims
    g = torch.Generator().manual_seed(seed)
    lengths = [0 if short and b == 0 else int(torch.randint(1, 130, (1,), generator=g)) for b in range(B)]
    E = 1 + max(depth, 1) * width
    W = max(lengths) + E + int(torch.randint(0, 40, (1,), generator=g))
    q, k, v, keys, values, length, depth, start, rows, inv_freq, scale = _draft_case(
        B, H, D, R, depth, width, lengths, W, dtype, seed)
    ck, cv = keys.clone(), values.clone()
    out = attention_triton.draft_attention(q, k, v, keys[:, :, :W], values[:, :, :W], length, depth, start, rows,
                                           inv_freq, scale, **tiling)
    ref = attention_naive.draft_attention(q, k, v, ck[:, :, :W], cv[:, :, :W], length, depth, start, rows,
                                          inv_freq, scale)
    assert out.shape == ref.shape == (B, q.shape[1], H * D) and out.dtype == dtype
    # bf16: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest, so a rotated
    # key may be off by two ulps of its terms (normal samples below 8: 2 * 2**-5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2 * 2**-5)
    torch.testing.assert_close(out, ref, **tol)
    written = torch.zeros(B, W + 3, dtype=torch.bool)
    for b, L in enumerate(lengths):
        written[b, L + start:L + start + q.shape[1]] = True
    assert written.sum() == B * q.shape[1]
    assert torch.equal(keys.transpose(1, 2)[~written], ck.transpose(1, 2)[~written])
    assert torch.equal(values.transpose(1, 2)[~written], cv.transpose(1, 2)[~written])
    assert torch.equal(values.transpose(1, 2)[written], cv.transpose(1, 2)[written])
    torch.testing.assert_close(keys.transpose(1, 2)[written], ck.transpose(1, 2)[written], **tol)


def test_draft_attention_reference_is_rotary_store_and_mask():
    """The reference against its definition spelt out: q and k rotated by `apply_rotary` at
    length + depth, k and v written to slots length + start + i, and each query attending to
    the committed slots, its earlier path entries and itself (not its siblings)."""
    from specla.rotary import apply_rotary

    q, k, v, keys, values, length, depth, start, rows, inv_freq, scale = _draft_case(
        2, 2, 24, 8, 2, 3, [4, 0], 30, torch.float64, 7)
    ck, cv = keys.clone(), values.clone()
    out = attention_naive.draft_attention(q, k, v, keys[:, :, :30], values[:, :, :30], length, depth, start, rows,
                                          inv_freq, scale)
    pos = (length + depth)[:, None].expand(2, 3)
    qr, kr = apply_rotary(q, pos, inv_freq), apply_rotary(k, pos, inv_freq)
    mask = torch.zeros(2, 3, 30, dtype=torch.bool)
    for b in range(2):
        L = int(length[b])
        for i in range(3):
            ck[b, :, L + start + i], cv[b, :, L + start + i] = kr[b, i], v[b, i]
            mask[b, i, :L] = True
            for e in range(start + i + 1):
                mask[b, i, L + e] = bool(rows[b, i, e])
            assert mask[b, i, L + start + i] and not mask[b, i, L + start:L + start + i].any()
    assert torch.equal(keys, ck) and torch.equal(values, cv)
    torch.testing.assert_close(out, attention_naive.masked_attention(qr, ck[:, :, :30], cv[:, :, :30], mask, scale),
                               rtol=0, atol=0)


def test_draft_attention_op_dispatch_writes_the_cache_in_place():
    """The custom op writes the caller's cache (through the window's views) in place; float64
    stays on the reference even with the Triton backend."""
    q, k, v, keys, values, *rest = _draft_case(1, 2, 16, 8, 1, 2, [5], 12, torch.float64, 3)
    before = keys.clone()
    ck, cv = keys.clone(), values.clone()
    with ops.backend("triton"):
        out = ops.draft_attention(q, k, v, keys[:, :, :12], values[:, :, :12], *rest)
    ref = attention_naive.draft_attention(q, k, v, ck[:, :, :12], cv[:, :, :12], *rest)
    assert torch.equal(out, ref) and torch.equal(keys, ck) and torch.equal(values, cv)
    assert not torch.equal(keys, before)


# the drafter's rollout through `ops.draft_attention` against the path it replaced

def _old_rollout(d, root, keys, values):
    """`EagleDrafter.rollout` before `ops.draft_attention`: rotary in `qkv`, `_store`, the mask
    of committed and in-draft entries from `tree.entry_ancestors`, `masked_attention`."""
    from specla.drafters import tree

    m, tgt, w, E = d.model, d.target, d.width, d.entries
    B = root.shape[0]
    rel = torch.arange(keys.shape[2])[None] - d.len[:, None]
    committed, in_draft, entry_of_slot = rel < 0, (rel >= 0) & (rel < E), rel.clamp(0, E - 1)
    h, rows = d.pending[:, None], None

    def step(dd, tokens, src, rows_given):
        nonlocal h, rows
        n = tokens.shape[1]
        start = 0 if dd == 0 else 1 + (dd - 1) * w
        rows = tree.entry_ancestors(None if dd == 0 else rows, src, start, E)
        x = m.step_inputs(tgt.embeddings.weight, tokens, h, src)
        q, kk, v = m.qkv(x, (d.len + dd)[:, None].expand(B, n))
        d._store(keys, values, d.len[:, None] + start + torch.arange(n), kk, v)
        sees = rows.gather(2, entry_of_slot[:, None, :].expand(B, n, -1))
        h = m.finish(x, ops.masked_attention(q, keys, values, committed[:, None] | (in_draft[:, None] & sees), m.scale), d._gate_up)
        return m.logits(h, tgt.lm_head.weight)

    return tree.beam_search(step, root, d.topk, d.depth, None, True, w, 1 / d.temperature)


def _drafter(dtype, shape, graphs_compile=None):
    """A random drafter over a random tiny target that has consumed two prompts of 9 and 6
    tokens (batch rows of different lengths), and the rollout's root tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import random_model, tiny_config
    from specla.drafters.eagle import EagleConfig, EagleDrafter, EagleDrafterModel

    cfg = tiny_config(5)
    model = random_model(cfg, 5).to(dtype)
    torch.manual_seed(5)
    dm = EagleDrafterModel(EagleConfig.for_target(cfg)).to(dtype).eval()
    x = torch.randint(3, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    d = EagleDrafter(dm, model, initial_capacity=64, compile=graphs_compile, **shape)
    d.reset(2)
    h = model(x[:, :-1], model.new_cache(2), capture=d.capture).hidden
    d.extend(x[:, :-1], h, torch.tensor([9, 6]))
    return d, x[:, -1]


ROLLOUTS = [dict(topk=1, depth=4), dict(topk=3, depth=3), dict(topk=3, depth=3, width=2), dict(topk=3, depth=3, width=1)]


@pytest.mark.parametrize("shape", ROLLOUTS)
@pytest.mark.parametrize("dtype,backend", [(torch.float64, "triton"), (torch.float32, "torch"),
                                           (torch.float32, "triton")])
def test_rollout_through_draft_attention_equals_the_old_path(shape, dtype, backend, monkeypatch):
    """Chains, trees and width-1 rollouts over two batch rows of different lengths draft the
    same tokens and parents as before, and write the same cache: bit for bit on the references
    (float64, and fp32 on torch), tokens exactly and scores and cache entries to fp32 rounding
    through the Triton kernel (interpreter), which the fp32 rollout must then call once a depth."""
    calls = []
    monkeypatch.setattr(attention_triton, "draft_attention", lambda *a, _f=attention_triton.draft_attention, **kw:
                        calls.append(a[6]) or _f(*a, **kw))
    with ops.backend(backend):
        d, root = _drafter(dtype, shape)
        W = d._window()
        old_k, old_v = d.k.clone(), d.v.clone()
        old = _old_rollout(d, root, old_k[:, :, :W], old_v[:, :, :W])
        new = d.rollout(root, d.k[:, :, :W], d.v[:, :, :W])
    assert calls == (list(range(d.depth)) if dtype == torch.float32 and backend == "triton" else [])
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    if calls:
        torch.testing.assert_close(new[2], old[2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d.k, old_k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d.v, old_v, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(new[2], old[2]) and torch.equal(d.k, old_k) and torch.equal(d.v, old_v)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile on CPU needs a C++ compiler (none found)")
def test_compiled_rollout_writes_the_cache_in_place(monkeypatch):
    """The rollout compiled as its graph is (fullgraph, dynamic window) drafts what the eager
    one drafts, and every `ops.draft_attention` inside it gets the drafter's cache itself
    (functionalization copies no cache: the op writes the graph input in place)."""
    seen = []
    monkeypatch.setattr(attention_naive, "draft_attention", lambda q, k, v, keys, values, *a, _f=attention_naive.
                        draft_attention: seen.append((keys.data_ptr(), values.data_ptr())) or _f(q, k, v, keys, values, *a))
    d, root = _drafter(torch.float32, dict(topk=3, depth=3), graphs_compile="default")
    W = d._window()
    eager_k = d.k.clone()
    eager = d.draft(root, eager_k[:, :, :W], d.v.clone()[:, :, :W], graphed=True)
    seen.clear()
    keys, values = d.k[:, :, :W], d.v[:, :, :W]
    fused.mark_dynamic(2, keys, values)
    compiled = d._graph_fns()[0](root, keys, values)
    assert seen == [(d.k.data_ptr(), d.v.data_ptr())] * d.depth
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    torch.testing.assert_close(d.k, eager_k, rtol=1e-5, atol=1e-5)


def test_compiled_adaptive_rollouts_share_their_drafts():
    """With a depth policy each depth's compiled rollout (fullgraph, dynamic window) drafts what
    the eager one drafts at that depth, into the one set of buffers both depths share (the
    target's round graph reads them in place)."""
    d, root = _drafter(torch.float32, dict(topk=3, depth=(2, 3), budget=6), graphs_compile="default")
    W = d._window()
    keys, values = d.k[:, :, :W], d.v[:, :, :W]
    fused.mark_dynamic(2, keys, values)
    for depth in (2, 3):
        eager = d.draft(root, d.k.clone()[:, :, :W], d.v.clone()[:, :, :W], graphed=True, depth=depth)
        compiled = d._graph_fns(depth)[0](root, keys, values)
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(compiled, d._drafts))
        for a, b in zip(compiled, eager):
            assert torch.equal(a, b), depth
