"""`specla bench gemv`: a batch-1 step's matmuls, cuBLAS's variants and specla's own kernels.

At batch 1 an AR step is ~70% GEMV time (`bench decode --profile`), and cuBLAS reads some of
the step's weight matrices far below the copy bandwidth (o_proj 31%, down 47% on the H200).
This times each matmul of a named shape ([M, K] × a bf16 [N, K] weight; M = 1 for an AR step)
as the model runs it (`F.linear`), and the variants a fix could pick without writing a kernel:

- `linear`: F.linear(x, W), W [N, K] (what the model does);
- `mm_kn`: x @ W' with W' [K, N] contiguous (the other cuBLAS layout, same bytes);
- `pad_M`: W's N rounded up to a multiple of M (other tilings; the extra rows are waste);
- `split`: in_proj as its [q; k; v; z] part and its a|b part (2·HV rows) in two calls;
- `triton_BN_BK_wW`: specla's own GEMV kernel (`ops.linear.triton`) at each of its tilings;
- with M = 17 rows (a 16-draft-node verify): `linear` and `skinny_BM_BN_BK_wW`, specla's skinny
  GEMM at each tiling (the Triton kernels on CPU only under Triton's interpreter).

Every variant runs over `layers` distinct weight copies inside one CUDA graph (the H200's L2
holds 50 MB: one matrix replayed alone would be served from it), so a figure is a decode
step's: µs per matmul, and the fraction of the measured copy bandwidth its weight bytes imply.
Writes `gemv.json`, with `best`: per weight shape and kind the fastest of cuBLAS and specla's
tilings (`ops.linear.tilings`; `specla/ops/linear/tilings.json` holds the H200's). On CPU
(`quick`): a smoke run of the code path, the times mean nothing.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specla.bench.common import RESULTS, copy_bandwidth, graph_time_ms, write_results
from specla.ops.linear import tilings
from specla.shapes import shape_config


def matmuls(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of every single-row matmul of a GDN layer and the LM head."""
    kd, vd, hv = cfg.num_heads * cfg.head_dim, cfg.num_v_heads * cfg.head_v_dim, cfg.num_v_heads
    D, I = cfg.hidden_size, cfg.intermediate_size
    return {"in_proj": (2 * kd + 2 * vd + 2 * hv, D), "o_proj": (D, vd), "gate_up": (2 * I, D),
            "down": (D, I), "lm_head": (cfg.vocab_size, D)}


def _variants(cfg, name, N, x, ws, pads, quick: bool, triton_ok: bool) -> dict:
    """name -> ((kernel, tiling), a function computing x Wᵀ for every weight copy): one way
    each; kernel "cublas" (tiling None) for F.linear and its variants."""
    M = x.shape[0]
    cublas = ("cublas", None)
    variants = {"linear": (cublas, lambda: [F.linear(x, w) for w in ws])}
    if M == 1:
        wt = [w.t().contiguous() for w in ws]
        variants["mm_kn"] = (cublas, lambda: [x @ w for w in wt])
        for m in pads:
            Np = -(-N // m) * m
            if Np != N:
                wp = [F.pad(w, (0, 0, 0, Np - N)) for w in ws]
                variants[f"pad_{m}"] = (cublas, lambda wp=wp: [F.linear(x, w) for w in wp])
        if name == "in_proj":
            ab = 2 * cfg.num_v_heads
            parts = [(w[:N - ab].contiguous(), w[N - ab:].contiguous()) for w in ws]
            variants["split"] = (cublas, lambda: [(F.linear(x, a), F.linear(x, b)) for a, b in parts])
    if triton_ok:
        from specla.ops.linear import triton as linear

        if M == 1:
            for bn, bk, warps in linear.TILINGS[:2] if quick else linear.TILINGS:
                variants[f"triton_{bn}_{bk}_w{warps}"] = (
                    ("gemv", {"block_n": bn, "block_k": bk, "num_warps": warps}),
                    lambda bn=bn, bk=bk, warps=warps: [
                        linear.gemv(x, w, block_n=bn, block_k=bk, num_warps=warps) for w in ws])
        fits = [t for t in linear.SKINNY_TILINGS if t[0] >= M]  # BM holds the rows
        for bm, bn, bk, warps in fits[:2] if quick else fits:
            variants[f"skinny_{bm}_{bn}_{bk}_w{warps}"] = (
                ("skinny", {"block_n": bn, "block_k": bk, "num_warps": warps}),  # block_m follows the rows
                lambda bm=bm, bn=bn, bk=bk, warps=warps: [
                    linear.skinny(x, w, block_m=bm, block_n=bn, block_k=bk, num_warps=warps) for w in ws])
    return variants


def run(shape: str = "gdn-1.3b-paper", device: str = "cuda", layers: int = 24, pads=(64, 128, 256),
        row_counts=(1, 17), quick: bool = False, out_dir=RESULTS) -> dict:
    """`row_counts`: rows of x per matmul (1: an AR step; 17: a 16-draft-node verify)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cfg = shape_config(shape)
    dt = torch.bfloat16 if cuda else torch.float32
    bw = copy_bandwidth() if cuda else None
    triton_ok = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (N, K) in matmuls(cfg).items():
        copies = 1 if name == "lm_head" or quick else layers  # the LM head alone is 2.5x the L2
        ws = [torch.randn(N, K, device=dev, dtype=dt, generator=g) * K ** -0.5 for _ in range(copies)]
        for M in row_counts:
            x = torch.randn(M, K, device=dev, dtype=dt, generator=g)
            ref = F.linear(x, ws[0]).float()
            for var, ((kernel, tiling), fn) in _variants(cfg, name, N, x, ws, pads, quick, triton_ok).items():
                first = fn()[0]  # every variant must compute the model's product (pads: its first N)
                first = torch.cat(first, -1) if isinstance(first, tuple) else first[..., :N]
                diff = float((first.float() - ref).abs().max() / ref.abs().max())
                us = graph_time_ms(fn, cuda, rep=50) * 1e3 / copies
                rows.append({"matmul": name, "M": M, "N": N, "K": K, "variant": var, "us": us, "max_rel_diff": diff,
                             "bandwidth_fraction": N * K * 2 / (us * 1e-6) / bw if bw else None,
                             "kernel": kernel, "tiling": tiling})
        del ws
        if cuda:
            torch.cuda.empty_cache()
    result = {"shape": shape, "layers": 1 if quick else layers, "copy_bandwidth_GBps": bw / 1e9 if bw else None,
              "rows": rows, "best": tilings.best(rows)}
    _print(result)
    write_results("gemv", result, out_dir)
    return result


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"batch-1 matmuls, {result['shape']} (µs each, one of {result['layers']} weight copies)")
    for c in ("matmul", "M", "N", "K", "variant", "us", "of copy bandwidth"):
        t.add_column(c)
    for r in result["rows"]:
        f = r["bandwidth_fraction"]
        t.add_row(r["matmul"], str(r["M"]), str(r["N"]), str(r["K"]), r["variant"], f"{r['us']:.2f}",
                  "-" if f is None else f"{f:.0%}")
    Console().print(t)
    b = Table(title="fastest per weight shape (ops.linear.tilings)")
    for c in ("kind", "matmul", "N", "K", "way", "us", "cuBLAS us"):
        b.add_column(c)
    for e in result["best"]:
        way = " ".join([e["kernel"]] + [f"{k}={v}" for k, v in (e["tiling"] or {}).items()])
        b.add_row(e["kind"], e["matmul"], str(e["N"]), str(e["K"]), way, f"{e['us']:.2f}", f"{e['cublas_us']:.2f}")
    Console().print(b)
