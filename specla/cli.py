"""The `specla` command line. Errors caused by input print one line and exit with status 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from specla.errors import InputError, SpeclaError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact speculative decoding for Gated DeltaNet language models.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; each writes JSON (and a PNG) to benchmarks/results/.")
train_app = typer.Typer(no_args_is_help=True, help="Train the demo target or a drafter.")
data_app = typer.Typer(no_args_is_help=True, help="Build the training corpus and the tokenizer.")
app.add_typer(bench_app, name="bench")
app.add_typer(train_app, name="train")
app.add_typer(data_app, name="data")


def _version(value: bool) -> None:
    if value:
        from specla import __version__

        typer.echo(f"specla {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """Exact speculative decoding for Gated DeltaNet language models."""


@app.command()
def generate(
    text: Optional[str] = typer.Argument(None, help="Prompt text (or pass --prompt)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (wrapped in the chat template "
                                         "unless --raw)."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Checkpoint directory (default: the demo model)."),
    route: str = typer.Option("chain", help="ar | chain | tree | fla (FLA-SD baseline) | mtp | dspark | ready. "
                              "chain is the default: the fastest route of the demo pair on the H200 and on CPU "
                              "(BENCHMARKS.md)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16 | float64"),
    chain_length: int = typer.Option(8, "--chain-length", help="Draft tokens per chain round."),
    tree_topk: int = typer.Option(4, "--tree-topk", help="Children per node in draft trees."),
    tree_budget: int = typer.Option(16, "--tree-budget", help="Draft nodes per tree round."),
    tree_depth: str = typer.Option("8", "--tree-depth", help="Deepest draft-tree level (trained drafter); "
                                   "8 matches the chain length. Deeper trees accept more a round (demo pair, held-out "
                                   "prompts, CPU: 6.65 tokens at 8, 7.33 at 10, 7.72 at 12) for one drafter "
                                   "forward a level. SHALLOW:DEEP (e.g. 6:10): each round DEEP after a round "
                                   "that accepted at least SHALLOW drafts, else SHALLOW."),
    tree_width: Optional[int] = typer.Option(None, "--tree-width", help="Beams kept a draft-tree depth (trained "
                                             "drafter; default: the top-k). 1: a chain with each depth's "
                                             "runners-up as leaves."),
    tree_temperature: Optional[float] = typer.Option(None, "--tree-temperature", help="Temperature of the trained "
                                                     "drafter's distribution in draft-tree scores (default 0.5, "
                                                     "tuned on held-out prompts; 1 = the plain log-probabilities)."),
    tree_tau: Optional[float] = typer.Option(None, "--tree-tau", help="Confidence pruning: keep nodes within "
                                             "tau nats of the best cumulative log-probability."),
    drafter: str = typer.Option("auto", help="auto (the checkpoint's trained drafter, else ngram) | eagle | ngram"),
    immediate_commit: bool = typer.Option(False, "--immediate-commit", help="Commit states right after each round "
                                          "instead of folding the update into the next verify."),
    exact: bool = typer.Option(False, "--exact", help="Exact mode: every target call (AR steps too) verifies "
                               "17 nodes, so every route's output is bit-identical to `--route ar --exact` in "
                               "bf16 too (docs/exact.md). AR gets slower; drafted routes barely change."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    compile: Optional[str] = typer.Option(None, "--compile", help="default | max-autotune: the fused decode path "
                                          "(torch.compile; what the GPU benchmarks measure). The first generation "
                                          "compiles. SPECLA_COMPILE=1 does the same."),
):
    """Generate text; streams it, then prints tokens/s and the mean accepted length."""
    import specla.api as api

    if (text is None) == (prompt is None):
        raise SpeclaError("give the prompt once: as the argument (specla generate \"...\") or as --prompt")
    prompt = prompt if text is None else text
    if max_new_tokens <= 0:
        raise SpeclaError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if route not in api.ROUTES:
        raise SpeclaError(f"unknown route {route!r}; choose one of {', '.join(api.ROUTES)}")
    depth = api.parse_tree_depth(tree_depth)
    lm = api.load(model, device=device, dtype=dtype, compile=compile)
    kwargs = dict(route=route, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  chat=False if raw else None, chain_length=chain_length, tree_topk=tree_topk,
                  tree_budget=tree_budget, tree_depth=depth, tree_tau=tree_tau, tree_width=tree_width,
                  tree_temperature=tree_temperature, drafter=drafter, delayed=not immediate_commit, exact=exact)
    if as_json:
        typer.echo(json.dumps(lm.generate(prompt, **kwargs).to_dict()))
        return
    out = lm.generate(prompt, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()), **kwargs)
    sys.stdout.write("\n")
    sys.stdout.flush()
    typer.secho(f"[{out.route}] {len(out.tokens)} tokens in {out.decode_seconds:.2f} s, "
                f"{out.tokens_per_second:.1f} tokens/s, mean accepted length {out.mean_accepted_length:.2f} "
                f"over {out.rounds} rounds ({out.stop_reason})", err=True, dim=True)


def _needs_gpu(command: str, device: str, smoke: str = "") -> None:
    """One line instead of a CUDA traceback when a GPU benchmark starts on a machine without one."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"bench {command} times GPU work and no CUDA GPU is here"
                             + (f"; `{smoke}` runs it as a CPU smoke test" if smoke else ""))


@bench_app.command("kernels")
def bench_kernels(
    out: Path = typer.Option(Path("benchmarks/results")),
    device: str = typer.Option("cuda"),
    quick: bool = typer.Option(False, help="Tiny shapes, few repetitions (smoke test; CPU runs the interpreter)."),
):
    """SpecLA's kernel microbenchmarks (Table 1, Fig 11a/b, serial chain vs fla) in CUDA graph replay."""
    _needs_gpu("kernels", device, "--device cpu --quick")
    from specla.bench.kernels import run

    run(out_dir=str(out), device=device, quick=quick)


@bench_app.command("e2e")
def bench_e2e(
    model: Optional[Path] = typer.Option(None, help="Checkpoint directory with drafter/ (default: the demo pair)."),
    suites: str = typer.Option("mixed,gsm8k,humaneval", help="Comma-separated: mixed, gsm8k, humaneval, or a "
                               "file of your prompts (.txt: one a line; .jsonl: 'prompt', 'turns' or 'messages')."),
    routes: str = typer.Option("ar,fla,chain,tree,ngram"),
    limit: Optional[int] = typer.Option(None, help="First N prompts of each suite."),
    fla_limit: int = typer.Option(160, help="The slow fla route runs on the first N prompts of each suite."),
    max_new_tokens: int = typer.Option(128),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    max_minutes: Optional[float] = typer.Option(None, help="Stop after this long; the next call resumes."),
    name: str = typer.Option("e2e", help="Result file stem."),
    shard: str = typer.Option("0/1", help="K/N: this process takes prompt indices i with i % N == K "
                              "(one process per GPU); the summary reads every shard's records."),
    summary_only: bool = typer.Option(False, "--summary-only", help="Only summarise the records found."),
    compile: Optional[str] = typer.Option(None, "--compile", help="default | max-autotune: the fused decode path "
                                          "(SPECLA_COMPILE=1 does the same)."),
    tree_depth: str = typer.Option("8", "--tree-depth", help="The tree route's deepest level (top-4 beams), or "
                                   "SHALLOW:DEEP, a depth chosen each round; a run resumes only with the options "
                                   "it began with."),
    tree_budget: int = typer.Option(16, "--tree-budget", help="The tree route's draft nodes (verified with the "
                                    "root: budget + 1 rows)."),
    out: Path = typer.Option(Path("benchmarks/results")),
):
    """End-to-end speedup, accepted length, first-token match and exact match on real prompts (Fig 9)."""
    from specla.api import parse_tree_depth
    from specla.bench.e2e import ROUTES, run

    bad = sorted(set(routes.split(",")) - set(ROUTES))
    if bad:  # suites are checked where they load (`load_suite`), before the model loads
        raise InputError(f"unknown route{'s' if len(bad) > 1 else ''} {', '.join(bad)} in --routes; "
                         f"the routes are {', '.join(ROUTES)}")
    try:
        k, n = (int(x) for x in shard.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise InputError(f"--shard {shard!r}: expected K/N with 0 <= K < N") from None
    run(model, tuple(suites.split(",")), tuple(routes.split(",")), limit=limit, fla_limit=fla_limit,
        max_new_tokens=max_new_tokens, device=device, dtype=dtype, out_dir=out, name=name, max_minutes=max_minutes,
        shard=(k, n), summary_only=summary_only, compile=compile, tree_depth=parse_tree_depth(tree_depth),
        tree_budget=tree_budget)


@bench_app.command("rounds")
def bench_rounds(
    model: Optional[Path] = typer.Option(None, help="Checkpoint directory with drafter/ (default: the demo pair)."),
    routes: str = typer.Option("ar,chain,tree,ngram"),
    suite: str = typer.Option("mixed"),
    n_prompts: int = typer.Option(8),
    max_new_tokens: int = typer.Option(128),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    profile: bool = typer.Option(True, help="Also profile one generation per route (kernels per round)."),
    compile: Optional[str] = typer.Option(None, "--compile", help="default | max-autotune: the fused decode path "
                                          "(SPECLA_COMPILE=1 does the same)."),
    warm_routes: str = typer.Option("", help="Routes that generate once, untimed, before any timing (the "
                                    "process history of `bench e2e`), e.g. ar,fla,chain,ngram."),
    name: str = typer.Option("rounds", help="Result file stem."),
    out: Path = typer.Option(Path("benchmarks/results")),
):
    """Where a round's time goes (GPU): drafter propose/extend, target verify/commit, the loop's own work."""
    from specla.bench.e2e import ROUTES
    from specla.bench.rounds import run

    warm = tuple(r for r in warm_routes.split(",") if r)
    bad = [r for r in (*routes.split(","), *warm) if r not in ROUTES]
    if bad:
        raise InputError(f"unknown route(s) {', '.join(bad)}: choose from {', '.join(ROUTES)}")
    run(model, tuple(routes.split(",")), suite, n_prompts, max_new_tokens, device, dtype, out, profile, compile,
        warm, name)


@bench_app.command("prefill")
def bench_prefill(
    model: Optional[Path] = typer.Option(None, help="Checkpoint directory (default: the demo target)."),
    lengths: str = typer.Option(",".join(map(str, (16, 32, 64, 128, 256, 511, 512, 1024, 2048, 4096))),
                                help="Comma-separated prompt lengths in tokens."),
    modes: str = typer.Option("chain,sequence,plain", help="Prefill modes: chain, sequence, plain."),
    reps: int = typer.Option(5, help="Timed prefills per length and mode (median)."),
    device: str = typer.Option("cuda"),
    dtype: str = typer.Option("auto"),
    compile: Optional[str] = typer.Option(None, "--compile", help="default | max-autotune: the fused decode path "
                                          "(SPECLA_COMPILE=1 does the same)."),
    name: str = typer.Option("prefill", help="Result file stem."),
    out: Path = typer.Option(Path("benchmarks/results")),
    profile: bool = typer.Option(False, "--profile", help="Also profile one prefill per length and mode "
                                 "(kernels, GPU time, top kernels)."),
):
    """Time to consume a prompt by length and prefill mode (CUDA graph chunks or the plain forward; GPU)."""
    from specla.bench.prefill import MODES, run

    bad = [m for m in modes.split(",") if m not in MODES]
    if bad:
        raise InputError(f"unknown prefill mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    if not device.startswith("cuda"):
        raise InputError("bench prefill times CUDA graph replays: run it with --device cuda on a GPU")
    try:
        sizes = tuple(int(x) for x in lengths.split(",") if x)
    except ValueError:
        raise InputError(f"--lengths must be comma-separated integers, got {lengths!r}") from None
    if not sizes or min(sizes) < 1:
        raise InputError("--lengths must be positive")
    run(model, sizes, tuple(modes.split(",")), reps=reps, device=device, dtype=dtype, compile=compile,
        out_dir=out, name=name, profile=profile)


@bench_app.command("decode")
def bench_decode(
    shapes: str = typer.Option("gdn-1.3b-paper,gdn-1.3b-paper-hybrid", help="Comma-separated named shapes."),
    new_tokens: int = typer.Option(32),
    rounds: int = typer.Option(30),
    device: str = typer.Option("cuda", help="cuda | cuda:N"),
    profile: bool = typer.Option(False, "--profile", help="Also profile ~5 eager AR steps and 16-node rounds "
                                 "per shape (kernels per step, GPU time, top kernels; plain and fused)."),
    gemv: str = typer.Option("cublas", help="Fused path only: comma-separated ways to run the steps' and "
                             "verifies' matmuls (cublas | triton), one row per shape and way, same run."),
    name: Optional[str] = typer.Option(None, help="Result file stem (default decode, decode_fused on the "
                                       "fused path)."),
    out: Path = typer.Option(Path("benchmarks/results")),
):
    """AR ms/token (eager and CUDA graphs) and one 16-node speculative round, at named shapes (GPU)."""
    _needs_gpu("decode", device)
    from specla.bench.decode import run

    run(tuple(s for s in shapes.split(",") if s), new_tokens=new_tokens, rounds=rounds, out_dir=out,
        profile=profile, device=device, gemvs=tuple(g for g in gemv.split(",") if g), name=name)


@bench_app.command("gemv")
def bench_gemv(
    shape: str = typer.Option("gdn-1.3b-paper", help="Named shape."),
    layers: int = typer.Option(24, help="Distinct weight copies per matmul (an AR step's layers)."),
    device: str = typer.Option("cuda"),
    quick: bool = typer.Option(False, help="One copy each (smoke test; on CPU use --shape tiny)."),
    out: Path = typer.Option(Path("benchmarks/results")),
):
    """A batch-1 step's matmuls (1 and 17 rows): cuBLAS, its variants and specla's kernels against the copy bandwidth."""
    _needs_gpu("gemv", device, "--device cpu --shape tiny --quick")
    from specla.bench.gemv import run

    run(shape=shape, device=device, layers=layers, quick=quick, out_dir=out)


@bench_app.command("controlled")
def bench_controlled(
    shape: str = typer.Option("gdn-1.3b-paper", help="Named shape (random weights)."),
    rounds: int = typer.Option(90, help="Timed rounds per (p, L) cell."),
    prompt_len: int = typer.Option(256),
    device: str = typer.Option("cuda"),
    compile: Optional[str] = typer.Option(None, "--compile", help="Fuse the target: default | max-autotune "
                                          "(SPECLA_COMPILE=1 does the same)."),
    gemv: str = typer.Option("cublas", help="Fused target only: how its steps' and verifies' matmuls run "
                             "(cublas | triton: specla's batch-1 kernels at the measured tilings)."),
    lengths: str = typer.Option("5,6,7,8,9,10,11,12", help="Comma-separated chain lengths L."),
    ps: str = typer.Option("0.5,0.6,0.7,0.8,0.9,1.0", "--ps", help="Comma-separated acceptance probabilities p."),
    quick: bool = typer.Option(False, help="Few rounds, short prompt (smoke test; on CPU use --shape tiny)."),
    name: str = typer.Option("controlled", help="Result file stem."),
    out: Path = typer.Option(Path("benchmarks/results")),
):
    """Speedup over AR for acceptance probability p and chain length L, measured costs (SpecLA Fig 12)."""
    from specla.bench.controlled import run

    try:
        Ls = tuple(int(x) for x in lengths.split(",") if x.strip())
        Ps = tuple(float(x) for x in ps.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--lengths takes integers and --ps numbers, got {lengths!r} / {ps!r}") from None
    if not Ls or not Ps or min(Ls) < 1 or not all(0 <= p <= 1 for p in Ps):
        raise InputError(f"--lengths must be positive and --ps within [0, 1], got {lengths!r} / {ps!r}")
    _needs_gpu("controlled", device, "--device cpu --shape tiny --quick")  # after the options' own checks
    run(shape=shape, device=device, rounds=rounds, prompt_len=prompt_len, quick=quick, compile=compile, gemv=gemv,
        lengths=Ls, ps=Ps, out_dir=out, name=name)


@bench_app.command("agreement")
def bench_agreement(
    shape: str = typer.Option("gdn-1.3b-paper", help="Named shape (random weights)."),
    runs: int = typer.Option(50, help="Random prompts."),
    new_tokens: int = typer.Option(128),
    prompt_len: int = typer.Option(64),
    noise: float = typer.Option(0.2, help="Probability the oracle drafter replaces a token by a random one."),
    device: str = typer.Option("cuda"),
    compile: Optional[str] = typer.Option(None, "--compile", help="Fuse the target: default | max-autotune "
                                          "(SPECLA_COMPILE=1 does the same)."),
    quick: bool = typer.Option(False, help="2 runs of 16 tokens (smoke test; on CPU use --shape tiny)."),
    exact: bool = typer.Option(True, "--exact/--no-exact", help="Also run AR and both routes in exact mode."),
    gemv: str = typer.Option("cublas", help="With --compile: how the products run (cublas | triton | invariant: "
                             "rows independent of the row count)."),
    name: str = typer.Option("agreement", help="Result file stem."),
    out: Path = typer.Option(Path("benchmarks/results")),
):
    """How often bf16 chain/tree outputs equal AR's; first divergence and AR's logit margin there."""
    from specla.bench.agreement import run
    from specla.fused import GEMVS

    if gemv not in GEMVS:
        raise InputError(f"--gemv takes {', '.join(GEMVS)}, got {gemv!r}")
    _needs_gpu("agreement", device, "--device cpu --shape tiny --quick")
    run(shape=shape, runs=runs, new_tokens=new_tokens, prompt_len=prompt_len, noise=noise, device=device,
        quick=quick, compile=compile, exact=exact, gemv=gemv, name=name, out_dir=out)


DRAFTER_KINDS = ("eagle", "dspark", "ready", "dspark-ft")


@train_app.command("drafter")
def train_drafter_cmd(
    target: Path = typer.Option(..., help="Target checkpoint directory."),
    data: Path = typer.Option(..., help="Responses .npz from `specla data responses`."),
    out: Path = typer.Option(..., help="Run directory (checkpoint, log, export/). Re-run to resume."),
    kind: str = typer.Option("eagle", help="eagle (chain/tree routes) | dspark (from scratch) | ready (two "
                             "stages, from a DSpark export) | dspark-ft (ReaDy's control: DSpark fine-tuned)"),
    stage: int = typer.Option(1, help="ReaDy stage: 1 = the reader only, 2 = the whole drafter."),
    init_from: Optional[Path] = typer.Option(None, help="Export to start from (block drafters: DSpark for ready "
                                             "stage 1 and dspark-ft, the stage-1 ReaDy export for stage 2)."),
    total_minutes: float = typer.Option(8.0),
    max_minutes: float = typer.Option(8.0),
    total_steps: Optional[int] = typer.Option(None),
    batch_size: int = typer.Option(32),
    seq_len: int = typer.Option(768),
    lr: Optional[float] = typer.Option(None, help="Peak LR (default 1e-3 eagle and dspark, 1e-4 ready stage 1, "
                                       "5e-5 stage 2 and dspark-ft)."),
    unroll: int = typer.Option(8, help="eagle: training-time-test steps (drafter fed its own outputs); "
                               "the chain route drafts 8."),
    feature_layers: Optional[str] = typer.Option(None, help="eagle: comma-separated target layers "
                                                 "(default L/4, L/2, L-1)."),
    anchors: int = typer.Option(16, help="Block drafters: draft blocks per sequence per step."),
    source_layers: Optional[str] = typer.Option(None, help="ready: comma-separated target GDN layers to read."),
    reader_rank: Optional[str] = typer.Option(None, help="ready: reader rank (default 8) or 'full'."),
    inject_layers: Optional[str] = typer.Option(None, help="ready: comma-separated draft layers that add the read."),
    inject_site: Optional[str] = typer.Option(None, help="ready: post (after attention, default) | pre."),
    device: str = typer.Option("auto"),
):
    """Train a drafter of a target on its own responses (bf16 autocast; torchrun for several GPUs)."""
    if kind not in DRAFTER_KINDS:
        raise InputError(f"--kind {kind!r}: choose one of {', '.join(DRAFTER_KINDS)}")
    ints = lambda s: [int(x) for x in s.split(",")] if s else None  # noqa: E731
    if kind == "eagle":
        from specla.train.drafter import train_drafter

        summary = train_drafter(
            target, out, data, total_steps=total_steps, total_minutes=total_minutes, max_minutes=max_minutes,
            batch_size=batch_size, seq_len=seq_len, lr=1e-3 if lr is None else lr, unroll=unroll,
            feature_layers=ints(feature_layers), device=device, init_from=init_from)
    else:
        from specla.train.block_drafter import train_block_drafter

        rank = reader_rank if reader_rank in (None, "full") else int(reader_rank)
        summary = train_block_drafter(
            target, out, data, kind=kind, init_from=init_from, stage=stage, total_steps=total_steps,
            total_minutes=total_minutes, max_minutes=max_minutes, batch_size=batch_size, seq_len=seq_len,
            anchors=anchors, lr=lr, source_layers=ints(source_layers), reader_rank=rank,
            inject_layers=ints(inject_layers), inject_site=inject_site, device=device)
    typer.echo(json.dumps(summary))


@bench_app.command("ready")
def bench_ready(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Target (default: the demo model)."),
    dspark: Optional[Path] = typer.Option(None, help="DSpark export (default <model>/dspark)."),
    dspark_ft: Optional[Path] = typer.Option(None, "--dspark-ft", help="Fine-tuned control (default <model>/dspark-ft)."),
    ready: Optional[Path] = typer.Option(None, help="ReaDy export (default <model>/ready)."),
    variant: list[str] = typer.Option([], help="NAME=DIR: another trained block drafter row (ablations)."),
    suites: str = typer.Option("mixed,gsm8k,humaneval"),
    n_prompts: int = typer.Option(80, help="Prompts per suite, spread over it."),
    max_new_tokens: int = typer.Option(256),
    threshold: float = typer.Option(0.0, help="Confidence cut (0: full 7-token blocks)."),
    device: str = typer.Option("cuda"),
    quick: bool = typer.Option(False, help="Smoke test: 1 prompt per suite, 16 tokens (random drafters if none)."),
    max_minutes: Optional[float] = typer.Option(None, help="Stop starting generations after this; re-run resumes."),
    rows: str = typer.Option("dspark,dspark_ft,ready", help="Standard rows to run beside ar (ablation runs: fewer)."),
    name: Optional[str] = typer.Option(None, help="Result file stem (default ready)."),
    operator: bool = typer.Option(True, "--operator/--no-operator", help="Time the fused state-reader operator."),
    compile: Optional[str] = typer.Option(None, "--compile", help="default | max-autotune: the fused decode path "
                                          "(SPECLA_COMPILE=1 does the same)."),
    summary_only: bool = typer.Option(False, "--summary-only", help="Recompute <name>.json's suites from its log "
                                      "(intervals, paired ratios); the measured sections stay."),
    out: Path = typer.Option(Path("benchmarks/results")),
):
    """ReaDy vs DSpark: TPS, x AR, tau, survival curves, fused state-reader latency (ready.json/.png)."""
    from specla.bench.ready import ROWS, resummarise, run

    if summary_only:
        stem = name or "ready"
        if not (out / f"{stem}.json").is_file() or not (out / f"{stem}_log.jsonl").is_file():
            raise InputError(f"--summary-only needs {out / (stem + '.json')} and its _log.jsonl")
        resummarise(out, stem)
        return

    picked = tuple(r for r in rows.split(",") if r)
    if set(picked) - set(ROWS):
        raise InputError(f"--rows {rows!r}: choose from {', '.join(ROWS)}")
    if any("=" not in v for v in variant):
        raise InputError("--variant takes NAME=DIR")
    _needs_gpu("ready", device, "--device cpu --quick")  # after the options' own checks
    run(model, dspark, dspark_ft, ready, dict(v.split("=", 1) for v in variant),
        tuple(s for s in suites.split(",") if s), n_prompts, max_new_tokens, device, threshold=threshold,
        operator=operator, quick=quick, max_minutes=max_minutes, out_dir=out, rows=picked, name=name,
        compile=compile)


@train_app.command("card")
def train_card(
    model: Path = typer.Option(..., help="Exported model directory; README.md and loss.png are written there."),
    log: Path = typer.Option(..., help="train_log.jsonl of the runs that produced it."),
):
    """Write the model card of a trained target from its training log."""
    from specla.train.card import write_card

    typer.echo(str(write_card(model, log)))


@data_app.command("responses")
def data_responses(
    target: Path = typer.Option(..., help="Target checkpoint directory."),
    out: Path = typer.Option(..., help="Output .npz of prompts and the target's greedy responses."),
    corpus: Path = typer.Option(Path(".corpus")),
    n_prompts: int = typer.Option(16384, help="With the default share: every ShareGPT opener of the reference "
                                  "corpus and nearly every GSM8K training question (the shipped drafter's data)."),
    max_new_tokens: int = typer.Option(256),
    gsm8k_share: float = typer.Option(0.45),
    max_prompt_tokens: int = typer.Option(384),
    batch_size: int = typer.Option(512),
    max_minutes: Optional[float] = typer.Option(None),
    graphs: bool = typer.Option(False, "--graphs/--no-graphs"),
    shard: str = typer.Option("0/1", help="K/N: every N-th prompt from the K-th (parallel collection; "
                              "join with `specla data merge-responses`)."),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """The target's greedy responses to training prompts (the drafter's training data)."""
    from specla.train.drafter import collect_responses

    try:
        k, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise InputError(f"--shard {shard!r}: expected K/N, e.g. 0/2") from None
    typer.echo(json.dumps(collect_responses(
        target, out, n_prompts=n_prompts, max_new_tokens=max_new_tokens, corpus_dir=corpus,
        gsm8k_share=gsm8k_share, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
        max_minutes=max_minutes, graphs=graphs, shard=(k, n), device=device, dtype=dtype)))


@data_app.command("prompt-corpus")
def data_prompt_corpus(
    corpus: Path = typer.Option(Path(".corpus"), help="Corpus directory from `specla data corpus`."),
    out: Path = typer.Option(Path(".corpus-prompts"), help="Output directory (pass it to `data responses --corpus`)."),
):
    """A prompts-only copy of the corpus (ShareGPT openers): `data responses` picks the same prompts
    from it, and it is small enough to travel to a GPU machine beside the repository."""
    from specla.train.drafter import prompt_corpus

    typer.echo(json.dumps(prompt_corpus(corpus, out)))


@data_app.command("merge-responses")
def data_merge_responses(
    out: Path = typer.Option(..., help="Output .npz."),
    inputs: list[Path] = typer.Argument(..., help="Response files to join."),
):
    """Join response files (the shards of a parallel collection) into one."""
    from specla.train.drafter import merge_responses

    typer.echo(json.dumps(merge_responses(out, inputs)))


@data_app.command("corpus")
def data_corpus(
    out: Path = typer.Option(Path(".corpus"), help="Output directory."),
    docs_dir: Optional[Path] = typer.Option(None, help="Python docs .rst.txt sources (Debian python3.11-doc)."),
    max_compressed_mib: float = typer.Option(24.0, help="Budget for the compressed training split."),
):
    """Build the deduplicated training corpus from text shipped in registry packages."""
    from specla.data.corpus import build_corpus

    kw = {"docs_dir": docs_dir} if docs_dir else {}
    manifest = build_corpus(out, max_compressed_mib=max_compressed_mib, **kw)
    typer.echo(json.dumps(manifest, indent=2))


@data_app.command("tokenizer")
def data_tokenizer(
    corpus: Path = typer.Option(Path(".corpus"), help="Corpus directory from `specla data corpus`."),
    out: Path = typer.Option(..., help="Directory to write tokenizer.json and tokenizer_config.json to."),
    vocab_size: int = typer.Option(8192),
):
    """Train the byte-level BPE tokenizer with its chat template."""
    from specla.data.tokenizer import train_tokenizer

    typer.echo(str(train_tokenizer(corpus, out, vocab_size=vocab_size)))


@train_app.command("target")
def train_target_cmd(
    out: Path = typer.Option(..., help="Run directory (checkpoint, log, export/). Re-run to resume."),
    corpus: Path = typer.Option(Path(".corpus"), help="Corpus directory from `specla data corpus`."),
    tokenizer: Optional[Path] = typer.Option(None, help="Tokenizer directory (default: the demo model's)."),
    config: Optional[Path] = typer.Option(None, help="JSON file of ModelConfig fields (default: the demo shape)."),
    total_minutes: float = typer.Option(16.0, help="Training time the LR schedule spans (all runs together)."),
    max_minutes: float = typer.Option(8.0, help="Stop this run after this long; the next run resumes."),
    total_steps: Optional[int] = typer.Option(None, help="Fix the schedule length instead of calibrating it."),
    batch_size: int = typer.Option(64, help="Sequences per step per GPU."),
    seq_len: int = typer.Option(1024),
    lr: float = typer.Option(2e-3),
    device: str = typer.Option("auto"),
    init_from: Optional[Path] = typer.Option(None, help="Continue from an exported run when OUT has no ckpt.pt."),
):
    """Pretrain a pure-GDN target (bf16 autocast, the chunked GDN form in PyTorch; torchrun for several GPUs)."""
    from specla.api import DEMO_DIR
    from specla.config import ModelConfig
    from specla.train.target import train_target

    cfg = ModelConfig(**json.loads(config.read_text())) if config else None
    summary = train_target(out, corpus, tokenizer or DEMO_DIR, config=cfg, total_steps=total_steps,
                           total_minutes=total_minutes, max_minutes=max_minutes, batch_size=batch_size,
                           seq_len=seq_len, lr=lr, device=device, init_from=init_from)
    typer.echo(json.dumps(summary))


def main() -> None:
    try:
        app()
    except SpeclaError as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
