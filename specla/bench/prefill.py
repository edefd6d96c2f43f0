"""`specla bench prefill`: the time to consume a prompt, by prompt length and prefill mode.

The GPU path (`engine.GraphTarget.prefill`) consumes a prompt in fixed-width chunks, one CUDA
graph replay each, in one of two ways, or eagerly:

- `chain`: 32-token chains (`engine.PREFILL_WIDTH`), each verified and committed (a round's
  arithmetic);
- `sequence`: plain sequences through the fused regions and fla's chunk kernel, each padded to
  the smallest of `engine.SEQUENCE_WIDTHS` that holds it (`engine.prefill_chunks`) and masked;
- `plain`: the model's plain forward (compiled regions under `--compile` / SPECLA_COMPILE).

`GraphTarget` takes `chain` below `engine.SEQUENCE_FROM` tokens and `sequence` from there. This times
every mode at every length on random prompts, from an empty cache (an AR target's prefill,
no features captured): the median of `reps` prefills, CUDA-synchronised, after one untimed
prefill that compiles and captures. `crossover_tokens` is the shortest measured length from
which `sequence` beats `chain` at every longer measured length, the figure to set the switch
from. Writes `<name>.json` and `<name>.png`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from specla.bench.common import RESULTS, write_results

LENGTHS = (16, 32, 64, 128, 256, 511, 512, 1024, 2048, 4096)
MODES = ("chain", "sequence", "plain")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def crossover(rows: list[dict]) -> int | None:
    """The shortest length from which `sequence` is faster than `chain` at every longer
    measured length (both run as asked); None if it never is."""
    ms = {(r["mode"], r["tokens"]): r["ms"] for r in rows if r["used"] == r["mode"]}
    lengths = sorted({t for m, t in ms if m == "sequence"} & {t for m, t in ms if m == "chain"})
    best = None
    for t in reversed(lengths):
        if ms[("sequence", t)] >= ms[("chain", t)]:
            break
        best = t
    return best


def run(model_dir=None, lengths=LENGTHS, modes=MODES, reps: int = 5, device: str = "auto", dtype: str = "auto",
        compile: str | None = None, out_dir=RESULTS, name: str = "prefill", profile: bool = False) -> dict:
    from tqdm import tqdm

    import specla.api as api
    from specla.engine import PREFILL_WIDTH, SEQUENCE_FROM, SEQUENCE_WIDTHS, GraphTarget

    lm = api.load(model_dir, device=device, dtype=dtype, compile=compile)
    model, dev = lm.model, lm.model.device
    W = max(SEQUENCE_WIDTHS)
    max_len = -(-(max(lengths) + W) // 1024) * 1024  # room for the last sequence chunk's padding
    target = GraphTarget(model, 1, max_len, 1, False)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in tqdm(lengths, desc="prefill lengths", unit="length"):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, T), generator=gen).to(dev)
        for mode in modes:
            times = []
            for r in range(reps + 1):  # the first compiles and captures: untimed
                target.reset()
                _sync(dev)
                t0 = time.perf_counter()
                target.prefill(tokens, mode=mode)
                _sync(dev)
                if r:
                    times.append(1e3 * (time.perf_counter() - t0))
            ms = statistics.median(times)
            rows.append({"mode": mode, "used": target.prefill_mode(T, mode), "tokens": T, "ms": ms,
                         "ms_min": min(times), "us_per_token": 1e3 * ms / T})
            if profile and dev.type == "cuda":  # kernels and GPU time of one prefill (3 profiled)
                from specla.bench.decode import profile_fn

                rows[-1]["profile"] = profile_fn(lambda: (target.reset(), target.prefill(tokens, mode=mode)), 3,
                                                  dev, top=30)
    result = {"model": str(lm.model_dir), "dtype": str(model.dtype).replace("torch.", ""), "compile": compile,
              "fused": getattr(getattr(model, "_fused", None), "mode", None), "reps": reps,
              "chain_width": PREFILL_WIDTH, "sequence_widths": list(SEQUENCE_WIDTHS),
              "switch_tokens": SEQUENCE_FROM, "crossover_tokens": crossover(rows), "rows": rows}
    out = Path(out_dir)
    result = json.loads(write_results(name, result, out).read_text())  # with device, versions, commit, date
    _plot(result, out / f"{name}.png")
    _print(result)
    return result


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    t = Table(title=f"prefill ms by prompt length ({result['device']}, {result['dtype']}; median of "
                    f"{result['reps']}; * = ran plain: not capturable here)")
    t.add_column("tokens")
    for m in modes:
        t.add_column(m)
    for T in sorted({r["tokens"] for r in result["rows"]}):
        cells = {r["mode"]: f"{r['ms']:.2f}" + ("*" if r["used"] != r["mode"] else "")
                 for r in result["rows"] if r["tokens"] == T}
        t.add_row(str(T), *(cells.get(m, "") for m in modes))
    Console(width=120).print(t)
    print(f"switch now at {result['switch_tokens']} tokens; sequence beats chain from "
          f"{result['crossover_tokens']} tokens on (measured lengths)")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in dict.fromkeys(r["mode"] for r in result["rows"]):
        pts = sorted((r["tokens"], r["ms"]) for r in result["rows"] if r["mode"] == mode)
        ax.plot(*zip(*pts), marker="o", label=mode)
    ax.axvline(result["switch_tokens"], color="grey", ls=":", label="chain → sequence switch")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="prefill ms (median)",
           title=f"prefill by mode, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
