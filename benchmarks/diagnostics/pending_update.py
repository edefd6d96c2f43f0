"""Where the delayed update's time goes in the serial chain verifier: time variants of the
verifier fused with a pending commit (SpecLA §5.2) that leave one part of `advance_tile` or the
flush out, in one process on one GPU, and take differences (H200.md: "time variants that leave
one stage out ... and take differences").

Fig 11b's goal is a fused verify + pending update within 5% of verify alone (`bench kernels`,
`fused_over_verify` <= 1.05). The first runs split the fused kernel's extra time into the flush
store, the factor loads and the FMA chain over the tile, which led to the shipped kernel loading
and applying live rows only, two rows ahead. The variants now: `current` (the
buffer's P rows unrolled); `pow2_rows`, the kernel before stop 39, which unrolled the next power
of two of P (16 for a chain's 9-row buffer); `no_store`, without the flush (wrong on purpose); `live_loop`, a loop of A iterations.

    TRITON_INTERPRET=1 python benchmarks/diagnostics/pending_update.py   # CPU smoke test
    python benchmarks/diagnostics/pending_update.py [--out FILE]          # H200

Each variant is the shipped `specla/ops/gdn/commit.py` and `serial.py` with textual edits,
imported from scratch modules (the serial copy imports `advance_tile` from its own commit
copy); none of them is specla's code. The variants claimed exact must equal the shipped
verifier (outputs and the flushed state) and the script stops if they do not; the others are
wrong on purpose and report their largest difference. Shapes: the paper's (H = HV = 8,
dk = dv = 256), a 5-node chain (`chain=True`) as `bench kernels`' fused section times it,
pending buffers of P = 8, 9 (a chain's or tree's of 8 drafts) and 16 rows with A = 1, 4, 8 accepted, three serial tilings; 24 layers
replayed from one CUDA graph and divided by 24. On CPU (TRITON_INTERPRET=1) it runs every
variant at a tiny shape, does the exactness checks and writes no file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from specla.bench.common import environment, graph_time_ms, load_variant, write_json
from specla.bench.kernels import Bench
from specla.ops.gdn import serial
from specla.topology import chain

ROOT = Path(__file__).resolve().parents[2]
COMMIT_SRC = ROOT / "specla/ops/gdn/commit.py"
SERIAL_SRC = ROOT / "specla/ops/gdn/serial.py"
IMPORT = "from specla.ops.gdn.commit import "  # serial.py's import of advance_tile, redirected per variant

# advance_tile's loop body, without indentation
_BODY = """k2, u2, g2, live2 = _factor_rows(k, g, u, path, b, hv, i_h, p + 2, P, n_live, n_src, o_k, mk, o_v, mv,
                                 H, HV, K, V, HAS_PATH)
if live0:
    S = decay_update(S, tl.exp(g0), k0, u0)
k0, u0, g0, live0 = k1, u1, g1, live1
k1, u1, g1, live1 = k2, u2, g2, live2
"""
_LOOP = "    for p in tl.static_range(PP):\n" + textwrap.indent(_BODY, " " * 8)

# name -> (claimed exact, edits of commit.py, edits of serial.py); every old text must occur once.
# The variants of the first runs (every padded row applied, dead rows loaded, no factor loads,
# no FMA chain) edited code that no longer exists; their timings are in pending_update_81f2b3f.json
# and pending_update_9fe7990.json.
VARIANTS = {
    "current": (True, [], []),
    # before 2026-12-05 (stop 39): the rows unrolled up to the next power of two of the buffer's
    "pow2_rows": (True, [("plen.contiguous(), P, P, True", "plen.contiguous(), P, triton.next_power_of_2(P), True")], []),
    # the flush: the advanced tile is not written back (the scalar length test stays)
    "no_store": (False, [], [("                    tl.store(p_S, S, mask=m_S)\n", "                    pass\n")]),
    # only the accepted rows are visited, in a loop of n_live iterations: exact
    "live_loop": (True, [(_LOOP, _LOOP.replace("tl.static_range(PP)", "range(n_live)"))], []),
}
TILINGS = [{"block_v": 8, "num_warps": 1}, {"block_v": 8, "num_warps": 2}, {"block_v": 16, "num_warps": 4}]


def _edit(src: str, edits, what: str) -> str:
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"{what}: an edit no longer matches its source once: {old.strip()!r}")
        src = src.replace(old, new)
    return src


def build_variants(tmp: Path) -> dict:
    commit_src, serial_src = COMMIT_SRC.read_text(), SERIAL_SRC.read_text()
    out = {}
    for name, (_, commit_edits, serial_edits) in VARIANTS.items():
        # the commit copy is in sys.modules before the serial copy imports from it
        cmod = load_variant(_edit(commit_src, commit_edits, f"variant {name}, commit.py"), f"commit_{name}", tmp)
        src = _edit(serial_src, [(IMPORT, f"from {cmod.__name__} import "), *serial_edits], f"variant {name}, serial.py")
        out[name] = load_variant(src, f"serial_{name}", tmp).gdn_tree_verify
    return out


def _tkey(t: dict) -> str:
    return f"bv{t['block_v']}_w{t['num_warps']}"


def check(variants: dict, x, par, scale, b: Bench, configs, tilings) -> dict:
    """Each variant against the shipped verifier on layer 0: (o, u, flushed state)."""
    worst = {name: 0.0 for name in variants}
    equal = {name: True for name in variants}
    for (P, A), tiling in ((c, t) for c in configs for t in tilings):
        pend = b.pending(P, A, 8)
        S_ref = x[5].clone()
        ref = (*serial.gdn_tree_verify(*x[:5], S_ref, par, scale, pend, chain=True, **tiling), S_ref)
        for name, fn in variants.items():
            S = x[5].clone()
            got = (*fn(*x[:5], S, par, scale, pend, chain=True, **tiling), S)
            equal[name] &= all(torch.equal(g, r) for g, r in zip(got, ref))
            worst[name] = max(worst[name], max(float((g - r).abs().max()) for g, r in zip(got, ref)))
    out = {name: {"claimed_exact": VARIANTS[name][0], "equal": equal[name], "max_abs_diff": worst[name]}
           for name in variants}
    bad = [name for name, r in out.items() if r["claimed_exact"] and not r["equal"]]
    if bad:
        raise SystemExit(f"variants claimed exact differ from the shipped serial verifier: {bad} "
                         f"(max abs diff {[out[n]['max_abs_diff'] for n in bad]})")
    return out


def _print_tables(result: dict) -> None:
    As = sorted({r["A"] for r in result["rows"]})
    for t in result["tilings"]:
        k = _tkey(t)
        ver = result["verify_us"][k]
        print(f"\n{k}: verify alone {ver:.2f} us/layer; cells: us/layer (x verify alone)")
        print(f"{'variant':<10} {'P':>3}" + "".join(f"{'A=' + str(A):>16}" for A in As))
        for name in result["checks"]:
            for P in sorted({r["P"] for r in result["rows"]}):
                cells = {r["A"]: r for r in result["rows"]
                         if r["variant"] == name and r["P"] == P and _tkey(r) == k}
                if cells:
                    print(f"{name:<10} {P:>3}" + "".join(
                        f" {cells[A]['us']:>8.2f} ({cells[A]['over_verify']:.2f})" if A in cells else f"{'':>16}"
                        for A in As))
    best = result["best"]
    print(f"\nbest tiling each (as bench kernels' fused section): verify alone {best['verify_us']:.2f} us/layer "
          f"({best['verify_tiling']})")
    for r in best["rows"]:
        print(f"{r['variant']:<10} P={r['P']:<3} A={r['A']:<2} {r['us']:6.2f} us  x{r['over_verify']:.3f}  ({r['tiling']})")
    print("\nchecks against the shipped verifier:")
    for name, c in result["checks"].items():
        print(f"  {name:<10} claimed exact {c['claimed_exact']!s:<5} equal {c['equal']!s:<5} max abs diff {c['max_abs_diff']:.3g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/pending_update.json"))
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and type(serial.tree_verify_kernel).__name__ != "InterpretedFunction":
        raise SystemExit("on CPU the kernels need TRITON_INTERPRET=1 set before specla is imported")
    dev = torch.device("cuda" if cuda else "cpu")
    b = Bench(dev, 8, 8, 256, 256, 24, torch.bfloat16, False) if cuda else \
        Bench(dev, 2, 2, 16, 16, 2, torch.float32, True)
    scale = b.K ** -0.5
    n = 5  # a 4-draft chain plus its root, as bench kernels' fused section
    par = chain(n, device=dev)
    ins = b.layer_inputs(n, 7)
    # CPU: one tiling with two V-tiles (V = 16), so the tile offsets are exercised
    tilings = TILINGS if cuda else [{"block_v": 8, "num_warps": 1}]
    grid = [(P, A) for P in (8, 9, 16) for A in (1, 4, 8)] if cuda else [(8, 3)]
    # A = 0 (nothing pending, no flush) and A = P (every row live) are the edges of the dead-row rewrites
    check_configs = [(8, 0), *grid, (16, 16)] if cuda else [(8, 0), (8, 3), (9, 4), (9, 9), (16, 16)]
    result = {**environment(), "note": __doc__.split("\n\n")[0].replace("\n", " "),
              "shape": {"H": b.H, "HV": b.HV, "K": b.K, "V": b.V, "layers": b.layers, "chain_nodes": n},
              "timing": "us per layer: CUDA graph of 24 layers, median replay (do_bench) / 24" if cuda
              else "CPU interpreter: one eager call, meaningless",
              "tilings": tilings, "edits": {name: {"commit": e[1], "serial": e[2]} for name, e in VARIANTS.items()}}

    with tempfile.TemporaryDirectory() as d:
        variants = build_variants(Path(d))
        result["checks"] = check(variants, ins[0], par, scale, b, check_configs, tilings)
        us = lambda fn: graph_time_ms(fn, cuda) / b.layers * 1e3  # noqa: E731
        pend = {(P, A): b.pending(P, A, 8) for P, A in grid}
        result["verify_us"], result["rows"] = {}, []
        for tiling in tilings:
            result["verify_us"][_tkey(tiling)] = ver = us(
                lambda: [serial.gdn_tree_verify(*x, par, scale, chain=True, **tiling) for x in ins])
            for (P, A), pd in pend.items():
                for name, fn in variants.items():
                    t = us(lambda: [fn(*x, par, scale, pd, chain=True, **tiling) for x in ins])
                    result["rows"].append({"variant": name, "P": P, "PP": 1 << (P - 1).bit_length(), "A": A,
                                           **tiling, "us": t, "over_verify": t / ver})

    vbest = min(tilings, key=lambda t: result["verify_us"][_tkey(t)])
    best_rows = []
    for name in variants:
        for P, A in grid:
            r = min((r for r in result["rows"] if r["variant"] == name and r["P"] == P and r["A"] == A),
                    key=lambda r: r["us"])
            best_rows.append({"variant": name, "P": P, "A": A, "us": r["us"], "tiling": _tkey(r),
                              "over_verify": r["us"] / result["verify_us"][_tkey(vbest)]})
    result["best"] = {"verify_us": result["verify_us"][_tkey(vbest)], "verify_tiling": _tkey(vbest), "rows": best_rows}
    _print_tables(result)
    if cuda:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
