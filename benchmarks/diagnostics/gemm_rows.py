"""The target's matmuls by row count and dtype: each weight of a checkpoint applied to M rows
(1 = an AR step, 9 = an 8-token chain's verify, 17 = a 16-node tree's), every layer's copy in
one CUDA graph, µs per matmul, and the cuBLAS kernel each call takes; beside it `ops.linear`
with SPECLA_FP32_LINEAR=rows (fp32's few-row products on specla's multiply-add kernel; its
first run, gemm_rows_b5a3aec.json, had autograd on and so timed cuBLAS twice). Written to test
whether fp32 rounds are slow because of the matmuls at 9 rows (TF32 off): they were.

    python benchmarks/diagnostics/gemm_rows.py [--model DIR] [--rows 1,9,17] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import specla.api as api
from specla import ops
from specla.bench.common import environment, graph_time_ms


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:70] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,9,16,17")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)  # as in decoding: ops.linear leaves products that need gradients to F.linear
    ops.FP32_LINEAR = "rows"  # time the opt-in kernel beside cuBLAS
    lm = api.load(args.model, device="cuda", dtype="float32")
    groups: dict = {}
    for name, p in lm.model.named_parameters():
        if p.dim() == 2 and "embed" not in name:
            groups.setdefault((name.split(".")[-2], tuple(p.shape)), []).append(p)
    rows = [int(x) for x in args.rows.split(",")]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for (name, shape), ws in sorted(groups.items()):
            ws = [w.to(dtype) for w in ws]
            for m in rows:
                x = torch.randn(m, shape[1], device="cuda", dtype=dtype)

                def fn():
                    for w in ws:
                        F.linear(x, w)

                def fn_ops():
                    for w in ws:
                        ops.linear(x, w)

                us = graph_time_ms(fn, True) * 1e3 / len(ws)
                us_ops = graph_time_ms(fn_ops, True) * 1e3 / len(ws)
                out.append({"dtype": str(dtype).replace("torch.", ""), "weight": name, "shape": list(shape),
                            "rows": m, "us": round(us, 2), "ops_linear_us": round(us_ops, 2),
                            "kernels": _kernel_names(lambda: F.linear(x, ws[0])),
                            "ops_linear_kernels": _kernel_names(lambda: ops.linear(x, ws[0]))})
                print(out[-1])
    if args.out:
        Path(args.out).write_text(json.dumps({**environment(), "tf32": torch.backends.cuda.matmul.allow_tf32,
                                              "matmuls": out}, indent=1))


if __name__ == "__main__":
    main()
