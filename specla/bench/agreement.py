"""`specla bench agreement`: how often bf16 speculative outputs equal AR's, and why not.

In exact arithmetic the `chain` and `tree` routes emit AR's greedy tokens (float64 tests pin
that at 1e-10). In bf16 on the GPU the verifiers round differently from the AR step (another
kernel, another summation order, other matmul shapes), so where AR's top two logits are
nearly tied the argmax can flip, and from there the outputs differ. This benchmark measures
that: over `runs` random prompts at a named shape (random weights), `new_tokens` greedy
tokens per route; for every route whose output differs from AR's, the index of the first
differing token and AR's logit margin there (top-1 − top-2 of AR's own logits at that step),
against the distribution of AR's margins over all steps.

Drafts. Random weights make real drafters useless (prompt lookup accepted nothing on them,
docs/benchmark-log.md), and acceptance is what exercises verify + commit. So the drafter is an
*oracle with noise* (`NoisyOracle`): it knows AR's continuation of the prompt and proposes
it along the topology's main line (each node's first child), each token replaced by a random
one with probability `noise`; every other node gets a random token. It only sees the route's
own history: once a route has left AR's path its proposals are mostly rejected, which does
not matter, since only the first divergence is reported. `chain`: a chain of
`chain_length` drafts (serial verifier); `tree`: a 16-node top-4 beam tree (hybrid
verifier); both through `Decoder` (CUDA graphs on the GPU, delayed commit).

AR runs its own loop on the same `GraphTarget` step the `ar` route replays (argmax of the
step's logits), so the margins come from the very logits that chose AR's tokens; run 0 also
checks the loop against `Decoder`'s `ar` route.

Exact mode (`docs/exact.md`, on by default here): AR and both routes run again with every
target call verifying `EXACT_WIDTH` nodes; `chain+exact` and `tree+exact` are compared with
exact-mode AR, which should make every run equal. Writes `agreement.json`.
"""

from __future__ import annotations

import random
import statistics

import torch

from specla.bench.common import RESULTS, write_results
from specla.bench.trees import beam_tree
from specla.decode import EXACT_WIDTH, Decoder
from specla.drafters.base import Draft, DraftContext, Drafter
from specla.engine import EagerTarget, GraphTarget
from specla.fused import fuse
from specla.shapes import random_model


class NoisyOracle(Drafter):
    """Proposes a known continuation along the main line of a fixed topology, with noise."""

    def __init__(self, parents: list[int], vocab: int, noise: float, seed: int = 0, name: str = "oracle"):
        self.parents, self.vocab, self.noise, self.name = list(parents), vocab, noise, name
        self.max_nodes = len(parents)
        self.rng = random.Random(seed)
        self.reference: list[int] = []
        n = len(parents)
        self.depth = [0] * n
        self.main = [True] + [False] * (n - 1)
        seen = set()
        for j in range(1, n):
            p = parents[j]
            self.depth[j] = self.depth[p] + 1
            self.main[j] = self.main[p] and p not in seen  # the first child of a main node
            seen.add(p)

    def set_reference(self, reference: list[int]) -> None:
        """prompt + AR's continuation: position t of the history proposes reference[t]."""
        self.reference = list(reference)

    def _random(self, avoid: int) -> int:
        t = self.rng.randrange(self.vocab - 1)
        return t + (t >= avoid >= 0)

    def propose(self, ctx: DraftContext) -> Draft:
        hist = ctx.history[0]
        toks = [hist[-1]]
        for j in range(1, len(self.parents)):
            pos = len(hist) - 1 + self.depth[j]
            want = self.reference[pos] if pos < len(self.reference) else -1
            hit = self.main[j] and want >= 0 and self.rng.random() >= self.noise
            toks.append(want if hit else self._random(want))  # misses never propose the reference token
        return Draft(torch.tensor([toks]), torch.tensor([self.parents]))


def ar_with_margins(target, prompt: list[int], new_tokens: int):
    """AR's greedy tokens and, per step, the top-1 − top-2 gap of the logits that chose them."""
    dev = target.model.device
    target.reset()
    target.prefill(torch.tensor([prompt[:-1]], device=dev))
    root = torch.tensor([prompt[-1]], device=dev)
    toks, margins = [], []
    for _ in range(new_tokens):
        logits = target.step(root)
        nxt = logits.argmax(-1)  # the ar route's rule (lowest id among ties)
        top2 = logits.float().topk(2, dim=-1).values
        toks.append(nxt)
        margins.append(top2[:, 0] - top2[:, 1])
        root = nxt.clone()  # the step's output buffer is static under graph replay
    return torch.cat(toks).tolist(), torch.cat(margins).tolist()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _describe(x: dict) -> str:
    if x["equal"]:
        return f"= AR, tau {x['tau']:.2f}"
    m = x["margin"] if x["margin"] is not None else float("nan")
    return f"diverges at {x['first_divergence']} (AR margin {m:.4g}), tau {x['tau']:.2f}"


def _quantiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"min": s[0], "p10": q(0.1), "median": q(0.5), "p90": q(0.9), "max": s[-1]}


def run(shape: str = "gdn-1.3b-paper", runs: int = 50, new_tokens: int = 128, prompt_len: int = 64,
        device: str = "cuda", dtype: torch.dtype | None = None, noise: float = 0.2, chain_length: int = 8,
        tree: tuple[int, int, int] = (4, 4, 16), quick: bool = False, compile: str | None = None,
        seed: int = 0, exact: bool = True, gemv: str = "cublas", name: str = "agreement",
        out_dir=RESULTS) -> dict:
    """`compile` ('default' / 'max-autotune') fuses the target (`fused.fuse`, its products run
    the `gemv` way: `fused.GEMVS`), as does SPECLA_COMPILE; the fused path then serves AR and
    both routes. `exact`: also run AR and both routes in exact mode (`chain+exact`,
    `tree+exact`, compared with exact-mode AR). `name`: the result file's stem."""
    dev = torch.device(device)
    graphs = dev.type == "cuda"
    dtype = dtype or torch.bfloat16
    if quick:
        runs, new_tokens, prompt_len = min(runs, 2), min(new_tokens, 16), min(prompt_len, 16)
    model = random_model(shape, device=dev, dtype=dtype, seed=seed)
    if compile:
        fuse(model, mode=compile, gemv=gemv)
    V = model.cfg.vocab_size
    max_len = prompt_len + new_tokens + 64
    ar_target = GraphTarget(model, 1, max_len, 1, True) if graphs else EagerTarget(model, 1, max_len)
    drafters = {
        "chain": NoisyOracle(list(range(-1, chain_length)), V, noise, seed + 1, "chain"),
        "tree": NoisyOracle(beam_tree(*tree), V, noise, seed + 2, "tree"),
    }
    targets: dict = {}  # GraphTargets (and their graphs) shared by every run of a route
    per_run, all_margins = [], []
    ar_loop_ok = None
    for r in range(runs):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        prompt = torch.randint(0, V, (prompt_len,), generator=g).tolist()
        ar, margins = ar_with_margins(ar_target, prompt, new_tokens)
        all_margins += margins
        if r == 0:
            ar_loop_ok = Decoder(model, graphs=graphs, targets=targets).generate(prompt, new_tokens).tokens == ar
        row = {"run": r}
        refs = [("", None, ar)]
        if exact:  # the exact-mode reference: AR through the 17-node verify
            ar_x = Decoder(model, graphs=graphs, targets=targets, exact_width=EXACT_WIDTH).generate(
                prompt, new_tokens).tokens
            row["ar+exact"] = {"equal": ar_x == ar, "first_divergence": first_divergence(ar, ar_x)}
            refs.append(("+exact", EXACT_WIDTH, ar_x))
        for suffix, width, ref in refs:
            for route, drafter in drafters.items():
                drafter.set_reference(prompt + ref)
                res = Decoder(model, drafter, route=route, graphs=graphs, targets=targets,
                              exact_width=width).generate(prompt, new_tokens)
                i = first_divergence(ref, res.tokens)
                row[route + suffix] = {"equal": i is None, "first_divergence": i,
                                       "margin": margins[i] if width is None and i is not None and i < len(margins)
                                       else None, "tau": res.mean_accepted_length, "rounds": len(res.rounds)}
        per_run.append(row)
        names = [k for k in row if k not in ("run", "ar+exact")]
        print(f"run {r}: " + ", ".join(f"{k} {_describe(row[k])}" for k in names), flush=True)

    summary = {}
    for route in [k for k in per_run[0] if k not in ("run", "ar+exact")]:
        rows = [row[route] for row in per_run]
        div = [x for x in rows if not x["equal"]]
        summary[route] = {
            "equal": sum(x["equal"] for x in rows), "runs": len(rows),
            "equal_fraction": sum(x["equal"] for x in rows) / len(rows),
            "mean_tau": statistics.fmean(x["tau"] for x in rows),
            "first_divergence": _quantiles([x["first_divergence"] for x in div]),
            "margin_at_divergence": _quantiles([x["margin"] for x in div if x["margin"] is not None]),
        }
    result = {
        "shape": shape, "dtype": str(dtype).removeprefix("torch."), "graphs": graphs,
        "fused": model._fused.mode if getattr(model, "_fused", None) is not None else None,
        "gemv": model._fused.gemv if getattr(model, "_fused", None) is not None else None,
        "runs": runs, "new_tokens": new_tokens, "prompt_len": prompt_len,
        "drafter": f"noisy oracle: AR's continuation along each topology's main line, each token replaced "
                   f"by a random one with probability {noise}; other nodes random",
        "chain_length": chain_length, "tree": {"topk": tree[0], "depth": tree[1], "nodes": tree[2]},
        "ar_loop_equals_decoder_ar": ar_loop_ok,
        "exact_width": EXACT_WIDTH if exact else None,
        "ar_exact_equals_ar": (sum(row["ar+exact"]["equal"] for row in per_run) if exact else None),
        "ar_margin_all_steps": _quantiles(all_margins),
        "summary": summary, "per_run": per_run,
    }
    _print(result)
    write_results(name, result, out_dir)
    return result


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bf16 agreement with AR, {result['shape']}: {result['runs']} runs x "
                        f"{result['new_tokens']} tokens (AR margin median "
                        f"{result['ar_margin_all_steps'].get('median', float('nan')):.3g})")
    for c in ("route", "equal", "mean tau", "first divergence (median)", "margin at divergence (median / max)"):
        table.add_column(c)
    for route, s in result["summary"].items():
        fd, mg = s["first_divergence"], s["margin_at_divergence"]
        table.add_row(route, f"{s['equal']}/{s['runs']}", f"{s['mean_tau']:.2f}",
                      str(fd.get("median", "-")),
                      f"{mg['median']:.3g} / {mg['max']:.3g}" if mg else "-")
    Console().print(table)
