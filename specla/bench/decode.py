"""`specla bench decode`: batch-1 target costs at named shapes, eager and in CUDA graphs.

Per shape (random bf16 weights, fp32 state): AR time per token through the decode loop
(eager and graph replay) against the floor of reading the weights once at the measured copy
bandwidth; one speculative round on a 16-draft-node beam tree (verify + greedy acceptance +
the host read of what was accepted + commit; `round16_ms`); and whether the graph path emits
the same tokens as the eager path (AR and an n-gram tree route).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specla.bench.common import RESULTS, copy_bandwidth, write_results
from specla.bench.trees import beam_tree
from specla.decode import Decoder
from specla.drafters.ngram import NgramDrafter
from specla.engine import GraphTarget
from specla.shapes import random_model


def _prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (length // 4,), generator=g).tolist()
    return base * 4  # repeats give the n-gram drafter something to copy


def _time_rounds(model, prompt, parents, rounds: int, delayed: bool = True) -> float:
    """Median ms of one round (verify + accept + host read + commit) in graph replay."""
    n = len(parents)
    tgt = GraphTarget(model, 1, len(prompt) + 4 * rounds * n + 64, n, delayed)
    tgt.prefill(torch.tensor([prompt[:-1]], device=model.device))
    par = torch.tensor([parents], device=model.device)
    g = torch.Generator(device=model.device).manual_seed(0)
    times = []
    for i in range(rounds + 3):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), device=model.device, generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, acc = tgt.verify(tokens, par)
        accepted = acc.length.tolist()  # the loop's one host read per round
        tgt.commit(out.records, acc.path, torch.tensor(accepted, device=model.device), delayed)
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _generate(model, make_drafter, graphs: bool, prompt, new_tokens: int):
    """A timed generation after an untimed one that compiles kernels and captures graphs."""
    targets: dict = {}
    drafter = make_drafter() if make_drafter else None
    Decoder(model, drafter, graphs=graphs, targets=targets).generate(prompt, 8)
    return Decoder(model, drafter, graphs=graphs, targets=targets).generate(prompt, new_tokens)


def _time_ar_steps(model, prompt, steps: int) -> float:
    tgt = GraphTarget(model, 1, len(prompt) + steps + 64, 1, True)
    tgt.prefill(torch.tensor([prompt[:-1]], device=model.device))
    root = torch.tensor([prompt[-1]], device=model.device)
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nxt = tgt.step(root).argmax(-1)
        root = torch.tensor(nxt.tolist(), device=model.device)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def run(shapes=("gdn-1.3b-paper", "gdn-1.3b-paper-hybrid"), new_tokens: int = 64, prompt_len: int = 256,
        rounds: int = 50, out_dir=RESULTS, quick: bool = False) -> dict:
    from rich.console import Console
    from rich.table import Table

    bw = copy_bandwidth()
    rows = []
    for shape in shapes:
        model = random_model(shape, device="cuda", dtype=torch.bfloat16)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        prompt = _prompt(model.cfg.vocab_size, prompt_len)
        eager = _generate(model, None, False, prompt, new_tokens)
        graph = _generate(model, None, True, prompt, new_tokens)
        drafter = lambda: NgramDrafter(length=4, topk=4, budget=16)  # noqa: E731
        tree_eager = _generate(model, drafter, False, prompt, new_tokens)
        tree_graph = _generate(model, drafter, True, prompt, new_tokens)
        parents = beam_tree(4, 4, 16)
        row = {
            "shape": shape, "params": sum(p.numel() for p in model.parameters()),
            "weight_floor_ms": weight_bytes / bw * 1e3,
            "ar_eager_ms_per_token": eager.decode_seconds / len(eager.tokens) * 1e3,
            "ar_graph_ms_per_token": graph.decode_seconds / len(graph.tokens) * 1e3,
            "ar_step_ms": _time_ar_steps(model, prompt, 10 if quick else 100),
            "round16_ms": _time_rounds(model, prompt, parents, 10 if quick else rounds),
            "round16_immediate_ms": _time_rounds(model, prompt, parents, 10 if quick else rounds, delayed=False),
            "graph_equals_eager_ar": graph.tokens == eager.tokens,
            "graph_equals_eager_tree": tree_graph.tokens == tree_eager.tokens,
            "tree_equals_ar": tree_graph.tokens == graph.tokens,
            "tree_graph_ms_per_token": tree_graph.decode_seconds / len(tree_graph.tokens) * 1e3,
            "tree_mean_accepted_length": tree_graph.mean_accepted_length,
        }
        row["round16_over_ar"] = row["round16_ms"] / row["ar_step_ms"]
        row["fused"] = getattr(getattr(model, "_fused", None), "mode", None)
        rows.append(row)
        del model
        torch.cuda.empty_cache()
    table = Table(title="batch-1 decode costs (ms)")
    cols = ["shape", "weight_floor_ms", "ar_eager_ms_per_token", "ar_graph_ms_per_token", "ar_step_ms",
            "round16_ms", "round16_over_ar", "graph_equals_eager_ar", "tree_equals_ar"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    Console().print(table)
    result = {"copy_bandwidth_GBps": bw / 1e9, "new_tokens": new_tokens, "prompt_len": prompt_len, "rows": rows}
    from specla.fused import env_mode

    name = "decode_fused" if env_mode() else "decode"
    write_results(name, result, out_dir)
    plot(result, Path(out_dir) / f"{name}.png")
    return result


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
    ax.set_yticks([i * (len(bars) + 1) + 1.5 for i in range(len(rows))], [r["shape"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms (batch 1, bf16 weights, fp32 state)")
    ax.legend(fontsize=8)
    ax.set_title("target cost per step against the weight-read floor")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
