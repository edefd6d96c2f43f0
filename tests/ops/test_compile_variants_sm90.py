"""The kernel variants the benchmark sweeps that `specla.ops.aot_check` does not list compile
for sm_90 without spilling (a few representative ones: each compile takes seconds)."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
from specla.ops.aot_check import compile_variant
from specla.ops.gdn import serial
worst = 0
for T, BV, w, defer, pend in ((1, 8, 1, False, False), (4, 16, 4, True, True), (16, 8, 1, True, True),
                              (8, 32, 8, False, True)):
    c = dict(H=8, HV=8, K=256, V=256, BK=256, BV=BV, NV=256 // BV, PP=16 if BV >= 16 else 8, T=T,
             TP=1 << max(0, T - 1).bit_length(), USE_DOT=BV >= 16, HAS_PENDING=pend, STORE_U=True,
             WRITE_FINAL=False, EVEN=True, DEFER=defer)
    _, info = compile_variant(serial.chain_verify_kernel, c, w)
    print("chain", T, BV, w, defer, pend, info)
    worst = max(worst, info["spill_bytes"])
raise SystemExit(1 if worst else 0)
"""


def test_chain_kernel_variants_compile_for_sm90_without_spills():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
