"""Where a GDN verify's time goes, by difference: time variants of the parallel verifier that
leave one stage out or change its precision, and the serial tree pass before and after a
change, in one process on one GPU (H200.md: "time variants that leave one stage out ... and
take differences"). The variants are not specla's code: each is the shipped kernel's source
with one textual edit, imported from a scratch module, and its outputs are not checked (most
are wrong on purpose). Only `full` must equal the shipped kernel, and the script checks that.

    python benchmarks/diagnostics/verify_parts.py [--old-serial PATH] [--out FILE]

--old-serial: another version of `specla/ops/gdn/serial.py` (e.g. `git show REV:...`), timed
beside the current one on the same trees. Shapes: the paper's (HV = 8, dk = dv = 256), 24 layers
replayed from one CUDA graph and divided by 24, as `specla bench kernels` times Table 1. On CPU
(TRITON_INTERPRET=1) it runs every variant once at a tiny shape: a smoke test of the edits.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from specla.bench.common import environment, graph_time_ms, load_variant, write_json
from specla.bench.kernels import Bench
from specla.bench.trees import beam_tree
from specla.ops.gdn import parallel

ROOT = Path(__file__).resolve().parents[2]
PARALLEL_SRC = ROOT / "specla/ops/gdn/parallel.py"
SERIAL_SRC = ROOT / "specla/ops/gdn/serial.py"

# name -> [(old text, new text), ...] applied to parallel.py; every old text must occur once.
# Until 2026-12-06 (parallel_split.py) the parallel verifier was one launch, and these edits
# cut its K loop; they now cut the products launch's or the solve's stages.
PARALLEL_EDITS = {
    "full": [],
    "no_jacobi": [("for _ in range(1, depth):", "for _ in range(1, 1):")],
    "no_kk_qk": [("            KQK = tl.dot(b_kq, tl.trans(b_k), KQK, input_precision=PREC)\n", "")],
    "no_ks_qs": [("    return tl.dot(b_kq.to(tl.float32), S, acc, input_precision=PREC)\n", "    return acc\n")],
    "no_flush_store": [("        if flush:\n            tl.store(p_S + o_k[:, None] * V, S, mask=m_S)\n", "")],
}


def parallel_variants(tmp: Path) -> dict:
    base = PARALLEL_SRC.read_text()
    out = {}
    for name, edits in PARALLEL_EDITS.items():
        src = base
        for old, new in edits:
            if src.count(old) != 1:
                raise SystemExit(f"variant {name}: its edit no longer matches parallel.py once")
            src = src.replace(old, new)
        out[name] = load_variant(src, f"parallel_{name}", tmp).gdn_tree_verify
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-serial", type=Path, help="another serial.py to time beside the current one")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/verify_parts.json"))
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    b = Bench(dev, 8, 8, 256, 256, 24, torch.bfloat16, False) if cuda else \
        Bench(dev, 2, 2, 16, 16, 2, torch.float32, True)
    scale = b.K ** -0.5
    shapes = [(4, 4, 16), (2, 12, 16), (4, 12, 16)] if cuda else [(2, 3, 6)]
    result = {**environment(), "note": __doc__.split("\n\n")[0].replace("\n", " "), "shape":
              {"H": b.H, "HV": b.HV, "K": b.K, "V": b.V, "layers": b.layers}, "parallel": [], "serial": []}

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sys.path.insert(0, d)
        variants = parallel_variants(tmp)
        serials = {"current": load_variant(SERIAL_SRC.read_text(), "serial_current", tmp).gdn_tree_verify}
        if args.old_serial:
            serials["old"] = load_variant(args.old_serial.read_text(), "serial_old", tmp).gdn_tree_verify
        for topk, depth, nodes in shapes:
            p = beam_tree(topk, depth, nodes, seed=0)
            par = torch.tensor([p], device=dev)
            ins = b.layer_inputs(len(p), 7)
            pend = b.pending(8, 4, 3)
            ref = parallel.gdn_tree_verify(*ins[0][:5], ins[0][5].clone(), par, scale, pend)
            got = variants["full"](*ins[0][:5], ins[0][5].clone(), par, scale, pend)
            if not all(torch.equal(x, y) for x, y in zip(ref, got)):
                raise SystemExit("the `full` variant differs from the shipped parallel verifier")
            row = {"topk": topk, "depth": depth, "nodes": nodes}
            for name, fn in variants.items():
                for label, pd in (("", None), ("+pending", pend)):
                    row[name + label + "_ms"] = graph_time_ms(
                        lambda: [fn(*x, par, scale, pd) for x in ins], cuda) / b.layers
            for prec in ("tf32", "ieee"):
                row[f"precision_{prec}_ms"] = graph_time_ms(
                    lambda: [parallel.gdn_tree_verify(*x, par, scale, precision=prec) for x in ins], cuda) / b.layers
            result["parallel"].append(row)
            srow = {"topk": topk, "depth": depth, "nodes": nodes}
            chain_like = torch.arange(-1, len(p) - 1, device=dev)[None]  # exact mode's padded chain, in tree mode
            for name, fn in serials.items():
                for tiling in ({"block_v": 16, "num_warps": 4}, {"block_v": 8, "num_warps": 1}):
                    key = f"{name}_bv{tiling['block_v']}_w{tiling['num_warps']}"
                    srow[key + "_ms"] = graph_time_ms(lambda: [fn(*x, par, scale, **tiling) for x in ins], cuda) / b.layers
                    srow[key + "_chain_in_tree_mode_ms"] = graph_time_ms(
                        lambda: [fn(*x, chain_like, scale, **tiling) for x in ins], cuda) / b.layers
            result["serial"].append(srow)
            print(json.dumps(row), json.dumps(srow), flush=True)
        sys.path.remove(d)
    if cuda:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
