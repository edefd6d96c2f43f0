"""Kernel tests run the Triton kernels under the interpreter on CPU (DESIGN §3, §8).

TRITON_INTERPRET must be set before triton is imported (triton.jit decides at decoration
time); tests/conftest.py sets it too, this keeps tests/ops runnable on its own.

Shims, for fla's kernels only (ours need none):
- fla's autotuner benchmarks its configs: `fla_chunk_cpu` stubs `Autotuner.do_bench`;
- fla's chunk kernels call `.to()` on `for i in range(...)` indices, which the interpreter leaves
  as plain ints while compiled Triton makes them tensors. The interpreter's source rewriter is
  extended to wrap such loop indices as tensors, as compiled Triton does (tl.static_range
  indices stay constexpr). This is global for the session; it only makes the interpreter closer
  to the compiler.
"""

import ast
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


class _LoopIndexAsTensor(interpreter.ASTTransformer):
    def visit_For(self, node):
        self.generic_visit(node)
        it = node.iter
        name = it.func.attr if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) else (
            it.func.id if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) else None)
        if name == "range" and isinstance(node.target, ast.Name):
            rebind = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                                value=ast.Name(id=node.target.id, ctx=ast.Load()))
            node.body.insert(0, self.visit_Assign(rebind))
        return node


interpreter.FunctionRewriter.ast_transformer = _LoopIndexAsTensor()


@pytest.fixture
def fla_chunk_cpu(monkeypatch):
    from triton.runtime import autotuner

    monkeypatch.setattr(autotuner.Autotuner, "do_bench", lambda self, *a, **k: [1.0, 1.0, 1.0], raising=False)


@pytest.fixture
def poison(monkeypatch):
    """New float tensors start as NaN (ints as -12345), so an output a kernel forgot to write,
    or scratch it reads before writing, shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -12345)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
