"""Shared cases for the kernel tests: topologies, inputs, the fp32 closeness check."""

import torch

from specla.bench.trees import beam_tree


def close(out, ref, what=""):
    """fp32: relative Frobenius error < 1e-5 and max abs error < 1e-5 of the reference's scale."""
    assert not out.isnan().any(), f"{what}: NaN (an output was not written)"
    err = (out.double() - ref.double())
    rel = err.norm() / ref.double().norm().clamp(min=1e-30)
    mx = err.abs().max()
    assert rel < 1e-5 and mx <= 1e-5 * max(1.0, float(ref.abs().max())), f"{what}: rel {rel:.2e}, max abs {mx:.2e}"


def parents_of(kind: str, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ri = lambda hi: int(torch.randint(0, hi, (1,), generator=g))  # noqa: E731
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "deep":  # long paths with an occasional fork
        return [-1] + [max(0, j - 1 - (ri(4) == 0)) for j in range(1, n)]
    if kind == "bushy":
        return [-1] + [(j - 1) // 3 for j in range(1, n)]
    if kind == "beam":
        topk = 2 + ri(3)
        return beam_tree(topk, max(2 + ri(6), n // topk + 1), n - 1, seed=seed)
    return [-1] + [ri(j) for j in range(1, n)]  # random recursive tree


KINDS = ["chain", "star", "deep", "bushy", "beam", "random"]


def inputs(B, n, H, HV, K, V, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, n, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(r(B, n, H, K), dim=-1).to(dtype)
    v = r(B, n, HV, V).to(dtype)
    gl = (-torch.rand(B, n, HV, generator=g) * 0.5).to(dtype)
    beta = torch.rand(B, n, HV, generator=g).to(dtype)
    state = r(B, HV, K, V)
    return q, k, v, gl, beta, state
