"""The kernels compile for the H200 (sm_90) without spilling: the interpreter cannot tell."""

import os
import subprocess
import sys

import pytest


def test_kernels_compile_for_sm90_without_spills():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "specla.ops.aot_check"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_pdl_forms_wait_before_they_trigger():
    """The verifiers, preludes and norm compile, as a Hopper launches them, with the grid
    dependency wait before the trigger that lets the next kernel launch (ops.pdl)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    code = (
        "from specla.ops import aot_check as a\n"
        "names = ('verify[chain+pending9] BV=16 w=4', 'parallel products+pending NT=32 BV=32 KW=64 BK=64',\n"
        "         'parallel solve NT=32 BV=32 KW=64 BK=64', 'tree_prelude', 'step_prelude', 'gated_rms_norm')\n"
        "for name, kernel, consts, warps, *extra in a.variants():\n"
        "    if name.startswith(names):\n"
        "        ptx = a.compile_variant(kernel, consts, warps)[0].asm['ptx']\n"
        "        w, t = ptx.find('griddepcontrol.wait'), ptx.find('griddepcontrol.launch_dependents')\n"
        "        print(name, w, t)\n"
        "        assert 0 <= w < t, name\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("\n") == 6, r.stdout


def test_pdl_only_where_a_gpu_can(monkeypatch):
    import torch

    from specla.ops import pdl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.enabled(torch.device("cuda", 0)) == (pdl.gdc_wait is not None)
    on = pdl.gdc_wait is not None
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": on, "launch_pdl": on}
    assert pdl.launch_options(torch.device("cuda", 0), allowed=False) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("SPECLA_PDL", "0")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("SPECLA_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))
