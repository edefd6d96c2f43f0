"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's kernels.

At batch 1 a layer is a chain of small launches (in_proj, prelude, verify, norm, out_proj...),
each waiting for the one before it to finish before its programs start. A kernel launched with
PDL may start while the kernel before it still runs: it does what does not depend on that
kernel (load the durable state tile, apply the pending update) and then waits (`wait_previous`:
griddepcontrol.wait, which returns once the previous kernel has finished and its writes are
visible), before reading anything the previous kernel wrote. Right after waiting it lets the
next kernel launch (griddepcontrol.launch_dependents), so a kernel's early part never overlaps
more than the kernel just before it: what it reads before waiting must have been written before
that kernel started, or by a kernel it waits for (every kernel here lets the next launch only
after its own wait, so whatever ran two launches back has finished before this one starts). Both instructions are recorded in CUDA graphs as programmatic edges.

`SPECLA_PDL=0` turns it off (A/B timings); the CPU and Triton's interpreter never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: `enabled` is then always False
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait for the kernel launched before this one, then let the next one launch (PDL only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _capable(index: int) -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    return (torch.cuda.get_device_capability(index)[0] >= 9
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA device of compute capability 9 or
    more, a Triton that can, and SPECLA_PDL not 0."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("SPECLA_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device, allowed: bool = True) -> dict:
    """A launch's PDL arguments: the kernel's `PDL` constexpr and Triton's `launch_pdl`, on
    together or off together (a kernel launched with PDL that never waits would race)."""
    on = allowed and enabled(device)
    return {"PDL": on, "launch_pdl": on}
