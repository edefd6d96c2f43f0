"""`specla bench controlled`: speedup under synthetic acceptance (SpecLA §8.5, Fig 12).

Costs are measured, acceptance is not. At a named shape with random weights:

- AR: one step replayed from a CUDA graph, plus the argmax and the host read of the token
  (`ar_ms_per_token`), the baseline of every ratio;
- the drafter: an EAGLE-shaped stand-in with random weights — `EagleDrafterModel` built by
  `EagleConfig.for_target` (one decoder layer at the target's width, the target's LM head) —
  drafting a chain of L tokens for real each round (`EagleDrafter`, top-1 rollout replayed
  from its CUDA graph), and taking the accepted tokens' target features afterwards
  (`EagleDrafter.extend`, captured in a CUDA graph here; the decode loop runs it eagerly);
- the target: `GraphTarget`'s real verify (+ greedy acceptance) of the (L+1)-node chain, the
  one host read of what was accepted, and the real commit (delayed), with the accepted length
  forced to the sampled one.

Per chain length L = 5..12 and acceptance probability p = 0.5..1.0, each round's accepted
count is sampled: every draft token is accepted independently with probability p until the
first rejection (a ~ truncated geometric, τ = a + 1 tokens emitted). R rounds run back to
back (rewound every 30 rounds, untimed, so the caches keep a realistic size); speedup = AR
ms/token ÷ (total round time ÷ tokens emitted); `speedup_expected` uses the expected τ
instead of the sampled one (the same measured times, no sampling noise). Because tokens are forced,
only latency ratios mean anything here (no output is checked). `round16_ms` is one
16-draft-node beam-tree round (verify + accept + host read + commit), the figure whose goal
is ≤ 1.2× an AR step. Writes `controlled.json` and the Fig 12 heatmap `controlled.png`.

On CPU (`device="cpu"`, `quick=True`) everything runs eagerly at tiny shapes: a smoke test;
the timings mean nothing.
"""

from __future__ import annotations

import gc
import math
import random
import time
from pathlib import Path

import torch

from specla import topology
from specla.bench.common import RESULTS, copy_bandwidth, write_results
from specla.bench.trees import beam_tree
from specla.drafters.eagle import EagleConfig, EagleDrafter, EagleDrafterModel
from specla.engine import EagerTarget, GraphTarget
from specla.fused import env_mode as fused_env_mode
from specla.graphs import capture as capture_graph
from specla.shapes import random_model

PS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LENGTHS = tuple(range(5, 13))
WARMUP = 3


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def random_drafter(target, seed: int = 1) -> EagleDrafterModel:
    """The EAGLE stand-in: the drafter a target of this width gets, with random weights scaled
    like a trained one (the target's embedding and LM head are shared, as in a real drafter)."""
    cfg = EagleConfig.for_target(target.cfg)
    dev = target.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.device(dev):
        dm = EagleDrafterModel(cfg)
    with torch.no_grad():
        for p in dm.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return dm.to(target.dtype).eval()


def sample_accepted(p: float, L: int, rng: random.Random) -> int:
    """Draft tokens accepted in one round: each with probability p until the first rejection."""
    a = 0
    while a < L and rng.random() < p:
        a += 1
    return a


def expected_tau(p: float, L: int) -> float:
    """E[a + 1] of the process above: 1 + p + ... + p^L."""
    return float(L + 1) if p >= 1 else (1 - p ** (L + 1)) / (1 - p)


def _target(model, budget: int, max_len: int, graphs: bool):
    return GraphTarget(model, 1, max_len, budget, True) if graphs else EagerTarget(model, 1, max_len)


class ChainRuntime:
    """One chain length L: drafter, target and static buffers; `round(a)` runs one full round
    and forces `a` accepted drafts."""

    def __init__(self, model, dm: EagleDrafterModel, L: int, prompt: list[int], max_len: int,
                 capacity: int, graphs: bool):
        dev = model.device
        self.model, self.L, self.graphs, self.dev = model, L, graphs, dev
        self.drafter = EagleDrafter(dm, model, topk=1, depth=L, graphs=graphs, initial_capacity=capacity)
        self.drafter.reset(1)
        self.target = _target(model, L + 1, max_len, graphs)
        self.capture = self.drafter.capture
        pre = torch.tensor([prompt[:-1]], device=dev)
        out = self.target.prefill(pre, self.capture)
        self.drafter.extend(pre, out.hidden, torch.full((1,), pre.shape[1], device=dev))
        self.root = torch.tensor([prompt[-1]], device=dev)
        self.parents = topology.chain(L + 1, device=dev)
        self.path = torch.arange(L + 1, device=dev)[None]
        self._extend_graph = None
        self.mark()

    def mark(self) -> None:
        """Remember the lengths after prefill; `rewind` returns to them (the caches keep their
        size however many rounds run)."""
        d = self.drafter
        self._saved = (d.len.clone(), d.pending.clone(), self.target.cache.length.clone(), self.root.clone())

    def rewind(self) -> None:
        d = self.drafter
        for t, s in zip((d.len, d.pending, self.target.cache.length, self.root), self._saved):
            t.copy_(s)
        d._bound = int(d.len.max())

    # the pieces of a round --------------------------------------------------------------------
    def draft(self) -> torch.Tensor:
        d = self.drafter
        tokens, _, _ = d._replay(self.root) if self.graphs else d.draft(self.root, d.k, d.v)
        return tokens  # top-1 rollout: the root and the chain, depth order

    def verify(self, tokens):
        return self.target.verify(tokens, self.parents, self.capture)

    def commit(self, out, a: int) -> torch.Tensor:
        length = torch.tensor([a + 1], device=self.dev)  # forced: root + a drafts
        self.target.commit(out.records, self.path, length, True)
        return length

    def extend(self, tokens, hidden, length) -> None:
        d = self.drafter
        if not self.graphs:
            d.extend(tokens, hidden, length)
            return
        if self._extend_graph is None:
            self._x = (tokens.clone(), length.clone())
            saved = (d.len.clone(), d.pending.clone())
            d._bound = int(d.len.max())  # no host read inside the capture
            self._extend_graph = capture_graph(lambda: d.extend(self._x[0], hidden, self._x[1]))
            d.len.copy_(saved[0])
            d.pending.copy_(saved[1])
        self._x[0].copy_(tokens)
        self._x[1].copy_(length)
        self._extend_graph.replay()

    def round(self, a: int) -> None:
        tokens = self.draft()
        out, acc = self.verify(tokens)
        torch.cat([acc.length, acc.bonus, tokens[0]]).tolist()  # the round's one host read
        length = self.commit(out, a)
        # hidden of a chain's accepted path = the first a+1 nodes' (extend reads only those)
        self.extend(tokens, out.hidden, length)
        self.root.copy_(tokens[:, a + 1] if a < self.L else acc.bonus)

    def components(self, reps: int) -> dict:
        """Median ms of each piece (synchronised between pieces), a = L (every draft accepted)."""
        t = {k: [] for k in ("draft", "verify", "host_read", "commit", "extend")}
        for _ in range(reps):
            _sync(self.dev)
            t0 = time.perf_counter()
            tokens = self.draft()
            _sync(self.dev)
            t1 = time.perf_counter()
            out, acc = self.verify(tokens)
            _sync(self.dev)
            t2 = time.perf_counter()
            torch.cat([acc.length, acc.bonus, tokens[0]]).tolist()
            t3 = time.perf_counter()
            length = self.commit(out, self.L)
            _sync(self.dev)
            t4 = time.perf_counter()
            self.extend(tokens, out.hidden, length)
            _sync(self.dev)
            t5 = time.perf_counter()
            self.root.copy_(acc.bonus)
            for k, (a, b) in zip(t, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                t[k].append((b - a) * 1e3)
        return {f"{k}_ms": _median(v) for k, v in t.items()}

    def timed(self, accepted: list[int], chunk: int) -> float:
        """Total ms of back-to-back rounds with these accepted counts (after WARMUP untimed ones),
        timed in runs of `chunk` rounds with an untimed rewind between runs (bounded caches)."""
        self.rewind()
        for a in accepted[:WARMUP]:
            self.round(a)
        total = 0.0
        for s in range(WARMUP, len(accepted), chunk):
            if s > WARMUP:
                self.rewind()
            _sync(self.dev)
            t0 = time.perf_counter()
            for a in accepted[s:s + chunk]:
                self.round(a)
            _sync(self.dev)
            total += (time.perf_counter() - t0) * 1e3
        return total


def time_ar(model, prompt: list[int], steps: int, graphs: bool) -> float:
    """Median ms of one AR step: graph replay + argmax + the host read of the token."""
    dev = model.device
    tgt = _target(model, 1, len(prompt) + steps + 64, graphs)
    tgt.prefill(torch.tensor([prompt[:-1]], device=dev))
    root = torch.tensor([prompt[-1]], device=dev)
    times = []
    for i in range(steps + WARMUP):
        _sync(dev)
        t0 = time.perf_counter()
        nxt = tgt.step(root).argmax(-1)
        root = torch.tensor(nxt.tolist(), device=dev)
        _sync(dev)
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    return _median(times)


def time_round16(model, prompt: list[int], rounds: int, graphs: bool) -> float:
    """Median ms of one 16-draft-node beam-tree round: verify + accept + host read + commit."""
    dev = model.device
    parents = beam_tree(4, 4, 16)
    n = len(parents)
    tgt = _target(model, n, len(prompt) + (rounds + WARMUP) * n + 64, graphs)
    tgt.prefill(torch.tensor([prompt[:-1]], device=dev))
    par = torch.tensor([parents], device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    times = []
    for i in range(rounds + WARMUP):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), device=dev, generator=g)
        _sync(dev)
        t0 = time.perf_counter()
        out, acc = tgt.verify(tokens, par)
        accepted = acc.length.tolist()
        tgt.commit(out.records, acc.path, torch.tensor(accepted, device=dev), True)
        _sync(dev)
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    return _median(times)


def run(shape: str = "gdn-1.3b-paper", device: str = "cuda", dtype: torch.dtype | None = None,
        ps=PS, lengths=LENGTHS, rounds: int = 90, prompt_len: int = 256, quick: bool = False,
        compile: str | None = None, dynamic_tokens: bool = True, seed: int = 0, out_dir=RESULTS) -> dict:
    """The controlled study; `compile` ('default' / 'max-autotune') fuses the target
    (`Model.fuse`), as does SPECLA_COMPILE. Fused, `dynamic_tokens` compiles one verify graph
    per region for all chain lengths (else one per length: 8 times the compile time)."""
    dev = torch.device(device)
    graphs = dev.type == "cuda"
    dtype = dtype or (torch.bfloat16 if graphs else torch.float32)
    if quick:
        rounds = min(rounds, 4)
        prompt_len = min(prompt_len, 32)
    model = random_model(shape, device=dev, dtype=dtype, seed=seed)
    mode = compile or fused_env_mode()
    if mode:
        model.fuse(mode=mode, dynamic_tokens=dynamic_tokens)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth() if graphs else None

    ar_ms = time_ar(model, prompt, 20 if quick else 200, graphs)
    round16 = time_round16(model, prompt, 5 if quick else 100, graphs)
    dm = random_drafter(model, seed + 1)
    total = rounds + WARMUP
    chunk = 30  # rounds between rewinds: the drafter's KV cache stays near its real size
    grow = (min(chunk, rounds) + WARMUP) * (max(lengths) + 1)
    capacity = 1 << math.ceil(math.log2(prompt_len + grow + max(lengths) + 16))
    max_len = prompt_len + grow + 64
    grid, per_length = [], []
    for L in lengths:
        rt = ChainRuntime(model, dm, L, prompt, max_len, capacity, graphs)
        rt.round(L)  # captures every graph (and compiles, when fused) outside the timings
        rt.rewind()
        comp = rt.components(3 if quick else 20)
        per_length.append({"L": L, **comp})
        for p in ps:
            rng = random.Random(hash((seed, L, round(p * 100))) & 0xFFFFFFFF)
            accepted = [sample_accepted(p, L, rng) for _ in range(total)]
            ms = rt.timed(accepted, chunk)
            tokens = sum(a + 1 for a in accepted[WARMUP:])
            tau = expected_tau(p, L)
            grid.append({"p": p, "L": L, "speedup": ar_ms * tokens / ms, "tau": tokens / rounds,
                         "round_ms": ms / rounds, "ms_per_token": ms / tokens, "expected_tau": tau,
                         # the same measured round time at the expected τ (no sampling noise)
                         "speedup_expected": ar_ms * tau / (ms / rounds)})
        del rt
        gc.collect()
        if graphs:
            torch.cuda.empty_cache()
    fused = getattr(model, "_fused", None)
    result = {
        "shape": shape, "dtype": str(dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()),
        "drafter_params": sum(p.numel() for p in dm.parameters()), "graphs": graphs,
        "fused": fused.mode if fused is not None else None,
        "fused_dynamic_tokens": fused.dynamic_tokens if fused is not None else None,
        "weight_floor_ms": weight_bytes / bw * 1e3 if bw else None,
        "copy_bandwidth_GBps": bw / 1e9 if bw else None,
        "ar_ms_per_token": ar_ms, "round16_ms": round16, "round16_over_ar": round16 / ar_ms,
        "rounds": rounds, "prompt_len": prompt_len, "drafter_kv_capacity": capacity,
        "acceptance": "sampled: each draft token accepted with probability p until the first rejection",
        "per_length": per_length, "grid": grid,
    }
    _print(result)
    write_results("controlled", result, out_dir)
    plot(result, Path(out_dir) / "controlled.png")
    return result


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ps = sorted({c["p"] for c in result["grid"]})
    Ls = sorted({c["L"] for c in result["grid"]})
    cell = {(c["p"], c["L"]): c["speedup"] for c in result["grid"]}
    table = Table(title=f"speedup over AR ({result['ar_ms_per_token']:.3f} ms/token), {result['shape']}, "
                        f"16-node round {result['round16_ms']:.3f} ms = {result['round16_over_ar']:.2f}x AR")
    table.add_column("p \\ L")
    for L in Ls:
        table.add_column(str(L))
    for p in reversed(ps):
        table.add_row(f"{p:.1f}", *[f"{cell[(p, L)]:.2f}" for L in Ls])
    comp = Table(title="round pieces at a = L (ms, median)")
    keys = [k for k in result["per_length"][0] if k != "L"]
    comp.add_column("L")
    for k in keys:
        comp.add_column(k.removesuffix("_ms"))
    for r in result["per_length"]:
        comp.add_row(str(r["L"]), *[f"{r[k]:.3f}" for k in keys])
    Console().print(table)
    Console().print(comp)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    ps = sorted({c["p"] for c in result["grid"]})
    Ls = sorted({c["L"] for c in result["grid"]})
    cell = {(c["p"], c["L"]): c["speedup"] for c in result["grid"]}
    data = [[cell[(p, L)] for L in Ls] for p in ps]
    lo, hi = min(map(min, data)), max(map(max, data))
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(Ls), 1.2 + 0.5 * len(ps)))
    im = ax.imshow(data, origin="lower", cmap="RdYlGn", norm=norm, aspect="auto")
    for i in range(len(ps)):
        for j in range(len(Ls)):
            ax.text(j, i, f"{data[i][j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(Ls)), [str(L) for L in Ls])
    ax.set_yticks(range(len(ps)), [f"{p:.1f}" for p in ps])
    ax.set_xlabel("draft chain length L")
    ax.set_ylabel("acceptance probability p")
    fused = f", fused ({result['fused']})" if result.get("fused") else ""
    ax.set_title(f"speedup over AR, {result['shape']}{fused}\nmeasured costs, sampled acceptance", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
