"""`specla bench decode`: batch-1 target costs at named shapes, eager and in CUDA graphs.

Per shape (random bf16 weights, fp32 state): AR time per token through the decode loop
(eager and graph replay) against the floor of reading the weights once at the measured copy
bandwidth; one speculative round on a 16-draft-node beam tree of depth 4 (verify + greedy
acceptance + settling + commit in one graph, `GraphTarget.round`, plus the host read of its
report; pending buffers of the 5 nodes a path can hold, as the loop sizes them for such a
drafter; `round16_ms`; `round16_serial_verify_ms`: the same round with the tree on the serial verifier,
the dispatch's choice before the parallel one); whether the graph path emits the same tokens
as the eager path (AR and an n-gram tree route); and, fused, how far the fused path's logits are
from the plain path's on this GPU, in bf16 and in an fp32 copy of the model (`fused_vs_plain`,
`fused_vs_plain_fp32`: prefill, AR step, 16-node verify).

`profile=True` (`--profile`) adds, per shape, a torch.profiler view of ~5 eager AR steps and
~5 eager 16-node rounds (verify + acceptance + delayed commit): kernels launched per step, GPU
kernel time per step and the top kernels by time (row key "profile"; plain path, and the
fused one when SPECLA_COMPILE is set).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specla import ops
from specla.bench.common import RESULTS, copy_bandwidth, median, write_results
from specla.bench.trees import beam_tree
from specla.decode import Decoder, _sync
from specla.drafters.ngram import NgramDrafter
from specla.engine import EagerTarget, GraphTarget
from specla.shapes import random_model
from specla.topology import depths


def _prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (length // 4,), generator=g).tolist()
    return base * 4  # repeats give the n-gram drafter something to copy


def _target(model, max_len: int, budget: int, delayed: bool, path_nodes: int | None = None):
    """The decode loop's target: CUDA graphs on a GPU, eager elsewhere (a CPU smoke run).
    path_nodes: the longest path a round can accept (`Drafter.max_path`), None for the budget."""
    if model.device.type == "cuda":
        return GraphTarget(model, 1, max_len, budget, delayed, path_nodes=path_nodes)
    return EagerTarget(model, 1, max_len, path_nodes=path_nodes)


def round_runner(model, prompt, parents, rounds: int, delayed: bool = True, propose=None):
    """(draw, run, target) for up to `rounds` rounds after `prompt`: draw puts a random draft of the
    topology `parents` in buffers of its own, read where they are (`static`), as the loop reads
    a drafter graph's outputs (no staging copies); run is one round as the decode loop runs it
    (`GraphTarget.round`: verify, accept, settle, commit in one graph replay) plus reading its
    report, the loop's one host read, which it returns. propose: a function giving the draft
    nodes' tokens [n - 1] instead of random ones. The target keeps paths as long as the
    topology's deepest (root included), as the loop does for a drafter of that depth
    (`Drafter.max_path`): a 16-node depth-4 tree's pending buffers hold 5 rows, not 17."""
    n, dev = len(parents), model.device
    longest = int(depths(torch.tensor([parents])).max()) + 1
    tgt = _target(model, len(prompt) + 4 * rounds * n + 64, n, delayed, longest)
    tgt.prefill(torch.tensor([prompt[:-1]], device=dev))
    tgt.begin(torch.tensor([prompt[-1]], device=dev), 4 * rounds * n, set())
    tokens, par = torch.zeros(1, n, dtype=torch.long, device=dev), torch.tensor([parents], device=dev)
    valid = torch.full((1,), n, dtype=torch.long, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)

    def draw():
        tokens.copy_(torch.randint(0, model.cfg.vocab_size, (1, n), device=dev, generator=g))
        if propose is not None:
            tokens[0, 1:] = torch.as_tensor(propose(), device=dev)
        tokens[:, 0] = tgt.next_root

    def run():
        return tgt.round(tokens, par, valid=valid, delayed=delayed, static=True).report.tolist()

    return draw, run, tgt


WARMUP_CALLS = 3  # untimed calls before a timing's samples


def _elapsed_ms(fn, dev, before=None) -> float:
    """ms of `fn()` (which reads its report, so ends synchronised), after `before()` and a sync."""
    if before is not None:
        before()
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_rounds(model, prompt, parents, rounds: int, delayed: bool = True) -> float:
    """Median ms of one round (`round_runner`'s run), each round on its own."""
    dev = model.device
    draw, run, _ = round_runner(model, prompt, parents, rounds + WARMUP_CALLS, delayed)
    times = [_elapsed_ms(lambda: (run(), _sync(dev)), dev, draw) for _ in range(rounds + WARMUP_CALLS)]
    return median(times[WARMUP_CALLS:])


def time_round_pairs(model, prompt, parents, pairs: int) -> dict:
    """One AR step (`ar_runner`) and one round (`round_runner`) timed back to back, `pairs`
    times: the medians of each and of the per-pair ratio round ÷ AR step. `time_ar_steps` then
    `time_rounds` measure minutes apart, and between calls their ratio moved by as much as it
    missed its goal by (~1.5%, clocks). Both calls of a pair start alike (a draft drawn, the
    device synchronised) and take turns going first, so neither always follows the other."""
    dev = model.device
    ar = ar_runner(model, prompt, pairs + WARMUP_CALLS)
    draw, run, _ = round_runner(model, prompt, parents, pairs + WARMUP_CALLS)
    ars, rounds = [], []
    for i in range(pairs + WARMUP_CALLS):
        if i % 2:
            r, a = _elapsed_ms(run, dev, draw), _elapsed_ms(ar, dev, draw)
        else:
            a, r = _elapsed_ms(ar, dev, draw), _elapsed_ms(run, dev, draw)
        ars.append(a)
        rounds.append(r)
    ars, rounds = ars[WARMUP_CALLS:], rounds[WARMUP_CALLS:]
    return {"pairs": pairs, "ar_ms": median(ars), "round_ms": median(rounds),
            "ratio": median([r / a for r, a in zip(rounds, ars)])}


def _generate(model, make_drafter, graphs: bool, prompt, new_tokens: int):
    """A timed generation after an untimed one that compiles kernels and captures graphs."""
    targets: dict = {}
    drafter = make_drafter() if make_drafter else None
    Decoder(model, drafter, graphs=graphs, targets=targets).generate(prompt, 8)
    return Decoder(model, drafter, graphs=graphs, targets=targets).generate(prompt, new_tokens)


def ar_runner(model, prompt, steps: int):
    """One greedy AR step after `prompt` (`GraphTarget.ar_round`) plus reading its report, for
    up to `steps` steps."""
    dev = model.device
    tgt = _target(model, len(prompt) + steps + 64, 1, True)
    tgt.prefill(torch.tensor([prompt[:-1]], device=dev))
    tgt.begin(torch.tensor([prompt[-1]], device=dev), steps, set())
    return lambda: tgt.ar_round().tolist()


def time_ar_steps(model, prompt, steps: int) -> float:
    """Median ms of one greedy AR step (`ar_runner`)."""
    dev = model.device
    run = ar_runner(model, prompt, steps + WARMUP_CALLS)
    times = [_elapsed_ms(run, dev) for _ in range(steps + WARMUP_CALLS)]
    return median(times[WARMUP_CALLS:])


def _is_gpu(dev) -> bool:
    return dev is not None and "CUDA" in str(dev).upper()


def _gpu_events(prof) -> list[tuple[str, float]]:
    """(name, µs) of every GPU activity (kernels, memsets, memcpys) the profiler recorded:
    from kineto's raw events if reachable, else from the parsed FunctionEvents; names may be
    missing ('?')."""
    out = []
    try:
        for e in prof.profiler.kineto_results.events():
            if _is_gpu(e.device_type()):
                dur = e.duration_ns() / 1e3 if hasattr(e, "duration_ns") else float(e.duration_us())
                out.append((str(e.name() or "?"), float(dur)))
        if out:
            return out
    except Exception:  # noqa: BLE001 - private API; fall back to the parsed events
        out = []
    for e in prof.events() or []:
        if not _is_gpu(getattr(e, "device_type", None)):
            continue
        tr = getattr(e, "time_range", None)
        us = float(tr.end - tr.start) if tr is not None else float(getattr(e, "device_time", 0.0) or 0.0)
        out.append((str(getattr(e, "name", None) or "?"), us))
    return out


def profile_fn(fn, steps: int, device, top: int = 40) -> dict:
    """Profile `steps` calls of fn (CUDA activities): per-step kernel count, GPU time, the `top`
    kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm (compiles, plans, allocator)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    events = _gpu_events(prof)
    agg: dict = {}
    for name, us in events:
        c = agg.setdefault(name, [0, 0.0])
        c[0] += 1
        c[1] += us
    ranked = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    mem = sum(n for name, (n, _) in agg.items() if name.lower().startswith(("memset", "memcpy")))
    return {
        "steps": steps,
        "kernels_per_step": len(events) / steps,
        "memset_memcpy_per_step": mem / steps,
        "gpu_us_per_step": sum(us for _, us in events) / steps,
        "distinct_kernels": len(agg),
        "top": [{"name": name[:90], "count_per_step": n / steps, "us_per_step": us / steps}
                for name, (n, us) in ranked],
        **({} if events else {"note": "the profiler recorded no GPU activity (CUPTI unavailable?)"}),
    }


def _profile_shape(model, prompt, parents, steps: int = 5) -> dict:
    """Eager AR steps and eager 16-node rounds (delayed commit) under torch.profiler, for the
    plain path and, when the model is fused, the fused one."""
    dev = model.device
    fused = getattr(model, "_fused", None)
    n = len(parents)
    paths = {"plain": None} | ({"fused": fused} if fused is not None else {})
    out = {}
    for label, fz in paths.items():
        res = {}
        try:
            ar = EagerTarget(model, 1, len(prompt) + 4 * steps + 64)
            model._fused = fz  # after the target is built: it may fuse the model itself
            ar.prefill(torch.tensor([prompt[:-1]], device=dev))
            root = torch.tensor([prompt[-1]], device=dev)
            res["ar_step"] = profile_fn(lambda: ar.step(root), steps, dev)
            ar = None  # free its cache before the next target
            model._fused = fused  # as built: a target fuses an unfused model under SPECLA_COMPILE
            tgt = EagerTarget(model, 1, len(prompt) + 4 * (steps + 1) * n + 64)
            model._fused = fz
            tgt.prefill(torch.tensor([prompt[:-1]], device=dev))
            par = torch.tensor([parents], device=dev)
            tokens = torch.randint(0, model.cfg.vocab_size, (1, n), device=dev,
                                   generator=torch.Generator(device=dev).manual_seed(0))

            def round_():
                o, acc = tgt.verify(tokens, par)
                length = torch.tensor(acc.length.tolist(), device=dev)  # the loop's host read
                tgt.commit(o.records, acc.path, length, True)

            res["round16_delayed"] = profile_fn(round_, steps, dev)
            tgt = None
        except Exception as e:  # noqa: BLE001 - a profile is optional; the timings stand
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            model._fused = fused
        out[label] = res
    return out


def _print_profiles(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for r in rows:
        for label, res in (r.get("profile") or {}).items():
            if "error" in res:
                con.print(f"[profile {r['shape']} {label}] failed: {res['error']}")
            for what in ("ar_step", "round16_delayed"):
                p = res.get(what)
                if not p:
                    continue
                t = Table(title=f"{r['shape']} {label} {what}: {p['kernels_per_step']:.0f} GPU ops/step "
                                f"({p['memset_memcpy_per_step']:.0f} memset/memcpy), "
                                f"{p['gpu_us_per_step']:.0f} us GPU time/step (eager)")
                for c in ("kernel", "per step", "us/step"):
                    t.add_column(c)
                for k in p["top"]:
                    t.add_row(k["name"][:70], f"{k['count_per_step']:.1f}", f"{k['us_per_step']:.1f}")
                con.print(t)


def run(shapes=("gdn-1.3b-paper", "gdn-1.3b-paper-hybrid"), new_tokens: int = 64, prompt_len: int = 256,
        rounds: int = 50, out_dir=RESULTS, quick: bool = False, profile: bool = False,
        device: str = "cuda", gemvs=("cublas",), name: str | None = None) -> dict:
    """`gemvs`: with the fused path (SPECLA_COMPILE), one row per shape and way of running the
    AR step's single-row matmuls (`fused.GEMVS`), timed in this run. `name`: the result file
    stem (default decode, or decode_fused on the fused path)."""
    from specla.fused import GEMVS, env_mode

    mode = env_mode()
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"bench decode times CUDA graphs: --device must be a CUDA device, got {device!r}")
    bad = [g for g in gemvs if g not in GEMVS]
    if bad or not gemvs or (tuple(gemvs) != ("cublas",) and mode is None):
        raise ValueError(f"--gemv takes {', '.join(GEMVS)} (anything but cublas needs SPECLA_COMPILE), got {gemvs}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(dev):  # copy_bandwidth, streams, Triton launches: the chosen GPU
        return _run(shapes, new_tokens, prompt_len, rounds, out_dir, quick, profile, dev, tuple(gemvs), mode, name)


@torch.no_grad()
def _fused_vs_plain(model, prompt, parents) -> dict:
    """The fused path's kernels on this GPU against the plain path, same weights: logits of the
    prompt's last position, of one AR step after it and of a verify of `parents` after that,
    max |difference| over the plain logits' max |value|, and whether their argmaxes agree."""
    fused, dev = model._fused, model.device
    tokens = torch.tensor([prompt], device=dev)
    step = tokens[:, -1:]
    par = torch.tensor([list(parents)], device=dev)
    draft = torch.randint(0, model.cfg.vocab_size, par.shape, device=dev,
                          generator=torch.Generator(device=dev).manual_seed(1))
    out = {}
    for name, f in (("plain", None), ("fused", fused)):
        model._fused = f
        cache = model.new_cache(1, len(prompt) + 64)
        pre = model.forward(tokens, cache).logits[:, -1:]
        ar = model.forward(step, cache).logits
        ver = model.verify(draft, par, cache).logits
        out[name] = {"prefill": pre.float(), "ar_step": ar.float(), "verify16": ver.float()}
    model._fused = fused
    res = {}
    for k, ref in out["plain"].items():
        got = out["fused"][k]
        res[k] = {"max_rel_diff": float((got - ref).abs().max() / ref.abs().max()),
                  "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}
    return res


def _run(shapes, new_tokens, prompt_len, rounds, out_dir, quick, profile, dev, gemvs, mode, name) -> dict:
    """`mode`: the fused path's (`SPECLA_COMPILE`), or None for the plain path."""
    from rich.console import Console
    from rich.table import Table

    from specla.fused import fuse

    bw = copy_bandwidth()
    rows = []
    for shape, gemv in ((s, g) for s in shapes for g in gemvs):
        model = random_model(shape, device=dev, dtype=torch.bfloat16)
        if mode is not None:
            fuse(model, mode=mode, gemv=gemv)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        prompt = _prompt(model.cfg.vocab_size, prompt_len)
        eager = _generate(model, None, False, prompt, new_tokens)
        graph = _generate(model, None, True, prompt, new_tokens)
        drafter = lambda: NgramDrafter(length=4, topk=4, budget=16)  # noqa: E731
        tree_eager = _generate(model, drafter, False, prompt, new_tokens)
        tree_graph = _generate(model, drafter, True, prompt, new_tokens)
        parents = beam_tree(4, 4, 16)
        row = {
            "shape": shape, "gemv": gemv, "params": sum(p.numel() for p in model.parameters()),
            "weight_floor_ms": weight_bytes / bw * 1e3,
            "ar_eager_ms_per_token": eager.decode_seconds / len(eager.tokens) * 1e3,
            "ar_graph_ms_per_token": graph.decode_seconds / len(graph.tokens) * 1e3,
            "ar_step_ms": time_ar_steps(model, prompt, 10 if quick else 100),
            "round16_ms": time_rounds(model, prompt, parents, 10 if quick else rounds),
            "round16_immediate_ms": time_rounds(model, prompt, parents, 10 if quick else rounds, delayed=False),
            "graph_equals_eager_ar": graph.tokens == eager.tokens,
            "graph_equals_eager_tree": tree_graph.tokens == tree_eager.tokens,
            "tree_equals_ar": tree_graph.tokens == graph.tokens,
            "tree_graph_ms_per_token": tree_graph.decode_seconds / len(tree_graph.tokens) * 1e3,
            "tree_mean_accepted_length": tree_graph.mean_accepted_length,
        }
        row["round16_over_ar"] = row["round16_ms"] / row["ar_step_ms"]
        # the same round with the tree verified by the serial kernel (exact mode's, and the
        # dispatch's choice before the parallel verifier), timed in the same run
        row["tree_verifier"] = ops.TREE_VERIFIER
        old, ops.TREE_VERIFIER = ops.TREE_VERIFIER, "serial"
        try:
            row["round16_serial_verify_ms"] = time_rounds(model, prompt, parents, 10 if quick else rounds)
        finally:
            ops.TREE_VERIFIER = old
        row["fused"] = getattr(getattr(model, "_fused", None), "mode", None)
        if row["fused"] is not None:
            row["fused_vs_plain"] = _fused_vs_plain(model, prompt, parents)
            # in fp32 the two paths differ by accumulation order only: a kernel bug shows here
            f32 = fuse(random_model(shape, device=dev, dtype=torch.float32), mode=mode, gemv=gemv)
            row["fused_vs_plain_fp32"] = _fused_vs_plain(f32, prompt, parents)
            del f32
        if profile:
            t0 = time.perf_counter()
            row["profile"] = _profile_shape(model, prompt, parents)
            row["profile_seconds"] = time.perf_counter() - t0
        rows.append(row)
        del model
        torch.cuda.empty_cache()
    if profile:
        _print_profiles(rows)
    table = Table(title="batch-1 decode costs (ms)")
    cols = ["shape", "gemv", "weight_floor_ms", "ar_eager_ms_per_token", "ar_graph_ms_per_token", "ar_step_ms",
            "round16_ms", "round16_serial_verify_ms", "round16_over_ar", "graph_equals_eager_ar", "tree_equals_ar"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    console = Console()
    console.print(table)
    result = {"copy_bandwidth_GBps": bw / 1e9, "new_tokens": new_tokens, "prompt_len": prompt_len,
              "cuda_device": str(dev), "rows": rows}  # "device" is the GPU's name (write_results)
    name = name or ("decode_fused" if mode else "decode")
    write_results(name, result, out_dir)
    plot(result, Path(out_dir) / f"{name}.png")
    for line in _check_lines(rows):
        console.print(line)
    return result


def _check_lines(rows) -> list[str]:
    """The fused-vs-plain checks of each row, one line per precision."""
    return [f"{r['shape']} ({r['gemv']}) {key}: " + ", ".join(
                f"{k} max rel diff {v['max_rel_diff']:.2e}, argmax agree {v['argmax_agree']:.0%}"
                for k, v in r[key].items())
            for r in rows for key in ("fused_vs_plain", "fused_vs_plain_fp32") if key in r]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("weight_floor_ms", "weights / bandwidth"), ("ar_step_ms", "AR step (graph)"),
            ("round16_ms", "16-node round (delayed)"), ("round16_immediate_ms", "16-node round (immediate)")]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    rows = result["rows"]
    for j, (key, label) in enumerate(bars):
        ax.barh([i * (len(bars) + 1) + j for i in range(len(rows))], [r[key] for r in rows], color=f"C{j}",
                label=label)
    several = len({r.get("gemv") for r in rows}) > 1  # rows per shape and gemv
    ax.set_yticks([i * (len(bars) + 1) + 1.5 for i in range(len(rows))],
                  [r["shape"] + (f", gemv {r['gemv']}" if several else "") for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms (batch 1, bf16 weights, fp32 state)")
    ax.legend(fontsize=8)
    ax.set_title("target cost per step against the weight-read floor")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
