"""`specla bench controlled`: speedup under synthetic acceptance (SpecLA §8.5, Fig 12).

Costs are measured, acceptance is not. At a named shape with random weights:

- AR: one greedy step as the decode loop runs it (`GraphTarget.ar_round`: the step and its
  settling in one graph) plus the host read of its report (`ar_ms_per_token`, the baseline of
  every ratio; `bench.decode.time_ar_steps`, the same figure as `specla bench decode`);
- the drafter: an EAGLE-shaped stand-in with random weights — `EagleDrafterModel` built by
  `EagleConfig.for_target` (one decoder layer at the target's width, the target's LM head) —
  proposing a chain of L tokens for real each round (`EagleDrafter.propose`, its rollout
  replayed from a CUDA graph) and extending over the accepted path afterwards (its graph);
- the target: the round as the decode loop runs it (`GraphTarget.round`: verify of the
  (L+1)-node chain, the greedy rule, settling and the delayed commit in one graph), with the
  rule's verdict replaced by the sampled accepted count (`forcing`: the rule still runs);
- the host: each round's report read while the next round is queued (the loop's run-ahead).

Per chain length L = 5..12 and acceptance probability p = 0.5..1.0, each round's accepted
count is sampled: every draft token is accepted independently with probability p until the
first rejection (a ~ truncated geometric, τ = a + 1 tokens emitted). R rounds run back to
back (rewound every 30 rounds, untimed, so the caches keep a realistic size); speedup = AR
ms/token ÷ (total round time ÷ tokens emitted); `speedup_expected` uses the expected τ
instead of the sampled one (the same measured times, no sampling noise). Because tokens are forced,
only latency ratios mean anything here (no output is checked). `round16_ms` is one
16-draft-node beam-tree round (`bench.decode.time_rounds`, as `specla bench decode` times it),
the figure whose goal is ≤ 1.2× an AR step; `round16_paired` times that round and an AR
step in alternation (`bench.decode.time_round_pairs`: medians and the median per-pair ratio).
Writes `controlled.json` and the Fig 12 heatmap `controlled.png` (`--name` changes the stem); the JSON is rewritten after every chain length
(`complete` false until the last), so a run cut short keeps what it measured (two cold H200
runs were cut at their time bound with nothing written).

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
from tqdm import tqdm

from specla.acceptance import Acceptance
from specla.bench.common import RESULTS, copy_bandwidth, median, write_results
from specla.bench.decode import profile_fn, _target, time_ar_steps, time_round_pairs, time_rounds
from specla.bench.trees import beam_tree
from specla.decode import _Reader, _sync
from specla.drafters.base import DraftContext
from specla.drafters.eagle import EagleConfig, EagleDrafter, EagleDrafterModel
from specla.fused import env_mode as fused_env_mode
from specla.fused import fuse
from specla.shapes import random_model

PS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LENGTHS = tuple(range(5, 13))
WARMUP = 3


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


def forcing(accept, forced: torch.Tensor):
    """A target's acceptance rule that still runs (its cost is part of the round) but whose
    verdict on a chain is replaced: the first forced[b] drafts of row b accepted, the bonus
    token the rule's own. Device ops only, so it runs inside the round's graph."""

    def run(tokens, parents, logits, valid=None) -> Acceptance:
        acc = accept(tokens, parents, logits, valid)
        idx = torch.arange(tokens.shape[1], device=tokens.device)[None]
        length = (forced + 1).clamp(max=tokens.shape[1])
        return Acceptance(torch.where(idx < length[:, None], idx, 0), length, acc.bonus, acc.top)

    return run


class ChainRuntime:
    """One chain length L run as `decode.Decoder` runs an EAGLE chain route: the drafter
    proposes from the target's device root, the target runs the whole round (verify,
    acceptance, settling, delayed commit; one CUDA graph), the drafter extends over the accepted
    path, and the host reads each round's report while the next round is queued. Only the
    acceptance verdict is synthetic (`forcing`); `round(a)` accepts a drafts."""

    def __init__(self, model, dm: EagleDrafterModel, L: int, prompt: list[int], max_len: int,
                 capacity: int, graphs: bool):
        dev = model.device
        self.L, self.dev = L, dev
        self.drafter = EagleDrafter(dm, model, topk=1, depth=L, graphs=graphs, initial_capacity=capacity)
        self.drafter.reset(1, horizon=max_len)
        self.target = _target(model, max_len, L + 1, True)
        self.forced = torch.zeros(1, dtype=torch.long, device=dev)
        self.reader = _Reader(dev)  # its pinned buffers are made once, outside the timings
        self.target._accept = forcing(self.target._accept, self.forced)
        self.capture = self.drafter.capture
        pre = torch.tensor([prompt[:-1]], device=dev)
        out = self.target.prefill(pre, self.capture, logits=False)  # as the decode loop prefills
        self.drafter.extend(pre, out.hidden, torch.full((1,), pre.shape[1], device=dev))
        self.target.begin(torch.tensor([prompt[-1]], device=dev), max_len, set())
        d, t = self.drafter, self.target
        # after prefill: `rewind` returns here, so the caches keep their size however many rounds run
        self._saved = [(x, x.clone()) for x in (d.len, d.pending, t.cache.length, t.next_root, t.emitted, t.done)]

    def rewind(self) -> None:
        for x, saved in self._saved:
            x.copy_(saved)
        self.drafter._bound = int(self.drafter.len.max())

    # the pieces of a round, as `Decoder._round` runs them ---------------------------------------
    def propose(self):
        return self.drafter.propose(DraftContext(None, self.target.cache, root=self.target.next_root))

    def verify_round(self, draft):
        return self.target.round(draft.tokens, draft.parents, self.capture, draft.valid, chain=True,
                                 static=draft.static)

    def round(self, a: int) -> torch.Tensor:
        """Queue one round that accepts a drafts; its report (on the device)."""
        self.forced.fill_(a)
        r = self.verify_round(self.propose())
        self.drafter.extend(r.path_tokens, r.hidden, r.count, static=r.static)
        return r.report

    def components(self, reps: int) -> dict:
        """Median ms of each piece (synchronised between pieces), a = L (every draft accepted)."""
        t = {k: [] for k in ("draft", "round", "host_read", "extend")}
        self.forced.fill_(self.L)
        for _ in range(reps):
            _sync(self.dev)
            t0 = time.perf_counter()
            draft = self.propose()
            _sync(self.dev)
            t1 = time.perf_counter()
            r = self.verify_round(draft)
            _sync(self.dev)
            t2 = time.perf_counter()
            r.report.tolist()
            t3 = time.perf_counter()
            self.drafter.extend(r.path_tokens, r.hidden, r.count, static=r.static)
            _sync(self.dev)
            t4 = time.perf_counter()
            for k, (a, b) in zip(t, ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
                t[k].append((b - a) * 1e3)
        return {f"{k}_ms": median(v) for k, v in t.items()}

    def timed(self, accepted: list[int], chunk: int) -> float:
        """Total ms of back-to-back rounds with these accepted counts (after WARMUP untimed ones),
        in runs of `chunk` rounds with an untimed rewind between runs (bounded caches). Within a
        run the host reads round r's report after queuing round r + 1, as the decode loop does."""
        self.rewind()
        for a in accepted[:WARMUP]:
            self.reader.recv(self.reader.send(self.round(a)))
        total = 0.0
        for s in range(WARMUP, len(accepted), chunk):
            if s > WARMUP:
                self.rewind()
            _sync(self.dev)
            t0 = time.perf_counter()
            pending = None
            for a in accepted[s:s + chunk]:
                sent = self.reader.send(self.round(a))
                if pending is not None:
                    self.reader.recv(pending)
                pending = sent
            self.reader.recv(pending)
            _sync(self.dev)
            total += (time.perf_counter() - t0) * 1e3
        return total


def run(shape: str = "gdn-1.3b-paper", device: str = "cuda", dtype: torch.dtype | None = None,
        ps=PS, lengths=LENGTHS, rounds: int = 90, prompt_len: int = 256, quick: bool = False,
        compile: str | None = None, dynamic_tokens: bool = True, gemv: str = "cublas", seed: int = 0,
        out_dir=RESULTS, name: str = "controlled") -> dict:
    """The controlled study; `compile` ('default' / 'max-autotune') fuses the target
    (`fused.fuse`, its matmuls run the `gemv` way), as does SPECLA_COMPILE. Fused, `dynamic_tokens` compiles one verify graph
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
        fuse(model, mode=mode, dynamic_tokens=dynamic_tokens, gemv=gemv)
    elif gemv != "cublas":
        raise ValueError(f"gemv={gemv!r} needs a fused target (--compile or SPECLA_COMPILE)")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth() if graphs else None

    ar_ms = time_ar_steps(model, prompt, 20 if quick else 200)
    round16 = time_rounds(model, prompt, beam_tree(4, 4, 16), 5 if quick else 100)
    paired = time_round_pairs(model, prompt, beam_tree(4, 4, 16), 5 if quick else 200)
    dm = random_drafter(model, seed + 1)
    total = rounds + WARMUP
    chunk = 30  # rounds between rewinds: the drafter's KV cache stays near its real size
    grow = (min(chunk, rounds) + WARMUP) * (max(lengths) + 1)
    capacity = 1 << math.ceil(math.log2(prompt_len + grow + max(lengths) + 16))
    max_len = prompt_len + grow + 64
    grid, per_length, profile = [], [], None
    fused = getattr(model, "_fused", None)

    def result(complete: bool) -> dict:
        return {
            "shape": shape, "dtype": str(dtype).removeprefix("torch."), "gemv": gemv if mode else None,
            "params": sum(p.numel() for p in model.parameters()),
            "drafter_params": sum(p.numel() for p in dm.parameters()), "graphs": graphs,
            "fused": fused.mode if fused is not None else None,
            "fused_dynamic_tokens": fused.dynamic_tokens if fused is not None else None,
            "weight_floor_ms": weight_bytes / bw * 1e3 if bw else None,
            "copy_bandwidth_GBps": bw / 1e9 if bw else None,
            "ar_ms_per_token": ar_ms, "round16_ms": round16, "round16_over_ar": round16 / ar_ms,
            # the same round and AR step timed in alternation (`time_round_pairs`)
            "round16_paired": paired,
            "rounds": rounds, "prompt_len": prompt_len, "drafter_kv_capacity": capacity,
            "acceptance": "sampled: each draft token accepted with probability p until the first rejection",
            # False while lengths remain: a run cut short keeps the lengths it finished
            "complete": complete, "lengths": list(lengths),
            "per_length": per_length, "grid": grid,
            # torch.profiler over 5 graph replays at the longest L: the drafter's proposal alone,
            # and proposal + the target's round (GPU kernels per call, the top ones by time)
            "profile_longest_L": profile,
        }

    # written before the grid as well: a run cut short while the first length's drafter graphs
    # compile keeps the AR step and the 16-node round (a cold H200 spent a 210 s bound there)
    write_results(name, result(complete=False), out_dir)
    tqdm.write(f"AR {ar_ms:.3f} ms a token; 16-node round {round16:.3f} ms = {round16 / ar_ms:.3f}x AR "
               f"({paired['ratio']:.3f}x in alternation)")
    for L in tqdm(lengths, desc="controlled study (chain lengths)", unit="L"):
        rt = ChainRuntime(model, dm, L, prompt, max_len, capacity, graphs)
        # compile and capture outside the timings: the rollout has one graph per attention
        # window, and the windows a timed run reaches depend only on how many rounds it runs
        # (the drafter's host bound grows by the draft width every round), so one untimed run
        # of the longest stretch between rewinds captures all of them (without it the H200 run
        # of e79c8aa captured one inside the timing of p = 0.5, L = 7: 0.33x, controlled_e79c8aa.json)
        rt.timed([L] * total if quick else [L] * (WARMUP + chunk), chunk)
        comp = rt.components(3 if quick else 20)
        per_length.append({"L": L, **comp})
        if graphs and L == max(lengths):
            rt.rewind()
            profile = {"draft": profile_fn(rt.propose, 5, dev),
                       "round": profile_fn(lambda rt=rt: rt.verify_round(rt.propose()), 5, dev)}
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
        write_results(name, result(complete=False), out_dir)
    final = result(complete=True)
    _print(final)
    write_results(name, final, out_dir)
    plot(final, Path(out_dir) / f"{name}.png")
    return final


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ps = sorted({c["p"] for c in result["grid"]})
    Ls = sorted({c["L"] for c in result["grid"]})
    cell = {(c["p"], c["L"]): c["speedup"] for c in result["grid"]}
    table = Table(title=f"speedup over AR ({result['ar_ms_per_token']:.3f} ms/token), {result['shape']}, "
                        f"16-node round {result['round16_ms']:.3f} ms = {result['round16_over_ar']:.3f}x AR "
                        f"(paired: {result['round16_paired']['ratio']:.3f}x)")
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
