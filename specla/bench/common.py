"""What every benchmark records beside its numbers: device, versions, commit, date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path("benchmarks/results")


def git_commit(cwd=None) -> str:
    """SPECLA_COMMIT if set, else git's HEAD, with "-dirty" when tracked files differ from it (a
    copied tree on a device machine can sit on a stale checkout: its HEAD alone would name the
    wrong code)."""
    if os.environ.get("SPECLA_COMMIT"):
        return os.environ["SPECLA_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=cwd).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "fla", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    versions["cuda"] = torch.version.cuda
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    from specla import ops

    # the A/B switches a run was made under (SPECLA_PDL, SPECLA_CHUNK_TOKENS, ...)
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECLA_") and k != "SPECLA_COMMIT"}
    return {"device": device, "versions": versions, "commit": git_commit(), "verify_tiling": dict(ops.TILING),
            "env": switches, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_results(name: str, data: dict, out_dir: Path | str = RESULTS) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**environment(), **data}, indent=2) + "\n")
    return path


def write_json(path: Path | str, result: dict) -> None:
    """A diagnostic's result file (its own name and fields; `write_results` adds the environment)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def load_variant(src: str, name: str, tmp: Path):
    """Import `src` as a fresh module: an edited copy of a kernel module for an A/B (Triton reads a
    jitted function's source from its file, so the copy must be a file)."""
    import importlib.util
    import sys

    path = tmp / f"_specla_variant_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def median(xs) -> float:
    """The middle sample (the upper one of an even count): always a measured value."""
    return sorted(xs)[len(xs) // 2]


def bootstrap(stat, n: int, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of stat(indices) over `reps` resamples of range(n) with replacement."""
    import random

    rng = random.Random(seed)
    draws = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(reps))
    return draws[int(0.025 * reps)], draws[int(0.975 * reps) - 1]


def graph_time_ms(fn, cuda: bool, rep: int = 40) -> float:
    """Median ms of `fn` replayed from a CUDA graph (captured after two warm-up calls,
    `graphs.capture`); without CUDA one eager call's wall time (a smoke figure, not a timing)."""
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    from specla.graphs import capture

    return triton.testing.do_bench(capture(fn).replay, warmup=10, rep=rep, return_mode="median")


def generations_with(key: str, ids, *records) -> int:
    """How many of these timed generations (prompt ids of each row's records) have `key` set:
    "captures", a CUDA graph captured inside the timing (`graphs.captured()` around the call);
    "retimed", timed again after such a capture (`bench e2e`)."""
    return sum(bool(r[i].get(key)) for r in records for i in ids)


def copy_bandwidth(nbytes: int = 2 ** 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def warm_set(items, max_new_tokens: int) -> list:
    """What a benchmark generates, untimed, before timing anything: from (prompt length, item)
    pairs, the longest and the shortest item of every power-of-two context size (length +
    max_new_tokens), longest first. The first sizes every buffer; each of the others makes the
    drafters capture (and compile) their graph for one more attention window. Both ends of a
    size: a drafter's window also holds its rollout, so one context size spans two windows (the
    35-token prompt of e7ca6a9's mixed suite captured a window's graph inside its timing). Then
    one more item for every prefill chunk graph the picked ones leave uncaptured
    (`engine.prefill_chunks` of what `decode.prefill_spans` prefills, all but the last prompt
    token: in e2e_50850ad a 35-token prompt captured the 64-token sequence graph inside its
    timing, 67-118 ms; in e2e_4cce904 a 135-token prompt the 256-token one, because the
    129-token warm-up prompt prefills 128 tokens), and for every graph of the EAGLE drafter's
    prompt extend, which takes the same chunks (a width, and whether the chunk is the prompt's
    first)."""
    from specla.decode import prefill_spans
    from specla.engine import preferred_prefill_mode, prompt_chunks

    def chunk_graphs(n):
        """The target's (mode, width) chunk graphs and the EAGLE drafter's (width, first) ones."""
        graphs = set()
        for j, (s, e) in enumerate(prefill_spans(n)):
            for i, (_, w) in enumerate(prompt_chunks(e - s)):
                graphs |= {(preferred_prefill_mode(e - s), w), ("eagle", w, i == j == 0)}
        return graphs

    items = list(items)
    groups: dict = {}
    for n, item in items:
        size = n + max_new_tokens
        groups.setdefault((size - 1).bit_length(), []).append((size, item))
    picked = []
    for group in groups.values():
        hi, lo = max(group, key=lambda t: t[0]), min(group, key=lambda t: t[0])
        picked += [hi] if lo is hi else [hi, lo]
    seen = set().union(*(chunk_graphs(size - max_new_tokens) for size, _ in picked))
    for n, item in items:
        if chunk_graphs(n) - seen:
            seen |= chunk_graphs(n)
            picked.append((n + max_new_tokens, item))
    return [item for _, item in sorted(picked, key=lambda t: -t[0])]
