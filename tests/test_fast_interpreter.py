"""`fast_interpreter` changes what the interpreter costs, not what it computes."""

import pytest
import torch
from triton.runtime import interpreter as it

import fast_interpreter
from specla import topology
from specla.bench.trees import beam_tree
from specla.ops.gdn import serial

from ops.kernel_cases import inputs


def _serial_outputs(par, seed):
    q, k, v, g, beta, S = inputs(1, par.shape[1], 1, 2, 16, 16, seed)
    o, u = serial.gdn_tree_verify(q, k, v, g, beta, S, par, 0.25)
    seq = serial.gdn_chain_sequence(q, k, v, g, beta, S.clone(), 0.25)
    return o, u, seq


@pytest.mark.parametrize("par", [topology.chain(5), torch.tensor([beam_tree(2, 3, 6, seed=2)])])
def test_serial_verifier_bits_equal_under_the_slow_reduce(par, monkeypatch):
    fast_interpreter.install()
    assert it.ReduceOps.apply_impl is not fast_interpreter.ORIGINALS["apply_impl"]
    fast = _serial_outputs(par, 3)
    monkeypatch.setattr(it.ReduceOps, "apply_impl", fast_interpreter.ORIGINALS["apply_impl"])
    monkeypatch.setattr(it, "_patch_builtin", fast_interpreter.ORIGINALS["_patch_builtin"])
    monkeypatch.setattr(it, "_get_np_dtype", fast_interpreter.ORIGINALS["_get_np_dtype"])
    slow = _serial_outputs(par, 3)
    for a, b in zip(fast, slow):
        assert a.view(torch.int32).equal(b.view(torch.int32))  # bits, signed zeros included


def test_dtype_cache_agrees_with_the_interpreter():
    import triton.language as tl

    fast_interpreter.install()
    for d in (tl.int1, tl.int32, tl.int64, tl.uint16, tl.float32, tl.bfloat16, tl.pointer_type(tl.float32),
              tl.block_type(tl.float32, [4, 2]), tl.block_type(tl.pointer_type(tl.int32), [8])):
        assert it._get_np_dtype(d) == fast_interpreter.ORIGINALS["_get_np_dtype"](d)
