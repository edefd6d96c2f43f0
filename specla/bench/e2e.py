"""`specla bench e2e`: end-to-end greedy decoding on real prompts (SpecLA §8.2, Fig 9).

Routes: `ar`; `fla` (FLA-SD: the chain drafter verified by fla's own model, token-replay
commit); `chain` (8-token chains of the trained drafter); `tree` (≤ 16 nodes, top-k 4, the
trained drafter, nodes ranked at `eagle.TREE_TEMPERATURE`; runs before 655b94a ranked at 1);
`ngram` (prompt lookup, trees); `dspark`, `ready` (7-token blocks of the parallel block
drafters, docs/ready.md; not run by default). Per suite (`mixed` 480, `gsm8k` 1,319,
`humaneval` 164) each prompt is generated once per route; the speedup is AR's summed latency
over the route's summed latency on the same prompts, with a 95% bootstrap interval over
prompts (and the same without prefill: `decode_speedup`), beside mean accepted length (τ:
tokens per round), first-token match and the
fraction of prompts whose output equals AR's exactly. A route name with `+exact` runs in
exact mode (`docs/exact.md`): its speedup is still over plain `ar` (the fastest AR), its
output is compared with `ar+exact`'s when that route ran (else with `ar`'s).

Every finished (suite, route, prompt) is appended to a JSONL log next to the results, so a
call that runs out of time resumes where it stopped (from gzipped logs too). Prompts run in index order across suites
(prompt i of every suite, every route, before prompt i + 1), so a partial run compares the
routes on the same prompts; `shard` splits the indices between processes (one per GPU), and
the summary reads every shard's log.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import torch

from specla import graphs
from specla.bench.common import RESULTS, bootstrap, environment, generations_with, warm_set, write_results
from specla.drafters.eagle import TREE_TEMPERATURE
from specla.errors import InputError

BASE_ROUTES = ("ar", "fla", "chain", "tree", "ngram", "dspark", "ready")
ROUTES = BASE_ROUTES + tuple(f"{r}+exact" for r in BASE_ROUTES if r != "fla")
SUITES = ("mixed", "gsm8k", "humaneval")
EXACT = "+exact"


def route_options(route: str, tree_depth: int | tuple[int, int] = 8, tree_budget: int = 16) -> dict:
    """generate() options of a route; tree_depth, tree_budget: the trained drafter's tree route's
    (top-4 beams; a (shallow, deep) depth adapts each round, `tree.DepthPolicy`)."""
    if route.endswith(EXACT):
        return {**route_options(route[:-len(EXACT)], tree_depth, tree_budget), "exact": True}
    return {
        "ar": dict(route="ar"),
        "fla": dict(route="fla", chain_length=8),
        "chain": dict(route="chain", chain_length=8),
        # the temperature named, so that a run's route_options say which ranked the nodes
        "tree": dict(route="tree", tree_topk=4, tree_budget=tree_budget, tree_depth=tree_depth,
                     tree_temperature=TREE_TEMPERATURE),
        "ngram": dict(route="tree", drafter="ngram", tree_topk=4, tree_budget=16),
        "dspark": dict(route="dspark", chain_length=7),  # block drafters: 7 tokens in one forward (docs/ready.md)
        "ready": dict(route="ready", chain_length=7),
    }[route]


def bootstrap_ratio(num: list[float], den: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of Σnum / Σden, resampling prompts with replacement."""
    return bootstrap(lambda idx: sum(num[i] for i in idx) / max(sum(den[i] for i in idx), 1e-12), len(num), reps, seed)


def bootstrap_mean(xs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    return bootstrap_ratio(xs, [1.0] * len(xs), reps, seed)


def token_reference(records: dict, route: str) -> str:
    """The route whose outputs `route`'s are compared with: exact-mode AR for exact routes
    (when it ran), else AR."""
    exact_ar = "ar" + EXACT
    return exact_ar if route.endswith(EXACT) and route != exact_ar and records.get(exact_ar) else "ar"


def _summarise(records: dict, route: str) -> dict:
    """Stats of `route` over the prompts that it, AR and its token reference finished."""
    ref_name = token_reference(records, route)
    ar, rt, ref = records.get("ar", {}), records.get(route, {}), records.get(ref_name, {})
    ids = sorted(set(ar) & set(rt) & set(ref))
    if not ids:
        return {"prompts": 0}
    lat = [rt[i]["seconds"] for i in ids]
    tau = [rt[i]["mean_accepted_length"] for i in ids]
    ftm = [rt[i]["first_token_match"] for i in ids if rt[i]["first_token_match"] is not None]
    exact = [float(rt[i]["tokens"] == ref[i]["tokens"]) for i in ids]
    out = {
        "prompts": len(ids), **_speedups(rt, ar, ids),
        "mean_accepted_length": sum(tau) / len(tau), "mean_accepted_length_ci95": bootstrap_mean(tau),
        "first_token_match": sum(ftm) / len(ftm) if ftm else None,
        "first_token_match_ci95": bootstrap_mean(ftm) if ftm else None,
        "exact_match_rate": sum(exact) / len(exact), "exact_reference": ref_name,
        "tokens_per_second": sum(len(rt[i]["tokens"]) for i in ids) / sum(lat),
        # prefill per prompt, this route's and AR's on the same prompts (ms)
        "prefill_ms": 1e3 * sum(rt[i]["prefill_seconds"] for i in ids) / len(ids),
        "ar_prefill_ms": 1e3 * sum(ar[i]["prefill_seconds"] for i in ids) / len(ids),
        "outside_ms": _outside_ms([rt[i] for i in ids]),
        "prefill_by_length": prefill_by_length(rt, ids),
        "commits": sorted({rt[i].get("commit") or "unknown" for i in ids}),
        "timed_captures": generations_with("captures", ids, rt, ar),
        "retimed": generations_with("retimed", ids, rt, ar),
    }
    # where outputs that differ from the reference's first differ: [prompt id, token index]
    out["first_divergence"] = [
        [i, next((k for k, (a, b) in enumerate(zip(ref[i]["tokens"], rt[i]["tokens"])) if a != b),
                 min(len(ref[i]["tokens"]), len(rt[i]["tokens"])))]
        for i, same in zip(ids, exact) if not same][:50]
    return out


PROMPT_LENGTH_BUCKETS = (0, 32, 128, 512, 1024, 2048)  # prompt tokens; 512 = ops.CHUNK_MIN_TOKENS


def _outside_ms(recs: list) -> float | None:
    """The mean time (ms) of these generations outside their prefill and decode: encoding the
    prompt (its chat template and tokenizer), resetting the target and drafter, decoding the text."""
    if not recs:
        return None
    return 1e3 * sum(r["seconds"] - r["prefill_seconds"] - r["decode_seconds"] for r in recs) / len(recs)


def prefill_by_length(rt: dict, ids) -> list[dict]:
    """Mean prefill and mean time outside prefill and decode (ms) of these prompts by prompt
    length in tokens, one row per non-empty bucket [lo, hi) (the last open); records written
    before `prompt_tokens` was kept count in none."""
    edges = PROMPT_LENGTH_BUCKETS + (None,)
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        recs = [rt[i] for i in ids if "prompt_tokens" in rt[i]
                and lo <= rt[i]["prompt_tokens"] and (hi is None or rt[i]["prompt_tokens"] < hi)]
        if recs:
            rows.append({"min_tokens": lo, "max_tokens": hi, "prompts": len(recs),
                         "prefill_ms": 1e3 * sum(r["prefill_seconds"] for r in recs) / len(recs),
                         "outside_ms": _outside_ms(recs)})
    return rows


def paired(records: dict, route: str, base: str) -> dict | None:
    """`route` against `base` on the prompts both finished: base's summed latency over route's,
    end to end and decode only, with 95% bootstrap intervals over prompts (resampling the
    prompts as pairs, so the two routes' shared per-prompt variation cancels). The drafter issue
    asks whether trees beat chains beyond the intervals: this is that comparison."""
    rt, bs = records.get(route, {}), records.get(base, {})
    ids = sorted(set(rt) & set(bs))
    return {"base": base, "prompts": len(ids), **_speedups(rt, bs, ids)} if ids else None


def _speedups(rt: dict, base: dict, ids: list) -> dict:
    """base's summed latency over rt's on these prompts, end to end and decode only (prefill and
    target setup excluded), with 95% bootstrap intervals over the prompts."""
    out = {}
    for prefix, key in (("", "seconds"), ("decode_", "decode_seconds")):
        num, den = [base[i][key] for i in ids], [rt[i][key] for i in ids]
        out[prefix + "speedup"], out[prefix + "speedup_ci95"] = sum(num) / sum(den), bootstrap_ratio(num, den)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(result["suites"])  # the run's order; a prompt file's rows by its path
    routes = [r for r in ROUTES if r != "ar" and any(result["suites"][s].get(r, {}).get("prompts") for s in suites)]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.2 + 0.3 * len(routes)))
    for ax, (key, label) in zip(axes, [("speedup", "speedup over AR"), ("decode_speedup", "speedup, prefill excluded"),
                                       ("mean_accepted_length", "accepted length τ"),
                                       ("first_token_match", "first-token match")]):
        for k, suite in enumerate(suites):
            for j, route in enumerate(routes):
                r = result["suites"][suite].get(route, {})
                if not r.get("prompts") or r.get(key) is None:
                    continue
                y = k * (len(routes) + 1) + j
                ci = r.get(f"{key}_ci95")
                err = [[r[key] - ci[0]], [ci[1] - r[key]]] if ci else None
                ax.barh(y, r[key], xerr=err, color=f"C{j}", label=route if k == 0 else None)
        ax.set_yticks([k * (len(routes) + 1) + (len(routes) - 1) / 2 for k in range(len(suites))], suites)
        ax.set_title(label)
        ax.invert_yaxis()
        if key.endswith("speedup"):
            ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    # one legend above the panels: inside one, it would cover its bars
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", ncol=max(1, len(routes)), fontsize=9)
    fig.suptitle(f"end-to-end greedy decoding, {result['max_new_tokens']} new tokens, {result['device']}", x=0.35)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load_records(out_dir: Path, name: str) -> dict:
    """suite -> route -> prompt id -> record, from every records file of this benchmark (one
    per shard; gzipped ones too: a finished run's records are kept in the repository that way,
    and a later call resumes from them)."""
    records: dict = {}
    for path in sorted(out_dir.glob(f"{name}.records*.jsonl*")):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        for line in text.splitlines():
            r = json.loads(line)
            records.setdefault(r["suite"], {}).setdefault(r["route"], {})[r["id"]] = r
    return records


def _work(suites, routes, limit, fla_limit, shard):
    """(index, suite, prompt, route) in the order they run: prompt index outermost, so a run cut
    short has the same prompts done for every suite and route; shard (k, n) keeps indices
    i with i % n == k."""
    from specla.data.suites import load_suite

    prompts = {s: load_suite(s, limit=limit) for s in suites}
    k, n = shard
    for i in range(k, max(len(p) for p in prompts.values()), n):
        for suite in suites:
            if i < len(prompts[suite]):
                for route in routes:
                    if route != "fla" or i < fla_limit:
                        yield i, suite, prompts[suite][i], route


def _recorded_options(records: dict, route: str) -> list[dict]:
    """The generate() options a route's records were made with (records from before they were
    recorded count as the default options)."""
    seen = {json.dumps(r.get("options", route_options(route)), sort_keys=True)
            for s in records.values() for r in s.get(route, {}).values()}
    return [json.loads(v) for v in sorted(seen)]


def summarise(out_dir, name: str, suites, routes, max_new_tokens: int, complete: bool, extra=None) -> dict:
    """Summary over every record found (all shards); writes <name>.json and <name>.png."""
    out_dir = Path(out_dir)
    records = _load_records(out_dir, name)
    options = {r: _recorded_options(records, r) for r in routes}
    def found(key):  # every value of `key` across the records (JSON-encoded, so dicts compare)
        return [json.loads(v) for v in sorted({json.dumps(r.get(key), sort_keys=True) for s in records.values()
                                               for rt in s.values() for r in rt.values()} - {"null"})]

    devices, dtypes = found("device"), found("dtype")
    result = {"max_new_tokens": max_new_tokens, "complete": complete, **(extra or {}),
              "route_options": {r: o[0] if len(o) == 1 else o for r, o in options.items() if o},
              "suites": {s: {r: _summarise(records.get(s, {}), r) for r in routes if r != "ar"} for s in suites}}
    if devices:
        result["device"] = devices[0] if len(devices) == 1 else devices
    if dtypes:
        result["dtype"] = dtypes[0] if len(dtypes) == 1 else dtypes
    # where and with what the records were measured, not where this summary was written
    for key in ("versions", "commit"):
        vals = found(key)
        if vals:
            result[key] = vals[0] if len(vals) == 1 else vals
    for s in suites:  # trees against chains, paired by prompt
        tree = result["suites"][s].get("tree")
        if tree and tree.get("prompts") and "chain" in routes:
            tree["over_chain"] = paired(records.get(s, {}), "tree", "chain")
    for s in suites:  # the reference row: one token per target call, its own output
        ar = records.get(s, {}).get("ar", {})
        result["suites"][s]["ar"] = {"prompts": len(ar), "speedup": 1.0,
                                     "mean_accepted_length": 1.0, "first_token_match": None,
                                     "exact_match_rate": 1.0, "prefill_by_length": prefill_by_length(ar, sorted(ar)),
                                     "outside_ms": _outside_ms(list(ar.values()))}
    path = write_results(name, result, out_dir)
    plot(json.loads(path.read_text()), out_dir / f"{name}.png")
    _print(result)
    return result


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"end-to-end greedy decoding, {result['max_new_tokens']} new tokens "
                    f"({result.get('device', '?')}, {result.get('dtype', '?')})")
    for c in ("suite", "route", "prompts", "speedup over AR [95% CI]", "decode only", "τ", "first-token match",
              "outputs equal (reference)", "prefill ms (AR's)"):
        t.add_column(c)
    for suite, routes in result["suites"].items():
        for route, r in routes.items():
            if route == "ar" or not r.get("prompts"):
                continue
            lo, hi = r["speedup_ci95"]
            ftm = r.get("first_token_match")
            t.add_row(suite, route, str(r["prompts"]), f"{r['speedup']:.3f} [{lo:.3f}, {hi:.3f}]",
                      f"{r['decode_speedup']:.3f}",
                      f"{r['mean_accepted_length']:.2f}", "" if ftm is None else f"{ftm:.2f}",
                      f"{100 * r['exact_match_rate']:.1f}% ({r['exact_reference']})",
                      f"{r['prefill_ms']:.1f} ({r['ar_prefill_ms']:.1f})")
    console = Console(width=140)
    console.print(t)
    for suite, routes in result["suites"].items():
        pair = routes.get("tree", {}).get("over_chain")
        if pair:
            (lo, hi), (dlo, dhi) = pair["speedup_ci95"], pair["decode_speedup_ci95"]
            console.print(f"{suite}: tree over chain on {pair['prompts']} prompts {pair['speedup']:.3f} "
                          f"[{lo:.3f}, {hi:.3f}], decode only {pair['decode_speedup']:.3f} [{dlo:.3f}, {dhi:.3f}]")
    for suite, routes in result["suites"].items():
        rows = routes.get("ar", {}).get("prefill_by_length")
        if rows:
            console.print(f"{suite}: AR's prefill (and time outside prefill and decode) by prompt length: " + ", ".join(
                f"{r['min_tokens']}{'+' if r['max_tokens'] is None else '-' + str(r['max_tokens'] - 1)} tokens "
                f"{r['prefill_ms']:.1f} ({r['outside_ms']:.1f}) ms ({r['prompts']})" for r in rows))
    for suite, routes in result["suites"].items():
        for route, r in routes.items():
            if r.get("timed_captures"):
                console.print(f"[yellow]{suite} {route}: {r['timed_captures']} timed generations (its or AR's) "
                              "captured a CUDA graph: their times include it[/yellow]")
            if r.get("retimed"):
                console.print(f"{suite} {route}: {r['retimed']} generations (its or AR's) captured a CUDA graph "
                              "and were timed again")


def _timed_generation(lm, dev, prompt, max_new_tokens: int, options: dict):
    """(generation, seconds, graphs captured inside the timing, whether it was timed again). A
    generation that captured a CUDA graph is generated once more, its graphs now there, and
    that timing kept: the warm-up cannot foresee every graph a resumed run's few prompts need
    (e2e_37fdbd1_h100: a resume of 125 generations captured in 4, one of them 3.5 s)."""
    def once():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        c0, t0 = graphs.captured(), time.perf_counter()
        g = lm.generate(prompt, max_new_tokens=max_new_tokens, **options)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return g, time.perf_counter() - t0, graphs.captured() - c0

    g, seconds, captures = once()
    if not captures:
        return g, seconds, 0, False
    return (*once(), True)


def run(model_dir=None, suites=SUITES, routes=BASE_ROUTES, limit: int | None = None, fla_limit: int = 160,
        max_new_tokens: int = 128, device: str = "auto", dtype: str = "auto", out_dir=RESULTS,
        name: str = "e2e", max_minutes: float | None = None, shard: tuple[int, int] = (0, 1),
        summary_only: bool = False, compile: str | None = None, tree_depth: int | tuple[int, int] = 8,
        tree_budget: int = 16) -> dict:
    """Generate what is not yet recorded (this shard's prompts), then summarise every record.
    summary_only: no generation (e.g. after shards ran on several GPUs or calls). tree_depth,
    tree_budget: the tree route's (`route_options`); a run resumes only records made with the
    same options."""
    from tqdm import tqdm

    import specla.api as api

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = _load_records(out_dir, name)
    kwargs = {r: route_options(r, tree_depth, tree_budget) for r in routes}
    for r in routes:
        other = [o for o in _recorded_options(records, r) if o != json.loads(json.dumps(kwargs[r]))]
        if other and not summary_only:
            raise InputError(f"{out_dir / name}: the {r} records were made with {other[0]}, not {kwargs[r]}; "
                             f"resume with the same options or use another --name")
    if summary_only:
        # complete when every shard's work is recorded; the measuring run's date, model, shard,
        # switches and tiling stay (a summary written later on another machine is not a new
        # measurement)
        left = any(w[2].id not in records.get(w[1], {}).get(w[3], {})
                   for w in _work(suites, routes, limit, fla_limit, (0, 1)))
        previous = out_dir / f"{name}.json"
        kept = json.loads(previous.read_text()) if previous.exists() else {}
        extra = {key: kept[key] for key in ("date", "model", "shard", "env", "verify_tiling") if key in kept}
        return summarise(out_dir, name, suites, routes, max_new_tokens, complete=not left, extra=extra)
    start = time.time()
    k, n = shard
    log_path = out_dir / (f"{name}.records.jsonl" if n == 1 else f"{name}.records.{k}of{n}.jsonl")
    todo = [w for w in _work(suites, routes, limit, fla_limit, shard)
            if w[2].id not in records.get(w[1], {}).get(w[3], {})]
    if not todo:  # everything of this shard is recorded: no model to load, nothing to warm
        return summarise(out_dir, name, suites, routes, max_new_tokens, complete=n == 1,
                         extra={"model": str(model_dir or api.DEMO_DIR), "shard": [k, n]})
    lm = api.load(model_dir, device=device, dtype=dtype, compile=compile)
    dev = lm.model.device
    # compile and autotune kernels, size every buffer and capture graphs outside the timings,
    # for the routes with work left (a resumed run skips, e.g., fla's minutes of autotuning)
    unique = {(suite, p.id): p for _, suite, p, _ in todo}.values()  # each prompt once, not once per route
    warm = warm_set(((len(lm.encode_prompt(p.turns[0])), p.turns[0]) for p in unique), max_new_tokens)
    warm = warm or ["warm up"]
    with_work = {w[3] for w in todo}
    for route in tqdm([r for r in routes if r in with_work], desc="warm-up (compile, autotune, capture)", unit="route"):
        t0 = time.perf_counter()
        for text in warm:
            lm.generate(text, max_new_tokens=max_new_tokens, **kwargs[route])
        tqdm.write(f"warm-up {route}: {time.perf_counter() - t0:.1f} s ({len(warm)} prompts)")
    tqdm.write(f"loaded and warmed up in {time.time() - start:.0f} s; {len(todo)} generations to run")
    stopped = False
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    env = environment()
    with open(log_path, "a") as log:
        for _, suite, p, route in tqdm(todo, desc=f"e2e shard {k}/{n}", unit="generation"):
            if max_minutes is not None and time.time() - start > max_minutes * 60:
                stopped = True
                break
            g, seconds, captures, retimed = _timed_generation(lm, dev, p.turns[0], max_new_tokens, kwargs[route])
            rec = {"suite": suite, "route": route, "id": p.id, "seconds": seconds,
                   "captures": captures, "retimed": retimed,
                   "prefill_seconds": g.prefill_seconds, "decode_seconds": g.decode_seconds, "tokens": g.tokens, "rounds": g.rounds,
                   "mean_accepted_length": g.mean_accepted_length,
                   "first_token_match": g.to_dict()["first_token_match"], "prompt_tokens": g.prompt_tokens,
                   "options": kwargs[route], "device": device_name, "dtype": str(lm.model.dtype).replace("torch.", ""),
                   "commit": env["commit"], "versions": env["versions"]}
            log.write(json.dumps(rec) + "\n")
            log.flush()
    return summarise(out_dir, name, suites, routes, max_new_tokens, complete=not stopped and n == 1,
                     extra={"model": str(lm.model_dir), "shard": [k, n]})
