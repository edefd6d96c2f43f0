"""Per weight shape, the fastest way to run a batch-1 matmul, as `specla bench gemv` measured it.

No one tiling of the GEMV suits both a 2048-row o_proj (it needs many small programs to cover
the SMs) and the 32000-row LM head, and for some shapes cuBLAS stays faster; so `bench gemv`
times every tiling of both kernels for every matmul of a shape (the skinny GEMM sometimes wins
for one row too), and `best` keeps, per (kind, N, K), the fastest of cuBLAS and those. `tilings.json` beside this file holds that choice for the named
shapes as measured on the H200; `SPECLA_LINEAR_TILINGS=path` (a tilings file or a gemv.json)
replaces it, e.g. on another GPU. Shapes not listed take `ops.GEMV_TILING` / `ops.SKINNY_TILING`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PATH = Path(__file__).with_name("tilings.json")
KINDS = {1: "gemv"}  # rows -> kind; any other row count a `bench gemv` row has is a verify's: skinny


def best(rows: list[dict]) -> list[dict]:
    """From `bench gemv` rows: per (kind, N, K), cuBLAS as the model calls it (`linear`) or the
    fastest tiling of specla's kernels, whichever took less time."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["variant"] == "linear" or r.get("tiling"):  # not cuBLAS variants the model cannot use
            groups.setdefault((KINDS.get(r["M"], "skinny"), r["N"], r["K"]), []).append(r)
    out = []
    for (kind, N, K), rs in groups.items():
        cublas = next((r["us"] for r in rs if r["variant"] == "linear"), None)
        win = min(rs, key=lambda r: r["us"])
        out.append({"kind": kind, "N": N, "K": K, "matmul": win["matmul"], "M": win["M"],
                    "kernel": win.get("kernel") or "cublas", "tiling": win.get("tiling"), "us": win["us"], "cublas_us": cublas})
    return out


def load(path: str | os.PathLike | None = None) -> dict[tuple[str, int, int], tuple[str, dict | None]]:
    """(kind, N, K) -> (kernel, its keyword arguments): kernel "gemv", "skinny" or "cublas"."""
    path = path or os.environ.get("SPECLA_LINEAR_TILINGS")
    if path is None and not PATH.exists():
        return {}
    path = Path(path or PATH)
    if not path.exists():
        raise FileNotFoundError(f"no matmul tilings at {path} (SPECLA_LINEAR_TILINGS)")
    data = json.loads(path.read_text())
    entries = data["best"] if "best" in data else best(data["rows"])
    return {(e["kind"], e["N"], e["K"]): (e["kernel"], e["tiling"]) for e in entries}
