"""Does a position's arithmetic depend on how many rows its call has? Where, on the fused path?

Exact mode (docs/exact.md) makes every route emit AR's tokens in bf16 by running every target
call at one width (17 rows): a GEMM over 1 row and over 17 rounds differently, and so might
the compiled glue. Its AR step is then a 17-node round, 1.4× the plain step. If every kernel
computed each row the same way whatever the row count, each route could verify at its own
width (AR 1, chain 9, tree 17) and still be bitwise equal. This script asks, on the GPU, where
the bits of a row change with the width:

1. matmuls of the model's weight shapes: row i of an n-row product against the 1-row product
   of row i, for cuBLAS (`F.linear`), specla's batch-1 kernels (`ops.skinny_linear`: GEMV for
   one row, skinny GEMM for more) and `ops.invariant_linear`, with their times;
2. the GDN pieces: `ops.step_prelude` (an AR step's conv and factors) against row 0 of
   `ops.tree_prelude`, and `ops.gdn_sequence` against row 0 of `ops.gdn_tree_verify` (outputs
   and the state after one committed node);
3. the whole target, plain and fused with each `gemv` option: the AR step's logits and every
   layer's hidden state against row 0 of a verify at widths 1, 9 and 17 (chain; a 17-node tree
   under `ops.exact_arithmetic`), and the GDN and conv states after committing that row.

    python benchmarks/diagnostics/row_invariance.py [--model DIR | --shape NAME] [--out FILE]

--shape: a named shape with random weights (`specla.shapes`), e.g. gdn-1.3b-paper, where
`bench agreement` found chains and AR apart after the prelude fix (agreement_d5c425d.json).

On CPU it runs everything once in fp32 (a smoke test of the script; CPU kernels are another
question, docs/exact.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from specla import ops
from specla.fused import fuse
from specla.bench.common import environment, graph_time_ms, write_json
from specla.checkpoint import load_model
from specla.shapes import random_model
from specla.topology import chain

WIDTHS = (2, 5, 9, 17)


def same(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    return {"equal": bool(torch.equal(a, b)), "max_abs": float((a - b).abs().max()) if a.numel() else 0.0}


def rows_check(fn, x: torch.Tensor, w: torch.Tensor) -> dict:
    """Per width n: is every row of fn(x[:n]) equal to fn of that row alone?"""
    alone = torch.cat([fn(x[i:i + 1], w) for i in range(x.shape[0])])
    out = {}
    for n in WIDTHS:
        out[n] = same(fn(x[:n], w), alone[:n])
    return out


def matmuls(model, cuda: bool) -> list[dict]:
    kernels = {"cublas": F.linear, "skinny_linear": ops.skinny_linear, "invariant": ops.invariant_linear}
    blk = model.layers[0]
    weights = {"in_proj": blk.mixer.in_proj.weight, "o_proj": blk.mixer.o_proj.weight,
               "gate_up": blk.mlp.gate_up_weight(), "down": blk.mlp.down_proj.weight,
               "lm_head": model.lm_head.weight}
    g = torch.Generator(device=model.device).manual_seed(0)
    rows = []
    for name, w in weights.items():
        x = torch.randn(max(WIDTHS), w.shape[1], device=model.device, generator=g).to(w.dtype)
        for kname, fn in kernels.items():
            row = {"matmul": name, "N": w.shape[0], "K": w.shape[1], "kernel": kname,
                   "rows": {str(n): v for n, v in rows_check(fn, x, w).items()}}
            for n in (1, 9, 17):
                row[f"us_{n}"] = graph_time_ms(lambda: [fn(x[:n], w) for _ in range(20)], cuda) * 1e3 / 20
            if kname == "invariant":
                row["tilings"] = invariant_tilings(x, w, cuda)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("rows", "tilings")}),
                  {n: v["equal"] for n, v in row["rows"].items()}, flush=True)
    return rows


def invariant_tilings(x: torch.Tensor, w: torch.Tensor, cuda: bool) -> list[dict]:
    """The invariant product at every skinny tiling (32-row blocks): µs at 1 and 17 rows and
    whether 17 rows still give each row its one-row bits. One tiling serves every row count, so
    the one to pick minimises the slower of the two."""
    from specla.ops.linear import triton as linear_triton

    out = []
    for _, bn, bk, warps in linear_triton.SKINNY_TILINGS:
        t = {"block_n": bn, "block_k": bk, "num_warps": warps}
        fn = lambda a, b: linear_triton.skinny(a, b, block_m=32, **t)  # noqa: E731
        alone = torch.cat([fn(x[i:i + 1], w) for i in range(17)])
        out.append({**t, "rows_equal_17": bool(torch.equal(fn(x[:17], w), alone)),
                    **{f"us_{n}": graph_time_ms(lambda: [fn(x[:n], w) for _ in range(20)], cuda) * 1e3 / 20
                       for n in (1, 17)}})
    best = min(out, key=lambda r: max(r["us_1"], r["us_17"]))
    print("  invariant tilings:", ", ".join(f"{r['block_n']}/{r['block_k']}/w{r['num_warps']}: "
                                             f"{r['us_1']:.1f}/{r['us_17']:.1f} us" for r in out), "best", best, flush=True)
    return out


def gdn_pieces(model) -> dict:
    """The GDN layer's own kernels at one row and as row 0 of a 9-node chain."""
    mix = model.layers[0].mixer
    dev, n = model.device, 9
    g = torch.Generator(device=dev).manual_seed(1)
    C = sum(mix.split[:3])
    xp = torch.randn(1, n, C, device=dev, generator=g).to(model.dtype)
    a = torch.randn(1, n, mix.split[4], device=dev, generator=g).to(model.dtype)
    b = torch.randn(1, n, mix.split[5], device=dev, generator=g).to(model.dtype)
    st = mix.new_state(1, dev, model.dtype)
    if st.conv is not None:
        st.conv.copy_(torch.randn(st.conv.shape, device=dev, generator=g))
    st.S.copy_(torch.randn(st.S.shape, device=dev, generator=g) * 0.1)
    args = (mix.conv_weight, mix.conv_bias) if st.conv is not None else (None, None)
    consts = (mix.A_log, mix.dt_bias, mix.H, mix.K, bool(mix.cfg.allow_neg_eigval), st.S.dtype)
    par = chain(n, device=dev)
    out = {}
    if st.conv is not None:
        conv1 = st.conv.clone()
        step = ops.step_prelude(xp[:, :1], conv1, *args, a[:, :1], b[:, :1], *consts)
        tree = ops.tree_prelude(xp, st.conv.clone(), *args, par, a, b, *consts)
        out["prelude"] = {name: same(s, t[:, :1]) for name, s, t in zip("qkvgb", step, tree)}
    else:
        step = tree = None
    q, k, v, gg, beta = (t[:, :1] for t in tree) if tree is not None else (None,) * 5
    if q is not None:
        S_seq = st.S.clone()
        o_seq = ops.gdn_sequence(q, k, v, gg, beta, S_seq, mix.scale)
        S_ver = st.S.clone()
        qn, kn, vn, gn, bn = tree
        o_ver, u = ops.gdn_tree_verify(qn, kn, vn, gn, bn, S_ver, par, mix.scale, None, True, None)
        ops.gdn_commit(S_ver, kn, gn, u, torch.zeros(1, n, dtype=torch.long, device=dev),
                       torch.ones(1, dtype=torch.long, device=dev))
        out["gdn_output"] = same(o_seq, o_ver[:, :1])
        out["gdn_state_after_one"] = same(S_seq, S_ver)
    return out


def whole_model(model, prompt: torch.Tensor, tree_parents: torch.Tensor) -> dict:
    """AR step against row 0 of verifies of several widths, from one prefilled state."""
    L = len(model.layers)
    cap = tuple(range(L))
    cache = model.new_cache(1, 1024)
    model.forward(prompt[:, :-1], cache)
    root = prompt[:, -1:]
    g = torch.Generator(device=model.device).manual_seed(2)
    draft = torch.randint(0, model.cfg.vocab_size, (1, 16), device=model.device, generator=g)

    ar_cache = cache.clone()
    ar = model.forward(root, ar_cache, cap)
    res, outs = {}, {}
    cases = [("verify1", 1, None), ("chain9", 9, None), ("chain17", 17, None), ("tree17", 17, tree_parents)]
    for name, n, parents in cases:
        c = cache.clone()
        tokens = torch.cat([root, draft[:, :n - 1]], 1)
        is_chain = parents is None
        par = chain(n, device=model.device) if is_chain else parents
        with ops.exact_arithmetic(not is_chain):
            out = model.verify(tokens, par, c, cap, chain=is_chain)
        c.commit(out.records, torch.zeros(1, n, dtype=torch.long, device=model.device),
                 torch.ones(1, dtype=torch.long, device=model.device))
        c.flush()
        outs[name] = out
        first = next((i for i in range(L) if not torch.equal(out.hidden[i][:, :1], ar.hidden[i])), None)
        states = [s for s in range(L) if hasattr(c.layers[s], "S")]
        res[name] = {"logits": same(out.logits[:, :1], ar.logits), "first_layer_differing": first,
                     "S_equal": all(torch.equal(c.layers[s].S, ar_cache.layers[s].S) for s in states),
                     "conv_equal": all(c.layers[s].conv is None or torch.equal(c.layers[s].conv, ar_cache.layers[s].conv)
                                       for s in states),
                     "argmax_equal": bool(out.logits[0, 0].argmax() == ar.logits[0, 0].argmax())}
    # widths against each other: the first m rows of a wider chain verify against a narrower one
    for wide, narrow, m in (("chain9", "verify1", 1), ("chain17", "chain9", 9)):
        w, nw = outs[wide], outs[narrow]
        res[f"{wide}_vs_{narrow}"] = {
            "logits": same(w.logits[:, :m], nw.logits[:, :m]),
            "first_layer_differing": next((i for i in range(L) if not torch.equal(w.hidden[i][:, :m], nw.hidden[i][:, :m])),
                                          None)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "specla/models/demo"))
    ap.add_argument("--shape", default=None, help="a named shape with random weights instead of --model")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/row_invariance.json"))
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.shape:
        model = random_model(args.shape if cuda else "tiny", device=dev, dtype=dtype)
    else:
        model = load_model(args.model, device=dev, dtype=dtype)
    result = {**environment(), "note": __doc__.split("\n\n")[0], "model": args.shape or args.model,
              "dtype": str(model.dtype)}
    result["matmuls"] = matmuls(model, cuda)
    result["gdn"] = gdn_pieces(model)
    print("gdn", json.dumps(result["gdn"]), flush=True)

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=g).to(dev)
    tree = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 2, 2, 5, 5, 7, 9, 9, 11, 12, 14]], device=dev)
    result["model_runs"] = {}
    options = [("plain", None)] + ([(f"fused_{g}", g) for g in ("cublas", "triton", "invariant")] if cuda else
                                   [("fused_invariant_eager", "invariant")])
    for name, gemv in options:
        if gemv is None:
            fuse(model, False)
        else:
            fuse(model, mode="default", gemv=gemv, compile=cuda)
        result["model_runs"][name] = whole_model(model, prompt, tree)
        print(name, json.dumps(result["model_runs"][name]), flush=True)
    fuse(model, False)
    if cuda:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
