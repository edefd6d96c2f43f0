"""The fused ReaDy state reader (Triton, interpreter on CPU) equals its torch reference."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .kernel_cases import close
from specla.ops.gdn import commit as commit_triton
from specla.ops.gdn import naive as gdn_naive
from specla.ops.reader import naive
from specla.ops.reader import triton as reader_triton

HYP = settings(max_examples=30, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def gather_then_read(states, pendings, queries, value_map=None):
    """The unfused way the fused kernel replaces: flush each source layer with `ops.gdn_commit`,
    gather the states into one tensor, then read with dense torch ops."""
    from specla import ops

    for S, pend in zip(states, pendings):
        if pend is not None and pend[0].shape[1]:
            pk, pg, pu, plen = pend
            path = torch.arange(pk.shape[1], device=pk.device).expand(pk.shape[0], -1)
            ops.gdn_commit(S, pk, pg, pu, path, plen)
            plen.zero_()
    St = torch.stack(list(states), 1)  # [B, L, HV, K, V]
    r = torch.einsum("bplhk,blhkv->bplhv", queries.to(St.dtype), St)
    if value_map is not None:
        r = torch.einsum("bplhv,lvr->bplhr", r, value_map.to(St.dtype))
    return r, St.square().sum((-2, -1))


def make_case(B, L, H, HV, K, V, NQ, widths, R, seed, bf16=False):
    g = torch.Generator().manual_seed(seed)
    states = [torch.randn(B, HV, K, V, generator=g) for _ in range(L)]
    pendings = []
    for P in widths:
        if P is None:
            pendings.append(None)
            continue
        pk = torch.nn.functional.normalize(torch.randn(B, P, H, K, generator=g), dim=-1)
        pg = -torch.rand(B, P, HV, generator=g) * 0.5
        pu = torch.randn(B, P, HV, V, generator=g)
        plen = torch.randint(0, P + 1, (B,), generator=g)
        pendings.append((pk, pg, pu, plen))
    q = torch.randn(B, NQ, L, HV, K, generator=g)
    q = q.to(torch.bfloat16) if bf16 else q
    W = torch.randn(L, V, R, generator=g) if R else None
    return states, pendings, q, W


cases = st.fixed_dictionaries({
    "B": st.sampled_from([1, 2]),
    "L": st.integers(1, 3),
    "heads": st.sampled_from([(1, 1), (1, 2), (2, 4)]),  # (H, HV): GVA when HV > H
    "KV": st.sampled_from([(16, 16), (16, 32), (32, 16), (8, 12)]),  # (8, 12): no tl.dot, ragged tile
    "NQ": st.sampled_from([1, 7]),
    "widths": st.lists(st.sampled_from([None, 1, 3, 8]), min_size=3, max_size=3),
    "R": st.sampled_from([0, 4, 8, 16]),  # 0: no value map (raw reads)
    "flush": st.booleans(),
    "bf16": st.booleans(),
    "block_v": st.sampled_from([8, 16]),
    "seed": st.integers(0, 2**16),
})


@HYP
@given(c=cases)
def test_state_read_matches_reference(c, poison):
    (H, HV), (K, V), L = c["heads"], c["KV"], c["L"]
    states, pendings, q, W = make_case(c["B"], L, H, HV, K, V, c["NQ"], c["widths"][:L], c["R"], c["seed"], c["bf16"])
    ref_states, out_states = [s.clone() for s in states], [s.clone() for s in states]
    r_ref, n_ref = naive.state_read(ref_states, pendings, q, W, flush=c["flush"])
    r_out, n_out = reader_triton.state_read(out_states, pendings, q, W, flush=c["flush"], block_v=c["block_v"])
    assert r_out.shape == r_ref.shape == (c["B"], c["NQ"], L, HV, c["R"] or V)
    close(r_out, r_ref, "reads")
    close(n_out, n_ref, "sqnorm")
    for i, (S, pend) in enumerate(zip(states, pendings)):
        want = S.clone()
        if c["flush"] and pend is not None:  # written back: exactly gdn_commit's advanced state
            pk, pg, pu, plen = pend
            path = torch.arange(pk.shape[1]).expand(c["B"], -1)
            gdn_naive.gdn_commit(want, pk, pg, pu, path, plen)
            if K >= 16:
                got = S.clone()
                commit_triton.gdn_commit(got, pk, pg, pu, path, plen)
                close(out_states[i], got, f"layer {i}: state vs the Triton commit")
        close(out_states[i], want, f"layer {i}: state")
        close(ref_states[i], want, f"layer {i}: reference state")


def test_value_map_after_equals_fused():
    """The value map can be fused or applied to the raw reads afterwards."""
    states, pendings, q, W = make_case(2, 2, 1, 2, 16, 32, 7, [3, None], 8, 0)
    raw, _ = reader_triton.state_read([s.clone() for s in states], pendings, q, None)
    fused, _ = reader_triton.state_read([s.clone() for s in states], pendings, q, W)
    close(torch.einsum("bplhv,lvr->bplhr", raw, W), fused, "fused value map")
    base, _ = gather_then_read([s.clone() for s in states], [tuple(t.clone() for t in p) if p else None
                                                             for p in pendings], q, W)
    close(fused, base, "gather-then-read")


def test_table_is_cached_and_reads_buffers_in_place():
    """The address table is built once per set of buffers; later in place updates are seen."""
    states, pendings, q, W = make_case(1, 2, 1, 1, 16, 16, 7, [3, 3], 8, 1)
    t1 = reader_triton.address_table(states, pendings)
    assert reader_triton.address_table(states, pendings) is t1
    states[1].mul_(2)
    pendings[0][3].zero_()
    r, _ = reader_triton.state_read(states, pendings, q, W, flush=False)
    r_ref, _ = naive.state_read(states, pendings, q, W, flush=False)
    close(r, r_ref, "after in place updates")


def test_reference_is_differentiable():
    states, pendings, q, W = make_case(2, 2, 1, 2, 8, 8, 7, [None, None], 4, 2)
    q, W = q.double().requires_grad_(), W.double().requires_grad_()
    states = [s.double() for s in states]
    assert torch.autograd.gradcheck(lambda a, b: naive.state_read(states, pendings, a, b)[0], (q, W))


def test_compiles_for_sm90_without_spills():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "specla.ops.reader.triton"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
