"""Bit-identical tokens and states across routes (docs/exact.md): exact mode in bf16, and
chains against plain AR without it.

The cases live in `exact_mode_cases.py` and run in a child process with torch's portable CPU
kernels (ATEN_CPU_CAPABILITY=default): torch reads it at import, and the vectorised kernels
round a loop's tail elements differently, which would make a value depend on its position in
a tensor on CPU (CUDA kernels do not). The rest of the suite keeps the vectorised kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specla.decode import Decoder
from specla.drafters.ngram import NgramDrafter
from specla.errors import InputError

from conftest import random_model, tiny_config

HERE = Path(__file__).parent


def _run_case(case: str) -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "exact_mode_cases.py"), case], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert f"{case}: ok" in proc.stdout


@pytest.mark.parametrize("case", ["routes", "control", "triton", "hybrid"])
def test_exact_mode_bitwise_in_bf16(case):
    """routes: chains, n-gram trees and random oracle trees (delayed and immediate commits)
    emit exact-mode AR's tokens and end in its GDN and conv states bit for bit, 8 random bf16
    models. control: without exact mode the same kind of run does not end in AR's state bit
    for bit (the checks can fail). triton: the same through the Triton kernels (interpreter)
    on emulated CUDA graphs. hybrid: chain routes on dense GDN + attention targets."""
    _run_case(case)


def test_default_chains_equal_ar_bitwise():
    """Without exact mode, on the fused path with row-invariant products and the Triton kernels,
    chains at their own verify width equal plain AR bit for bit, tokens and states
    (`exact_mode_cases.default_chains_equal_ar`; it fails with the AR step's prelude of
    3a5eec7)."""
    _run_case("default_chains")


def test_exact_mode_rejects_drafts_wider_than_its_width():
    model = random_model(tiny_config(0), 0)
    with pytest.raises(InputError, match="verify width"):
        Decoder(model, NgramDrafter(length=4, topk=4, budget=16), "tree", exact_width=8)


def test_exact_mode_equals_ar_in_float64():
    """The default torch kernels, float64: exact mode changes nothing about exactness."""
    cfg = tiny_config(4)
    model = random_model(cfg, 4)
    prompt = torch.tensor([[3, 5, 7, 3, 5, 7, 9, 3, 5]])
    ar = Decoder(model).run(prompt, 24)[0]
    for drafter, route in ((None, "ar"), (NgramDrafter(length=8, topk=1), "chain")):
        assert Decoder(model, drafter, route, exact_width=9).run(prompt, 24)[0] == ar


def test_exact_mode_on_cpu_says_which_kernels_it_needs(monkeypatch):
    """On CPU with torch's vectorised kernels exact mode warns that bitwise agreement needs
    ATEN_CPU_CAPABILITY=default; with the portable ones it does not."""
    import warnings

    model = random_model(tiny_config(0), 0)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.warns(UserWarning, match="ATEN_CPU_CAPABILITY=default"):
        Decoder(model, exact_width=9)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Decoder(model, exact_width=9)
