"""Which draft-tree shape pays on the demo pair: trees of other depths, budgets and widths
against the 8-token chain, timed in one process on the same prompts (the first N of each
e2e suite), greedy, 128 new tokens, CUDA graphs as `bench e2e` runs them; shapes that differ
only in generate() options take turns prompt by prompt, as `bench e2e`'s routes do.

A tree round costs ~1.2x a chain round on the GPU (rounds_81f2b3f: 0.90 against 0.73 ms; the
host issues both well ahead of the GPU, host_time_d18c594) while it accepts only 1.07-1.12x
as many tokens (e2e_e7ca6a9), so the default tree (top-4, depth 8, 16 nodes) about ties the
chain. A shallower rollout costs fewer drafter forwards a round, a smaller budget a cheaper
verify; this measures what each does to tokens a round and ms a token. A narrow tree (width
1: one beam a depth, its runners-up as leaves) drafts with a chain's forwards. With --profile,
one more generation per shape (the first prompt) runs under torch.profiler: kernels and GPU
busy time a round, the top kernels.

    SPECLA_COMPILE=1 python benchmarks/diagnostics/tree_shapes.py [--n-prompts 40] [--out FILE]
    python benchmarks/diagnostics/tree_shapes.py --replot FILE.json   # the PNG of a run again

With --out, the PNG beside the JSON: each shape's speed over AR against its tokens a round.
"""

from __future__ import annotations

import argparse
import json
import re

import specla.api as api
from specla import graphs, ops
from specla.bench.common import environment, warm_set
from specla.bench.e2e import bootstrap_ratio
from specla.data.suites import load_gsm8k_train, load_suite
from specla.ops.beam import triton as beam_triton
from specla.ops.gdn import paths as gdn_paths
from specla.train.drafter import held_out_gsm8k

# plain shapes are read from their names (`shape_options`): chainL (L-token chains) and
# tree-kK[-wW]-dD-nN[-tT] (top-k K, width W (default K), depth D, N nodes, temperature T)
DEFAULT = ("ar,chain8,chain10,chain12,tree-k4-d8-n16,tree-k4-d10-n16,tree-k4-d12-n16,tree-k4-d8-n15,"
           "tree-k4-w1-d8-n16,tree-k4-w2-d8-n16")
SPECIAL = {  # name -> generate() options, for what a name cannot say
    # verified by the serial pass or the parallel (UT-form) kernel instead of the dispatch's
    # choice (the path-parallel one for the demo's 16-node trees)
    "tree-k4-d8-n16-parallel": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, tree_verifier="parallel"),
    "tree-k4-d8-n16-serial": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, tree_verifier="serial"),
    # the drafter's step with its norms, gate and residual adds as separate kernels
    # (SPECLA_DRAFT_FUSED=torch), as before `ops.fused_linear`
    "chain8-unfused": dict(route="chain", chain_length=8, draft_fused="torch"),
    "tree-k4-d8-n16-unfused": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, draft_fused="torch"),
    # a depth's norm and LM head on the modules, then `beam_expand` (SPECLA_HEAD_EXPAND=modules),
    # as before `ops.head_expand`
    "tree-k4-d8-n16-modhead": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, head_expand="modules"),
    # `head_expand` with 32 / 128 vocabulary tokens a program instead of HEAD_CHUNK (64)
    "tree-k4-d8-n16-hc32": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, head_chunk=32),
    "tree-k4-d8-n16-hc128": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, head_chunk=128),
    # `head_expand` with its dot's operands widened to fp32 (HEAD_DOT = "fp32", the default until b964ef6)
    "tree-k4-d8-n16-fp32dot": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, head_dot="fp32"),
    # every path row's program takes its tile before the PDL wait (paths.EARLY as before 2026-12-07)
    "tree-k4-d8-n16-allearly": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, paths_early=1 << 30),
    # the depth step traced (SPECLA_BEAM_EXPAND=torch) instead of the two-launch op
    "tree-k4-w1-d8-n16-traced": dict(route="tree", tree_topk=4, tree_depth=8, tree_budget=16, tree_width=1,
                                     beam_expand="torch"),
}
HEAD_CHUNK, HEAD_DOT = beam_triton.HEAD_CHUNK, beam_triton.HEAD_DOT
PATHS_EARLY = gdn_paths.EARLY
CHAIN = re.compile(r"chain(\d+)")
TREE = re.compile(r"tree-k(\d+)(?:-w(\d+))?-d(\d+)(?:to(\d+))?-n(\d+)(?:-t([0-9.]+))?")
# the options of a SPECIAL shape that set module switches rather than generate() arguments, and
# the switches' values for a shape that does not name them
SWITCHES = {"beam_expand": "auto", "draft_fused": "auto", "head_expand": "auto", "head_chunk": HEAD_CHUNK,
            "head_dot": HEAD_DOT, "tree_verifier": "auto", "paths_early": PATHS_EARLY}


def shape_options(name: str) -> dict:
    """generate() options of a shape name (`SPECIAL`, `CHAIN`, `TREE`, or "ar")."""
    if name == "ar":
        return dict(route="ar")
    if name in SPECIAL:
        return dict(SPECIAL[name])
    if m := CHAIN.fullmatch(name):
        return dict(route="chain", chain_length=int(m[1]))
    if m := TREE.fullmatch(name):
        # dAtoB: each round's depth A or B by the last report read (`tree.DepthPolicy`)
        depth = (int(m[3]), int(m[4])) if m[4] else int(m[3])
        kw = dict(route="tree", tree_topk=int(m[1]), tree_depth=depth, tree_budget=int(m[5]))
        if m[2]:
            kw["tree_width"] = int(m[2])
        if m[6]:
            kw["tree_temperature"] = float(m[6])
        return kw
    raise SystemExit(f"unknown shape {name!r}: ar, chainL, tree-kK[-wW]-dD[toD2]-nN[-tT] or one of {', '.join(SPECIAL)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-prompts", type=int, default=40, help="first N prompts of each suite")
    ap.add_argument("--held-out", type=int, default=None,
                    help="N GSM8K training questions the drafter's data left out, instead of the suites' "
                         "prompts (`held_out_gsm8k`): to choose a shape on prompts no evaluation holds")
    ap.add_argument("--shapes", default=DEFAULT, help="comma-separated shape names (`shape_options`)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="profile one more generation per shape")
    ap.add_argument("--replot", default=None, help="draw the PNG of an earlier run's JSON and stop")
    a = ap.parse_args()
    if a.replot:
        return plot(json.load(open(a.replot))["rows"], a.replot.removesuffix(".json") + ".png")
    shapes = {name: shape_options(name) for name in a.shapes.split(",")}  # every name checked before anything loads

    lm = api.load()
    if a.held_out:
        questions = load_gsm8k_train()
        prompts = [("held-out", i, questions[q]["question"]) for i, q in enumerate(held_out_gsm8k()[:a.held_out])]
    else:
        prompts = [(s, i, p.turns[0]) for s in ("mixed", "gsm8k", "humaneval")
                   for i, p in enumerate(load_suite(s, limit=a.n_prompts))]
    warm = warm_set(((len(lm.encode_prompt(p)), p) for _, _, p in prompts), a.max_new_tokens)
    rows, records = [], {}
    # plain shapes take turns prompt by prompt, as `bench e2e`'s routes do, so a drift of the
    # clocks over the run falls on each alike (one after another, rows of one code differed by 5%,
    # tree_shapes_b964ef6_profile_h100.json); a shape that sets module switches runs on its own
    plain = {name: kw for name, kw in shapes.items() if not SWITCHES & kw.keys()}
    groups = ([plain] if plain else []) + [{name: kw} for name, kw in shapes.items() if name not in plain]
    for group in groups:
        options = {name: switch(lm, kw) for name, kw in group.items()}  # a group's switches are one set
        lm._drafters.clear()  # fresh drafters: the same options may trace another step under new switches
        for kw in options.values():
            for text in warm:  # compile, capture every attention window's graphs
                lm.generate(text, max_new_tokens=a.max_new_tokens, **kw)
        captures = dict.fromkeys(group, 0)  # graphs captured inside the timed generations
        for name in group:
            records[name] = {}
        for s, i, p in prompts:
            for name, kw in options.items():
                before = graphs.captured()
                g = lm.generate(p, max_new_tokens=a.max_new_tokens, **kw)
                captures[name] += graphs.captured() - before
                records[name][s, i] = (g.decode_seconds, len(g.tokens), g.rounds, g.tokens)
        for name, kw in options.items():
            row = summary_row(name, kw, ops.TREE_VERIFIER, records, captures[name])
            if a.profile:
                row["profile"] = profile(lm, prompts[0][2], a.max_new_tokens, kw)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}))
        if a.out:  # after every group: a run cut by its time limit keeps the shapes it finished
            save(a, rows)
    print(f"\n{'shape':18s} {'ms/tok':>7s} {'tok/round':>9s} {'ms/round':>8s} {'x ar':>6s} {'x chain8':>18s} {'=ar':>5s} "
          f"{'=chain8':>7s} {'captures':>8s}")
    ran_ar = any(r["shape"] == "ar" for r in rows)
    for r in rows:
        ci = r.get("over_chain8_ci")
        # a shape's own reference reads 1; a reference that did not run, "-"
        over_ar = f"{r['over_ar']:6.3f}" if "over_ar" in r else f"{1.0 if r['shape'] == 'ar' else '-':>6}"
        equal_ar = f"{r['equal_ar']:5.2f}" if "equal_ar" in r else f"{1.0 if r['shape'] == 'ar' else '-':>5}"
        # outputs equal to the chain's, which equal AR's wherever AR ran (so where it did not)
        equal_chain = f"{r['equal_chain8']:7.2f}" if "equal_chain8" in r else f"{'-':>7}"
        print(f"{r['shape']:18s} {r['ms_per_token']:7.4f} {r['tokens_per_round']:9.2f} {r['ms_per_round']:8.3f} "
              f"{over_ar} {r.get('over_chain8', float('nan')):6.3f}"
              f"{f' [{ci[0]:.3f}, {ci[1]:.3f}]' if ci else '':>12s} {equal_ar} {equal_chain} {r['timed_captures']:8d}")
    if not ran_ar:
        print("(AR did not run: no speed over AR)")
    if a.out:
        plot(rows, a.out.removesuffix(".json") + ".png")


def switch(lm, kw: dict) -> dict:
    """Set the module switches a shape names (`SWITCHES`' values for those it does not) and
    return its generate() options; a new verifier or path split drops the captured round graphs."""
    kw = dict(kw)
    on = {key: kw.pop(key, default) for key, default in SWITCHES.items()}
    ops.BEAM_EXPAND, ops.DRAFT_FUSED = on["beam_expand"], on["draft_fused"]  # read when the rollout is traced
    ops.HEAD_EXPAND = on["head_expand"]
    beam_triton.HEAD_CHUNK, beam_triton.HEAD_DOT = on["head_chunk"], on["head_dot"]
    if (on["tree_verifier"], on["paths_early"]) != (ops.TREE_VERIFIER, gdn_paths.EARLY):  # read when the
        ops.TREE_VERIFIER, gdn_paths.EARLY = on["tree_verifier"], on["paths_early"]  # target's round is
        lm._targets.clear()  # captured: new round graphs
    return kw


def summary_row(name: str, kw: dict, verifier: str, records: dict, captures: int) -> dict:
    """A shape's row: ms a token and a round, tokens a round, and its speed over `ar` and
    `chain8` (paired by prompt, with a bootstrap interval) where they ran."""
    rec = records[name]
    secs = sum(r[0] for r in rec.values())
    toks = sum(r[1] for r in rec.values())
    rounds = sum(r[2] for r in rec.values())
    row = {"shape": name, **kw, "tree_verifier": verifier, "prompts": len(rec), "ms_per_token": 1e3 * secs / toks,
           "tokens_per_round": toks / rounds, "ms_per_round": 1e3 * secs / rounds, "timed_captures": captures}
    for ref in ("ar", "chain8"):
        if ref in records and ref != name:
            keys = sorted(rec)
            # speed over ref: ref's time over this shape's, paired by prompt (same tokens emitted)
            num, den = [records[ref][k][0] for k in keys], [rec[k][0] for k in keys]
            row[f"over_{ref}"] = sum(num) / sum(den)
            row[f"over_{ref}_ci"] = bootstrap_ratio(num, den)
            row[f"equal_{ref}"] = sum(rec[k][3] == records[ref][k][3] for k in keys) / len(keys)
    return row


def save(a, rows: list[dict]) -> None:
    with open(a.out, "w") as f:
        json.dump({**environment(), "n_prompts_per_suite": a.n_prompts,
                   "prompts": f"held-out GSM8K training questions {held_out_gsm8k()[:a.held_out]}" if a.held_out
                   else "the first n_prompts_per_suite of mixed, gsm8k, humaneval", "max_new_tokens": a.max_new_tokens,
                   "rows": rows}, f, indent=1)


def profile(lm, prompt, max_new_tokens: int, kw: dict) -> dict:
    """One generation under torch.profiler: kernels and GPU busy time a round, the top kernels."""
    from specla.bench.decode import profile_fn

    g = {}

    def once():
        g["r"] = lm.generate(prompt, max_new_tokens=max_new_tokens, **kw)

    prof = profile_fn(once, 1, lm.model.device, top=250)
    n = g["r"].rounds
    return {"rounds": n, "kernels_per_round": prof["kernels_per_step"] / n,
            "gpu_busy_ms_per_round": prof["gpu_us_per_step"] / n / 1e3,
            "top": [dict(t, us_per_round=t["us_per_step"] / n) for t in prof["top"]]}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # speed over AR, or over the chain when AR did not run
    ref = "ar" if any("over_ar" in r for r in rows) else "chain8"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        if f"over_{ref}" not in r:
            continue  # the reference itself
        v, ci = r[f"over_{ref}"], r[f"over_{ref}_ci"]
        ax.errorbar(r["tokens_per_round"], v, yerr=[[v - ci[0]], [ci[1] - v]],
                    fmt="o", capsize=3, label=f"{r['shape']}: {r['ms_per_round']:.3f} ms a round")
    ax.set_xlabel("tokens a round (τ)")
    ax.set_ylabel(f"speed over {'AR' if ref == 'ar' else 'the 8-token chain'} (95% interval)")
    ax.legend(fontsize=8)
    ax.set_title("Draft shapes on the demo pair (same prompts, one run)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
