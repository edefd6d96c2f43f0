"""Benchmark prompt suites shipped inside the package.

Three suites live under ``specla/data/suites/`` (licences beside the data):

``mixed``
    The 480-prompt mixed suite used by the EAGLE / SpecLA papers: 80 prompts from
    each of MT-Bench (2 user turns), HumanEval, GSM8K, Alpaca, CNN/DailyMail
    summarisation and Natural Questions. ``category`` is the file stem
    (``mt_bench``, ``humaneval``, ``gsm8k``, ``alpaca``, ``sum``, ``qa``); the order is
    fixed: categories in :data:`MIXED_CATEGORIES` order, rows in file order.
``gsm8k``
    The 1,319 GSM8K test questions (one turn each; ``reference`` is the worked answer).
``humaneval``
    The 164 HumanEval problems (the turn is the raw code prompt; ``reference`` is the
    canonical solution).

Files are read with :mod:`importlib.resources`, so this works from an installed wheel.

Any other suite is a file of your own prompts (`load_suite("my_prompts.jsonl")`): ``.txt`` holds
one prompt per non-empty line; ``.jsonl`` one object per line with ``prompt`` (or
``question``: a string), ``turns`` (user turns) or ``messages`` (chat turns; the user's are
kept). Its prompts' ids are ``<file stem>/<line>``.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterator

from specla.errors import InputError

__all__ = [
    "SUITES",
    "MIXED_CATEGORIES",
    "Prompt",
    "load_suite",
    "load_gsm8k_train",
    "benchmark_texts",
]

SUITES: tuple[str, ...] = ("mixed", "gsm8k", "humaneval")

#: Order of the categories in the ``mixed`` suite (the EAGLE papers' table order).
MIXED_CATEGORIES: tuple[str, ...] = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")

_PACKAGE = "specla.data"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``turns`` are the user turns, in order."""

    id: str
    suite: str
    category: str
    turns: list[str] = field(hash=False)
    reference: str | None = None


def _suite_file(*parts: str):
    return resources.files(_PACKAGE).joinpath("suites", *parts)


def _read_jsonl(*parts: str) -> list[dict]:
    """Read a JSONL resource; ``name.jsonl`` falls back to ``name.jsonl.gz``."""
    res = _suite_file(*parts)
    if not res.is_file():
        gz = _suite_file(*parts[:-1], parts[-1] + ".gz")
        if not gz.is_file():
            raise FileNotFoundError(f"benchmark data file missing from the package: suites/{'/'.join(parts)}")
        res = gz
    raw = res.read_bytes()
    if res.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    rows = []
    for line in io.StringIO(raw.decode("utf-8")):
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows


def _first(ref) -> str | None:
    if ref is None:
        return None
    if isinstance(ref, list):
        return ref[0] if ref else None
    return str(ref)


@lru_cache(maxsize=None)
def _load(name: str) -> tuple[Prompt, ...]:
    out: list[Prompt] = []
    if name == "mixed":
        for cat in MIXED_CATEGORIES:
            for row in _read_jsonl("eagle_mixed", f"{cat}.jsonl"):
                out.append(
                    Prompt(
                        id=f"{cat}/{row['question_id']}",
                        suite="mixed",
                        category=cat,
                        turns=list(row["turns"]),
                        reference=_first(row.get("reference")),
                    )
                )
    elif name == "gsm8k":
        for i, row in enumerate(_read_jsonl("gsm8k", "test.jsonl")):
            out.append(Prompt(id=f"gsm8k/test/{i}", suite="gsm8k", category="gsm8k",
                              turns=[row["question"]], reference=row["answer"]))
    elif name == "humaneval":
        for row in _read_jsonl("humaneval", "HumanEval.jsonl"):
            out.append(Prompt(id=row["task_id"], suite="humaneval", category="humaneval",
                              turns=[row["prompt"]], reference=row["canonical_solution"]))
    else:  # pragma: no cover - guarded by load_suite
        raise AssertionError(name)
    return tuple(out)


PROMPT_FILE_SUFFIXES = (".txt", ".jsonl")


def is_prompt_file(name: str) -> bool:
    """Whether a suite name names a prompt file (by its suffix; it may not exist)."""
    return name not in SUITES and Path(name).suffix in PROMPT_FILE_SUFFIXES


def _turns(row, where: str) -> list[str]:
    if isinstance(row, str):
        return [row]
    if isinstance(row, dict):
        for key in ("prompt", "question"):
            if isinstance(row.get(key), str):
                return [row[key]]
        if isinstance(row.get("turns"), list) and all(isinstance(t, str) for t in row["turns"]):
            return list(row["turns"])
        if isinstance(row.get("messages"), list):
            user = [m.get("content") for m in row["messages"] if isinstance(m, dict) and m.get("role") == "user"]
            if user and all(isinstance(t, str) for t in user):
                return user
    raise InputError(f"{where}: expected a string or an object with 'prompt', 'question', 'turns' or 'messages' "
                     f"(user turns)")


def _load_file(path: Path) -> tuple[Prompt, ...]:
    """A prompt file's prompts (module docstring), in file order."""
    if not path.is_file():
        raise InputError(f"prompt file {path} not found")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{i}: not JSON ({e.msg})") from None
            turns = _turns(row, f"{path}:{i}")
        else:
            turns = [line]
        if not turns[0].strip():
            raise InputError(f"{path}:{i}: empty prompt")
        out.append(Prompt(id=f"{path.stem}/{i}", suite=path.stem, category=path.stem, turns=turns))
    if not out:
        raise InputError(f"prompt file {path} holds no prompts")
    return tuple(out)


def load_suite(name: str, limit: int | None = None) -> list[Prompt]:
    """Return the prompts of suite ``name`` (one of :data:`SUITES`, or a prompt file: module
    docstring) in their fixed order.

    ``limit`` keeps the first ``limit`` prompts.
    """
    if name not in SUITES and not is_prompt_file(name):
        raise InputError(f"unknown benchmark suite {name!r}; valid suites: {', '.join(SUITES)}, or a "
                         f"{' / '.join(PROMPT_FILE_SUFFIXES)} file of prompts")
    if limit is not None and limit < 0:
        raise InputError(f"limit must be >= 0, got {limit}")
    prompts = _load_file(Path(name)) if is_prompt_file(name) else _load(name)
    if limit is not None:
        prompts = prompts[:limit]
    # fresh lists so callers cannot mutate the cache
    return [Prompt(p.id, p.suite, p.category, list(p.turns), p.reference) for p in prompts]


def load_gsm8k_train() -> list[dict]:
    """The 7,473 GSM8K training rows: dicts with ``question`` and ``answer``."""
    return _read_jsonl("gsm8k", "train.jsonl")


def _iter_texts() -> Iterator[str]:
    for name in SUITES:
        for p in _load(name):
            yield from p.turns


def benchmark_texts() -> list[str]:
    """Every prompt text (every user turn) of every suite, de-duplicated, in suite order.

    Used to exclude benchmark prompts from training data.
    """
    return list(dict.fromkeys(_iter_texts()))
