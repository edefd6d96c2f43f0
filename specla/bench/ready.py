"""`specla bench ready`: ReaDy vs DSpark (ReaDy Table 1-6, Fig. 4-5) on the demo target.

    specla bench ready                        # GPU: benchmarks/results/ready.{json,png}
    specla bench ready --device cpu --quick   # smoke test (random drafters if none trained)

Rows per suite (`mixed`: the 480-prompt EAGLE suite, `gsm8k` test, `humaneval`): `ar`,
`dspark`, `dspark_ft` (the fine-tuned control) and `ready`, plus any `--variant NAME=DIR`
(ablations: reader rank, source layers, injection layers/site — train them with the options of
`specla.train.block_drafter`). Every prompt (first user turn, chat template) is generated once per
row, greedy, up to `max_new_tokens`; for each row:

- `tps`: generated tokens / decode seconds (prefill excluded), summed over the suite's prompts;
- `speedup`: tps / AR's tps on the same prompts;
- `mean_accepted_length` (τ): tokens emitted per verification round, the target-supplied one
  included (pooled over rounds);
- `survival[j-1]`, j = 1..7: the fraction of fully observable blocks (all 7 proposals verified:
  not cut by the confidence threshold, not truncated by the end of generation) whose first j
  proposals were all accepted (ReaDy Fig. 5; cumulative, not conditional);
- `exact_match_rate`: outputs equal to AR's (bf16 kernels round differently; float64 tests prove
  exactness), `first_token_match`.

`operator` times the state reader alone at the demo shape and a Qwen3-Next-like one (HV 32,
dk = dv = 128), in CUDA-graph replay (`triton.testing.do_bench`, median): the unfused path —
flush each source layer (`ops.gdn_commit`), gather the states (`torch.stack`), read with dense
ops (einsum, value map, norms) — against the fused kernel (`ops.reader.triton.state_read`),
with and without a pending update (ReaDy Fig. 3-4), after checking on the device that the fused
kernel's reads, norms and written-back states equal the torch reference (`rel_err_*`).

JSON (`write_results("ready", ...)`): device, versions, commit, date, config, suites.{suite}.{row}
with prompts / tps / speedup / mean_accepted_length / survival / ..., suites.{suite}.paired and
`pooled` (the same paired comparisons over all suites' prompts together), `all_suites` (each
row's summary over them: the whole evaluation's survival curves, also the PNG's last panel), operator, drafters (which
directories, or "random" in quick mode), bench_seconds. A JSONL log of finished generations
next to the results lets a run cut short resume.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import torch

from specla.bench.common import RESULTS, bootstrap, generations_with, graph_time_ms, median, warm_set, write_results
from specla.bench.e2e import bootstrap_ratio
from specla.graphs import captured as graphs_captured

SUITES = ("mixed", "gsm8k", "humaneval")
ROWS = ("dspark", "dspark_ft", "ready")
DIRS = {"dspark": "dspark", "dspark_ft": "dspark-ft", "ready": "ready"}
P = 7


def spread_prompts(prompts: list, n: int | None) -> list:
    """n prompts spread evenly over the suite (the mixed suite is ordered by category)."""
    if n is None or n >= len(prompts):
        return prompts
    return [prompts[int(i * len(prompts) / n)] for i in range(n)]


def row_drafter(row: str, path, target, graphs: bool, threshold: float, quick: bool):
    from specla.drafters.blocks import load_block_drafter
    from specla.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel
    from specla.drafters.ready import ReadyConfig, ReadyDrafter, ReadyModel

    if path is None:  # quick smoke without trained drafters: random weights
        torch.manual_seed(0)
        m = ReadyModel(ReadyConfig.for_target(target.cfg)) if row == "ready" else \
            DSparkModel(DSparkConfig.for_target(target.cfg))
        m = m.to(device=target.device, dtype=target.dtype).eval()
    else:
        m = load_block_drafter(path, target)
    cls = ReadyDrafter if isinstance(m, ReadyModel) else DSparkDrafter
    return cls(m, target, threshold=threshold, graphs=graphs)


def _summary(recs: dict, ar: dict) -> dict:
    ids = sorted(set(recs) & set(ar))
    if not ids:
        return {"prompts": 0}
    toks = sum(len(recs[i]["tokens"]) for i in ids)
    secs = sum(recs[i]["seconds"] for i in ids)
    ar_tps = sum(len(ar[i]["tokens"]) for i in ids) / max(sum(ar[i]["seconds"] for i in ids), 1e-12)
    tps = toks / max(secs, 1e-12)
    out = {"prompts": len(ids), "tokens": toks, "decode_seconds": round(secs, 4), "tps": tps, "speedup": tps / ar_tps,
           "timed_captures": generations_with("captures", ids, recs, ar)}
    rounds = [r for i in ids for r in recs[i].get("rounds", [])]  # (drafted, accepted, emitted)
    if rounds:
        out["mean_accepted_length"] = sum(r[2] for r in rounds) / len(rounds)
        full, *alive = _survivors(rounds)  # every proposal verified, nothing cut
        out["full_blocks"] = full
        out["survival"] = [n / max(full, 1) for n in alive]
        ftm = [f for i in ids for f in recs[i].get("ftm", []) if f is not None]
        out["first_token_match"] = sum(ftm) / len(ftm) if ftm else None
    else:
        out["mean_accepted_length"] = 1.0
    out["exact_match_rate"] = sum(recs[i]["tokens"] == ar[i]["tokens"] for i in ids) / len(ids)
    out["tps_ci95"] = bootstrap_ratio([len(recs[i]["tokens"]) for i in ids], [recs[i]["seconds"] for i in ids])
    if rounds:
        out["mean_accepted_length_ci95"] = bootstrap_ratio(
            [sum(r[2] for r in recs[i]["rounds"]) for i in ids], [len(recs[i]["rounds"]) for i in ids])
    return out


def _paired(a: dict, b: dict) -> dict:
    """Row a over row b on the prompts both finished: τ ratio, TPS ratio and the survival
    difference a − b at each position, with 95% bootstrap intervals (prompts resampled together,
    so both rows see the same draws)."""
    ids = sorted(set(a) & set(b))
    if not ids or not all(a[i].get("rounds") and b[i].get("rounds") for i in ids):
        return {"prompts": len(ids)}

    # per prompt, once: (tokens emitted, rounds, tokens, seconds) of each row
    per = {name: [(sum(x[2] for x in r[i]["rounds"]), len(r[i]["rounds"]), len(r[i]["tokens"]), r[i]["seconds"])
                  for i in ids] for name, r in (("a", a), ("b", b))}

    def ratio(picks, num: int, den: int) -> float:
        q = {n: sum(per[n][i][num] for i in picks) / sum(per[n][i][den] for i in picks) for n in per}
        return q["a"] / q["b"]

    every = range(len(ids))
    tau = lambda p: ratio(p, 0, 1)  # noqa: E731
    tps = lambda p: ratio(p, 2, 3)  # noqa: E731

    # per prompt and row: fully observable blocks, and how many of them survive to position j
    surv = {name: [_survivors(r[i]["rounds"]) for i in ids] for name, r in (("a", a), ("b", b))}

    def survival_diff(picks, j: int) -> float:
        q = {n: sum(surv[n][i][j] for i in picks) / max(sum(surv[n][i][0] for i in picks), 1) for n in surv}
        return q["a"] - q["b"]

    # the same seed gives every statistic the same resamples of prompts
    return {"prompts": len(ids), "tau_ratio": tau(every), "tau_ratio_ci95": bootstrap(tau, len(ids)),
            "tps_ratio": tps(every), "tps_ratio_ci95": bootstrap(tps, len(ids)),
            "survival_diff": [survival_diff(every, j) for j in range(1, P + 1)],
            "survival_diff_ci95": [bootstrap(lambda p, j=j: survival_diff(p, j), len(ids)) for j in range(1, P + 1)]}


def _survivors(rounds) -> list[int]:
    """[fully observable blocks, those whose first j proposals were all accepted for j = 1..P]
    (the counts behind `survival`)."""
    full = [r for r in rounds if r[0] == P and r[2] == r[1] + 1]
    return [len(full)] + [sum(r[1] >= j for r in full) for j in range(1, P + 1)]


def _pairs(recs: dict, rows) -> dict:
    """The paired comparisons ReaDy's claims are about (ready / dspark, ready / dspark_ft,
    dspark_ft / dspark, and each other row / dspark), among the rows `recs` holds."""
    pairs = [("ready", "dspark"), ("ready", "dspark_ft"), ("dspark_ft", "dspark")]
    pairs += [(r, "dspark") for r in rows if r not in ROWS]
    return {f"{x}/{y}": _paired(recs.get(x, {}), recs.get(y, {})) for x, y in pairs if x in recs and y in recs}


def _row_summaries(recs: dict, rows) -> dict:
    """Every row's summary against AR on these records."""
    ar = recs.get("ar", {})
    return {"ar": {**_summary(ar, ar), "mean_accepted_length": 1.0},
            **{row: _summary(recs.get(row, {}), ar) for row in rows}}


def summarise(done: dict, suites, rows) -> dict:
    """Per suite: every row's summary against AR, and the paired comparisons (`_pairs`)."""
    return {suite: {**_row_summaries(done.get(suite, {}), rows), "paired": _pairs(done.get(suite, {}), rows)}
            for suite in suites}


def _merged(done: dict, suites) -> dict:
    """row -> (suite, prompt id) -> record: every suite's prompts as one evaluation."""
    recs: dict = {}
    for suite in suites:
        for row, by_id in done.get(suite, {}).items():
            recs.setdefault(row, {}).update({(suite, i): r for i, r in by_id.items()})
    return recs


def pooled(done: dict, suites, rows) -> dict:
    """The paired comparisons over every prompt of the suites together (prompts resampled
    across suites): one survival curve difference for the whole evaluation beside each suite's."""
    return _pairs(_merged(done, suites), rows)


def all_suites(done: dict, suites, rows) -> dict:
    """Every row's summary over all suites' prompts together: the survival curve of the whole
    evaluation, each row's tokens and seconds summed over the suites (AR's on the same prompts)."""
    return _row_summaries(_merged(done, suites), rows)


def sections(done: dict, suites, rows) -> dict:
    """The result's summaries of the finished generations: `suites`, `pooled`, `all_suites`."""
    return {"suites": summarise(done, suites, rows), "pooled": pooled(done, suites, rows),
            "all_suites": all_suites(done, suites, rows)}


def read_log(log_path: Path) -> dict:
    """suite -> row -> prompt id -> record."""
    done: dict = {}
    if log_path.is_file():
        for line in log_path.read_text().splitlines():
            r = json.loads(line)
            done.setdefault(r["suite"], {}).setdefault(r["row"], {})[r["id"]] = r
    return done


def resummarise(out_dir, name: str = "ready") -> dict:
    """Recompute the suites of <name>.json from its log; device, versions, commit, date and the
    other sections stay those of the run that measured them."""
    out = Path(out_dir)
    result = json.loads((out / f"{name}.json").read_text())
    done = read_log(out / f"{name}_log.jsonl")
    rows = [r for r in next(iter(result["suites"].values())) if r not in ("ar", "paired")]
    result.update(sections(done, list(result["suites"]), rows))
    result["resummarised"] = True
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out / f"{name}.png")
    _print(result)
    return result


def _record(res, spec: bool) -> dict:
    rec = {"tokens": res.tokens, "seconds": res.decode_seconds}
    if spec:  # (drafted, accepted, emitted) per round
        rec["rounds"] = [(r.drafted, r.accepted, r.emitted) for r in res.rounds]
        rec["ftm"] = [r.first_token_match for r in res.rounds]
    return rec


def decode_section(lm, drafters: dict, suites, n_prompts, max_new_tokens: int, graphs: bool, delayed: bool,
                   log_path: Path, deadline: float | None, progress: bool) -> dict:
    from tqdm import tqdm

    from specla.data.suites import load_suite
    from specla.decode import Decoder

    model = lm.model
    eos = lm.tokenizer.eos_token_ids | set(model.cfg.eos_token_id)
    done = read_log(log_path)  # resume
    log = open(log_path, "a")

    # one Decoder per row for the whole run: its targets (static caches, CUDA graphs) and the
    # drafter's buffers and graph are reused, reset in place, across generations
    decoders = {row: Decoder(model, drafters.get(row), route="ar" if row == "ar" else "ready", eos_token_ids=eos,
                             graphs=graphs, delayed=delayed) for row in ["ar", *drafters]}
    work = {suite: [(p.id, lm.encode_prompt(p.turns[0])) for p in spread_prompts(load_suite(suite), n_prompts)]
            for suite in suites}
    # every buffer sized and every attention window's graph captured before timing
    warm = warm_set(((len(ids), ids) for items in work.values() for _, ids in items), max_new_tokens)
    for dec in decoders.values():
        for ids in warm:
            dec.generate(ids, max_new_tokens)
    complete = True
    for suite in suites:
        bar = tqdm(work[suite], desc=f"ready bench {suite}", disable=not progress)
        for pid, ids in bar:
            for row, dec in decoders.items():
                if pid in done.get(suite, {}).get(row, {}):
                    continue
                if deadline is not None and time.time() > deadline:
                    complete = False
                    break
                c0 = graphs_captured()
                res = dec.generate(ids, max_new_tokens)
                rec = {"suite": suite, "row": row, "id": pid, **_record(res, row != "ar"),
                       "captures": graphs_captured() - c0}
                done.setdefault(suite, {}).setdefault(row, {})[pid] = rec
                log.write(json.dumps(rec) + "\n")
                log.flush()
    log.close()
    return {**sections(done, suites, list(drafters)), "complete": complete}


# operator latency ------------------------------------------------------------------------------

def _time(fn, cuda: bool, reps: int) -> float:
    """Median µs of fn: CUDA-graph replay under do_bench on GPU, wall clock elsewhere."""
    if cuda:
        return graph_time_ms(fn, True, rep=200) * 1e3
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts) * 1e6


def operator_section(device: torch.device, quick: bool) -> list[dict]:
    from specla import ops
    from specla.ops.reader import naive as reader_naive
    from specla.ops.reader import triton as reader_triton

    cuda = device.type == "cuda"
    shapes = [("demo", 4, 64, 64), ("qwen3-next-like", 32, 128, 128)] if not quick else [("tiny", 2, 16, 16)]
    rows = []
    for name, HV, K, V in shapes:
        L, NQ, R, Pw = 2, P, 8, P + 1
        g = torch.Generator(device=device).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
        states = [r(1, HV, K, V) for _ in range(L)]
        pend = [(torch.nn.functional.normalize(r(1, Pw, HV, K), dim=-1), -torch.rand(1, Pw, HV, device=device) * 0.1,
                 r(1, Pw, HV, V) * 0.1, torch.full((1,), Pw, dtype=torch.long, device=device)) for _ in range(L)]
        q = r(1, NQ, L, HV, K).to(torch.bfloat16 if cuda else torch.float32)
        W = r(L, V, R)
        path = torch.arange(Pw, device=device)[None]

        def flush():
            for S, (pk, pg, pu, plen) in zip(states, pend):
                ops.gdn_commit(S, pk, pg, pu, path, plen)

        def gather():
            return torch.stack(states, 1)

        def read(St):
            rd = torch.einsum("bplhk,blhkv->bplhv", q.float(), St)
            return torch.einsum("bplhv,lvr->bplhr", rd, W), St.square().sum((-2, -1))

        def unfused():
            flush()
            read(gather())

        # correctness on this device first: fused == reference, and the state written back
        ref_S, out_S = [x.clone() for x in states], [x.clone() for x in states]
        r_ref, n_ref = reader_naive.state_read(ref_S, pend, q, W)
        r_out, n_out = reader_triton.state_read(out_S, pend, q, W)
        rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))  # noqa: E731
        check = {"rel_err_reads": rel(r_out, r_ref), "rel_err_sqnorm": rel(n_out, n_ref),
                 "rel_err_state": max(rel(a, b) for a, b in zip(out_S, ref_S))}
        reps = 3 if quick else 50
        row = {"shape": name, **check, "L": L, "HV": HV, "K": K, "V": V, "queries": NQ, "rank": R, "pending": Pw,
               "flush_us": _time(flush, cuda, reps), "gather_us": _time(gather, cuda, reps),
               "read_us": _time(lambda: read(torch.stack(states, 1)), cuda, reps),
               "unfused_us": _time(unfused, cuda, reps),
               "fused_us": _time(lambda: reader_triton.state_read(states, pend, q, W), cuda, reps),
               "fused_no_pending_us": _time(lambda: reader_triton.state_read(states, [None] * L, q, W), cuda, reps),
               "state_bytes": L * HV * K * V * 4}
        row["read_only_us"] = row["read_us"] - row["gather_us"]
        row["reduction"] = 1 - row["fused_us"] / row["unfused_us"]
        row["read_reduction"] = 1 - row["fused_no_pending_us"] / row["read_us"]
        rows.append(row)
    return rows


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dict(result.get("suites", {}))
    if len(panels) > 1 and result.get("all_suites"):
        panels["all suites"] = result["all_suites"]
    suites = list(panels)
    fig, axes = plt.subplots(1, max(len(suites), 1), figsize=(4.2 * max(len(suites), 1), 3.4), squeeze=False)
    for ax, suite in zip(axes[0], suites):
        for row, stats in panels[suite].items():
            if row != "paired" and "survival" in stats:
                ax.plot(range(1, P + 1), stats["survival"], marker="o", label=f"{row} (τ {stats['mean_accepted_length']:.2f})")
        ax.set_title(suite)
        ax.set_xlabel("draft position j")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("blocks with the first j accepted")
    fig.suptitle("draft-prefix survival (fully observable blocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(target=None, dspark=None, dspark_ft=None, ready=None, variants: dict | None = None,
        suites=SUITES, n_prompts: int | None = 80, max_new_tokens: int = 256, device: str = "cuda",
        dtype: str = "auto", graphs: bool | None = None, threshold: float = 0.0, delayed: bool = True,
        operator: bool = True, quick: bool = False, max_minutes: float | None = None, out_dir=RESULTS,
        progress: bool = True, rows=ROWS, name: str | None = None, compile: str | None = None) -> dict:
    """Run the benchmark; returns (and writes) the result dict. Drafter directories default to
    <target>/dspark, <target>/dspark-ft, <target>/ready; missing ones are skipped (quick mode:
    random drafters instead, so the smoke test runs anywhere)."""
    import specla.api as api
    from specla.drafters.blocks import find_block_drafter

    t0 = time.time()
    if str(device).startswith("cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel modules are imported
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if quick:
        n_prompts, max_new_tokens = min(n_prompts or 1, 1), min(max_new_tokens, 16)
    lm = api.load(target, device=device, dtype=dtype, compile=compile)
    dev = lm.model.device
    graphs = dev.type == "cuda" if graphs is None else graphs
    stem = name or ("ready" if dev.type == "cuda" else "ready_cpu_smoke")
    paths = {"dspark": dspark, "dspark_ft": dspark_ft, "ready": ready}
    used, drafters = {}, {}
    for row in rows:
        path = paths[row] or find_block_drafter(lm.model_dir, DIRS[row])
        if path is None and not quick:
            continue
        drafters[row] = row_drafter(row, path, lm.model, graphs, threshold, quick)
        used[row] = str(path) if path else "random"
    for name, path in (variants or {}).items():
        drafters[name] = row_drafter(name, path, lm.model, graphs, threshold, quick)
        used[name] = str(path)
    result = {"config": {"target": str(lm.model_dir), "dtype": str(lm.model.dtype), "n_prompts": n_prompts,
                         "max_new_tokens": max_new_tokens, "graphs": graphs, "threshold": threshold,
                         "delayed": delayed, "block_size": P, "quick": quick,
                         "fused": getattr(lm.model, "_fused", None) is not None},
              "drafters": used}
    deadline = t0 + max_minutes * 60 if max_minutes else None
    try:
        result.update(decode_section(lm, drafters, suites, n_prompts, max_new_tokens, graphs, delayed,
                                     out / f"{stem}_log.jsonl", deadline, progress))
    except Exception:  # noqa: BLE001 - the other sections still run
        result["decode_error"] = traceback.format_exc()
    if operator:
        try:
            if dev.type != "cuda":
                from specla import ops

                with ops.backend("triton"):  # the interpreter on CPU
                    result["operator"] = operator_section(dev, True)
            else:
                result["operator"] = operator_section(dev, quick)
        except Exception:  # noqa: BLE001
            result["operator_error"] = traceback.format_exc()
    result["bench_seconds"] = round(time.time() - t0, 1)
    write_results(stem, result, out)
    if result.get("suites"):
        try:
            _plot(result, out / f"{stem}.png")
        except Exception:  # noqa: BLE001
            result["plot_error"] = traceback.format_exc()
    _print(result)
    return result


def _print_paired(label: str, paired: dict) -> None:
    for pair, c in paired.items():
        if "tau_ratio" in c:
            print(f"{label:10s} {pair:22s} tau x{c['tau_ratio']:.3f} [{c['tau_ratio_ci95'][0]:.3f}, "
                  f"{c['tau_ratio_ci95'][1]:.3f}]  tps x{c['tps_ratio']:.3f} [{c['tps_ratio_ci95'][0]:.3f}, "
                  f"{c['tps_ratio_ci95'][1]:.3f}]  ({c['prompts']} prompts)")
            print(f"{'':33s} survival diff by position: " + "  ".join(
                f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]" for d, (lo, hi) in zip(c["survival_diff"], c["survival_diff_ci95"])))


def _print(result: dict) -> None:
    for suite, rows in result.get("suites", {}).items():
        _print_paired(suite, rows.get("paired", {}))
        for row, s in rows.items():
            if row != "paired" and s.get("prompts"):
                print(f"{suite:10s} {row:12s} tps {s['tps']:8.1f}  x AR {s['speedup']:5.2f}  "
                      f"tau {s['mean_accepted_length']:5.2f}  exact {s['exact_match_rate']:.2f}")
    _print_paired("all suites", result.get("pooled", {}))
    for row, s in result.get("all_suites", {}).items():
        if row != "paired" and s.get("survival"):
            print(f"{'all suites':10s} {row:12s} tau {s['mean_accepted_length']:5.2f}  survival "
                  + " ".join(f"{x:.3f}" for x in s["survival"]))
    for r in result.get("operator", []):
        print(f"operator {r['shape']:16s} unfused {r['unfused_us']:9.1f} us  fused {r['fused_us']:9.1f} us  "
              f"({-100 * r['reduction']:+.1f}%)  rel err reads {r['rel_err_reads']:.1e} state {r['rel_err_state']:.1e}")
