"""Which draft nodes a tree should keep: selection policies replayed offline on the demo pair.

A greedy round's outcome depends only on where it starts: every accepted token is AR's, so the
drafter's state after consuming x_0..x_t is the same whatever rounds led there. This runs AR
once per prompt, then the drafter's full beam rollout (top-4, width 4, depth 12 unless asked) at *every*
position of the continuation (teacher-forced: extend one token, roll out, extend the next),
and labels each pool node correct when its path spells AR's next tokens. A selection policy is
then a function from a pool to kept nodes, and its tokens a round come from replaying the
decode loop over the stored pools (a round at t keeps nodes, accepts the correct ones among
them, emits one token more and moves on) — seconds a policy instead of a decode run each.

Policies (each keeps at most BUDGET nodes, ancestor-closed, up to DEPTH):
- `q@T`: the route's rule (`drafters.tree.build`): the best nodes by the cumulative tempered
  log-probability q at temperature T;
- `calibrated`: the best nodes by the product of fitted per-node acceptance probabilities
  P(v correct | its parent correct), a logistic model of the node's own tempered log-probability,
  its rank among its siblings, its depth and its parent's log-probability, fitted on the first
  half of the prompts and scored on the second (and the reverse: every prompt is scored by a
  model that never saw it);
- `q + b*depth`: the route's q with a bonus (b > 0) or penalty per depth;
- `oracle`: everything the rollout proposed up to DEPTH (no budget): the bound any selection of
  this rollout has.

The route's rule replayed this way gives exactly the tokens a round of decode runs on the same
prompts (60 held-out GSM8K training questions: 6.646 / 7.330 / 7.718 at depth 8 / 10 / 12, as
`tree_temperature_0a05543_cpu.json` and `tree_depths_59647fb_cpu.json` measured by decoding).
What it found (`tree_policy_*_cpu.json`): the fitted acceptance model keeps worse nodes (6.60 /
7.22 / 7.53), and so does any bonus or penalty for depth on q; and at depth 8 even every node
the rollout proposes (116) would accept 7.35 tokens a round, 1.27x the 8-token chain's 5.78 —
selection cannot reach the drafter issue's 1.3x there; depth 12 does (7.72 with the route's own
rule, 1.34x). Wider rollouts (--topk 8, --width 8; `tree_width_56692d7_cpu.json`) raise that
bound (7.73 at depth 8) but not what 16 nodes chosen by q accept (6.64-6.65). `--adaptive`
replays a depth chosen each round from an earlier round's report (`tree_adaptive_*_cpu.json`:
depth 10 after a round that accepted >= 7, else 6, read two rounds late as the pipelined loop
would, accepts 6.92 tokens a round at an estimated 3.8% less time a token than depth 8). CPU, fp32:

    python benchmarks/diagnostics/tree_policy.py [--n-prompts 60] [--topk 4 --width 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

import specla.api as api
from specla.bench.common import environment
from specla.data.suites import load_gsm8k_train
from specla.decode import Decoder
from specla.drafters import tree
from specla.drafters.eagle import EagleDrafter, find_drafter, load_drafter
from specla.train.drafter import held_out_gsm8k

T_ROLL = 0.5


def pools_of(lm, drafter: EagleDrafter, ids: list[int], new: int):
    """For every round start t of AR's continuation of ids up to `new` tokens or its EOS (x_0..x_t
    consumed, the root x_t+1 known), the rollout's pool: (tokens [P], parents [P], q [P],
    correct [P] bool); one pool a token generated."""
    model = lm.model
    cont = Decoder(model).run(torch.tensor([ids]), new + drafter.depth + 1)[0][0]
    eos = lm.tokenizer.eos_token_ids | set(model.cfg.eos_token_id)
    # generation stops at the end of the answer, as the decode loop does (the EOS token counts)
    new = next((i + 1 for i, x in enumerate(cont[:new]) if x in eos), new)
    seq = torch.tensor([ids + cont])
    T = len(ids)
    out = model(seq, model.new_cache(1), drafter.capture)
    drafter.reset(1)
    drafter.extend(seq[:, :T - 1], {i: h[:, :T - 1] for i, h in out.hidden.items()}, torch.tensor([T - 1]))
    pools = []
    k, w, D = drafter.topk, drafter.width, drafter.depth
    depth = tree.pool_depths(k + (D - 1) * w * k, k, w, "cpu")[0]
    for t in range(T - 2, T - 2 + new):
        tok, par, q = (x[0] for x in drafter.pool(seq[:, t + 1]))
        want = seq[0, t + 2:t + 2 + D]
        tl, pl, wl, dl = tok.tolist(), par.tolist(), want.tolist(), depth.tolist()
        ok: list[bool] = []
        for i in range(len(tl)):  # parents come first: a node is correct when its parent is
            ok.append(tl[i] == wl[dl[i] - 1] and (pl[i] < 0 or ok[pl[i]]))
        pools.append((tok, par, q.float(), torch.tensor(ok)))
        drafter.extend(seq[:, t + 1:t + 2], {i: h[:, t + 1:t + 2] for i, h in out.hidden.items()}, torch.tensor([1]))
    return pools


def replay(pools, keep) -> tuple[int, int]:
    """(tokens, rounds) of the decode loop over the stored pools with selection `keep(pool)`
    -> kept indices; a round accepts the kept correct nodes (a path) and emits one more."""
    tokens, depths = replay_adaptive(pools, lambda pool, D: keep(pool), lambda report: None, 1)
    return tokens, len(depths)


def replay_adaptive(pools, keep_at, choose, lag: int) -> tuple[int, list]:
    """(tokens, each round's depth) of the decode loop when a round's depth is `choose(report)`
    and its selection `keep_at(pool, depth)`, report = (accepted, depth) of the round `lag`
    rounds before (None at the start): the pipelined loop reads a round's report while the
    next one runs, so it decides with lag 2."""
    new = len(pools)
    t = tokens = 0
    hist: list[tuple] = []
    while tokens < new:
        D = choose(hist[-lag] if len(hist) >= lag else None)
        kept = keep_at(pools[t], D)
        a = int(pools[t][3][kept].sum()) if len(kept) else 0  # the correct nodes form one path
        tokens += a + 1
        hist.append((a, D))
        t += a + 1
        if t >= len(pools):
            break
    return min(tokens, new), [d for _, d in hist]


def by_score(score: torch.Tensor, par: torch.Tensor, depth: torch.Tensor, budget: int, max_depth: int):
    """The `budget` best nodes by score among those up to max_depth, each with its ancestors
    (`tree.select`, no window)."""
    live = depth <= max_depth
    idx = torch.nonzero(live)[:, 0]
    s = score[idx].tolist()
    p = [int(x) for x in par[idx].tolist()]  # the pool's prefix: parent indices stay valid
    return idx[torch.tensor(tree.select(s, p, budget), dtype=torch.long)] if s else idx


def features(q: torch.Tensor, par: torch.Tensor, depth: torch.Tensor, topk: int) -> torch.Tensor:
    """Per node: its own tempered log-probability, its rank among its siblings (one-hot), its
    depth, and its parent's own log-probability (0 at the root's children)."""
    up = par.clamp(min=0)
    own = q - torch.where(par >= 0, q[up], 0.0)
    parent_own = torch.where(par >= 0, own[up], 0.0)
    rank = torch.nn.functional.one_hot(torch.arange(q.shape[0]) % topk, topk).float()
    return torch.cat([own[:, None], rank, depth[:, None].float() / int(depth.max()), parent_own[:, None]], 1)


def fit(pools, depth: torch.Tensor, max_depth: int, topk: int) -> torch.nn.Module:
    """Logistic P(correct | parent correct) over the pools' nodes whose parent is correct."""
    X, y = [], []
    for tok, par, q, correct in (p for prompt in pools for p in prompt):
        parent_ok = torch.where(par >= 0, correct[par.clamp(min=0)], torch.ones_like(correct))
        m = parent_ok & (depth <= max_depth)
        X.append(features(q, par, depth, topk)[m])
        y.append(correct[m].float())
    X, y = torch.cat(X), torch.cat(y)
    lin = torch.nn.Linear(X.shape[1], 1, dtype=torch.float32)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=200)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(lin(X)[:, 0], y)
        loss.backward()
        return loss

    opt.step(closure)
    return lin


def calibrated_keep(lin, depth, budget, max_depth, topk):
    def keep(pool):
        tok, par, q, correct = pool
        with torch.no_grad():
            logp = torch.nn.functional.logsigmoid(lin(features(q, par, depth, topk))[:, 0])
        path = logp.clone()
        for i in range(path.shape[0]):  # parents first
            if par[i] >= 0:
                path[i] = path[i] + path[par[i]]
        return by_score(path, par, depth, budget, max_depth)
    return keep


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-prompts", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depths", default="8,10,12")
    ap.add_argument("--smaller-budgets", default="12,14,15",
                    help="the route's rule at these node budgets too (comma-separated; '' for none)")
    ap.add_argument("--depth-bonus", default="-0.5,-0.25,0.25,0.5",
                    help="also rank by q + b*depth for each b (comma-separated; '' for none)")
    ap.add_argument("--pools", default=None, help="a .pt file: load the pools from it when it exists, else "
                    "save them there (the rollouts are most of the time; the policies take seconds)")
    ap.add_argument("--topk", type=int, default=4, help="children a beam proposes a depth")
    ap.add_argument("--width", type=int, default=4, help="beams kept a depth (<= topk)")
    ap.add_argument("--rollout-depth", type=int, default=12, help="the rollout's depth (>= every --depths)")
    ap.add_argument("--no-calibrated", action="store_true", help="skip the fitted acceptance model")
    ap.add_argument("--adaptive", default="",
                    help="also choose each round's depth from the report `lag` rounds before: LO/HI/A/LAG items "
                         "(comma-separated) take depth HI after a round that accepted >= min(A, its depth) "
                         "tokens, else LO; rows add ms_per_token under --depth-cost")
    ap.add_argument("--depth-cost", default="0.749,0.040",
                    help="a round's ms at depth 8 and per depth more or less (H100, b964ef6: 0.755 ms busy "
                         "at depth 8, 0.858 at 10), for --adaptive and the fixed depths")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    TOPK, WIDTH, DEPTH = a.topk, a.width, a.rollout_depth

    lm = api.load(device="cpu", dtype="float32")
    drafter = EagleDrafter(load_drafter(find_drafter(lm.model_dir), lm.model), lm.model, topk=TOPK, depth=DEPTH,
                           width=WIDTH, temperature=T_ROLL)
    questions = load_gsm8k_train()
    picked = held_out_gsm8k()[:a.n_prompts]
    if a.pools and Path(a.pools).is_file():
        all_pools = torch.load(a.pools)[:a.n_prompts]
    else:
        all_pools = []
        for i in tqdm(picked, desc="rollouts", unit="prompt"):
            ids = lm.encode_prompt([{"role": "user", "content": questions[i]["question"]}])
            all_pools.append(pools_of(lm, drafter, ids, a.max_new_tokens))
        if a.pools:
            torch.save(all_pools, a.pools)
    P = all_pools[0][0][0].shape[0]
    depth = tree.pool_depths(P, TOPK, WIDTH, "cpu")[0]
    half = len(all_pools) // 2
    folds = (all_pools[:half], all_pools[half:])
    rows = []

    def run(name, keeps, **kw):
        """keeps: one selection per fold (the calibrated model is fitted on the other fold)."""
        tokens = rounds = 0
        for fold, keep in zip(folds, keeps):
            for pools in fold:
                tk, r = replay(pools, keep)
                tokens, rounds = tokens + tk, rounds + r
        rows.append({"policy": name, **kw, "tokens_per_round": tokens / rounds})
        print(json.dumps(rows[-1]), flush=True)

    for D in (int(x) for x in a.depths.split(",")):
        k = (lambda pool, D=D: by_score(pool[2], pool[1], depth, a.budget, D))
        run(f"q@{T_ROLL}", (k, k), depth=D, budget=a.budget)
        for n in (int(x) for x in a.smaller_budgets.split(",") if x):
            k = (lambda pool, D=D, n=n: by_score(pool[2], pool[1], depth, n, D))
            run(f"q@{T_ROLL}", (k, k), depth=D, budget=n)
        for beta in (float(x) for x in a.depth_bonus.split(",") if x):
            k = (lambda pool, D=D, beta=beta: by_score(pool[2] + beta * depth, pool[1], depth, a.budget, D))
            run(f"q@{T_ROLL} + {beta}*depth", (k, k), depth=D, budget=a.budget, depth_bonus=beta)
        if not a.no_calibrated:
            models = [fit(folds[1], depth, D, TOPK), fit(folds[0], depth, D, TOPK)]  # each fold scored by the other's fit
            run("calibrated", [calibrated_keep(m, depth, a.budget, D, TOPK) for m in models], depth=D, budget=a.budget)
        every = (lambda pool, D=D: torch.nonzero(depth <= D)[:, 0])
        run("oracle", (every, every), depth=D, budget=None)
    base, per = (float(x) for x in a.depth_cost.split(","))

    def keep_at(pool, D):
        return by_score(pool[2], pool[1], depth, a.budget, D)

    for item in (x for x in a.adaptive.split(",") if x):
        lo, hi, acc, lag = (int(x) for x in item.split("/"))
        tokens, used = 0, []
        for pools in all_pools:
            tk, ds = replay_adaptive(pools, keep_at, lambda rep: hi if rep and rep[0] >= min(acc, rep[1]) else lo, lag)
            tokens, used = tokens + tk, used + ds
        ms = sum(base + per * (d - 8) for d in used)
        rows.append({"policy": f"q@{T_ROLL}, depth {hi} after >= {acc} accepted, else {lo}", "lag": lag,
                     "budget": a.budget, "tokens_per_round": tokens / len(used),
                     "share_deep": sum(d == hi for d in used) / len(used), "ms_per_token": ms / tokens,
                     "depth_cost": [base, per]})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "prompts": f"GSM8K train questions left out of the drafter's data: {picked}",
                       "rollout": {"topk": TOPK, "width": WIDTH, "depth": DEPTH, "temperature": T_ROLL},
                       "max_new_tokens": a.max_new_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
