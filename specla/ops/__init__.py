"""Op dispatch: Triton kernels for CUDA tensors, the torch references everywhere else.

`SPECLA_BACKEND=torch|triton|auto` (or `set_backend`) overrides the choice; `triton` on CPU
runs the kernels under Triton's interpreter (TRITON_INTERPRET=1), which is how CI tests them.
float64 states always take the torch references (the exactness tests; Triton runs fp32).

GDN verification (docs/kernels.md):
- n = 1 or a chain: the serial verifier (state-resident, nothing materialised);
- a branching topology whose (V-tile, node) programs fit on the GPU at once (PATHS_MAX_PROGRAMS,
  the demo target's 16-node trees: 272): the path-parallel verifier, a program per root-to-leaf
  path on the serial kernel's arithmetic (AR's bits; on the H200 a 16-node round costs what it
  costs with the parallel verifier, whose bits differ from AR's, `paths.py`);
- a larger branching topology: the parallel verifier (UT form with the tree mask, no per-node
  pass over the state; two launches since 03d9ca7), for up to PARALLEL_MAX_NODES = 33 nodes, the
  largest size measured (its one-launch form beat the serial verifier on 17-node trees on the
  H200, 0.34-0.36 against 0.53-0.57 ms for 24 layers, kernels.json, d302d7f, and the hybrid on
  33-node ones on an H100, 0.67-0.74 against 0.83-0.94, kernels_e405d6b_h100.json; split over K
  it is 10-26% faster again, parallel_split_*_h100.json);
- in exact mode (`exact_arithmetic`, docs/exact.md), or beyond that size: the serial verifier in
  tree mode where the cost model (`schedule.SERIAL_COST`) expects it to be faster (few nodes,
  short chains), the chain-decomposed hybrid otherwise. Their nodes advance a resident state
  tile with the commit's own update, which exact mode's bitwise guarantee rests on.
The cost model's decision is made once per parent array (cached on the tensor, shared by all
layers of a round): free for CPU tensors and n = 1, one host sync on CUDA. Inside a CUDA-graph
capture the topology cannot be looked at (the graph must be right for every topology of its
size); there the size decides: up to CAPTURED_SERIAL_MAX_NODES nodes the serial verifier in tree
mode (it reads the parents on the device; on the H200 it beat the hybrid on every 16-node beam
tree of Table 1), beyond that the hybrid. `SPECLA_TREE_VERIFIER=auto|paths|parallel|serial|hybrid`
forces one kernel for branching topologies outside exact mode. The hybrid's schedule="auto"
variant, which applies the cost model on the device, is for benchmarks: slower in graph replay.
The kernel modules are imported on first use so that importing specla never compiles or
configures Triton.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from specla.ops.accept import naive as accept_ref
from specla.ops.attention import naive as attention_ref
from specla.ops.beam import naive as beam_ref
from specla.ops.conv import naive as conv_ref
from specla.ops.gdn import naive as gdn_ref
from specla.ops.linear import naive as linear_ref
from specla.ops.linear import tilings as linear_tilings
from specla.ops.norm import naive as norm_ref
from specla.ops.tree import naive as tree_ref
from specla.precision import accumulation_dtype

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("SPECLA_BACKEND", "auto")


def _tiling_from_env() -> dict:
    """`SPECLA_VERIFY_TILING=BV,WARPS`: the V-tile width and warps of the GDN verify, sequence
    and commit kernels (default 16, 4). One tiling serves every call, so a position's reduction
    order never depends on the route (exact mode, docs/exact.md)."""
    raw = os.environ.get("SPECLA_VERIFY_TILING", "16,4")
    try:
        block_v, num_warps = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"SPECLA_VERIFY_TILING={raw!r}: expected BV,WARPS such as 16,4") from None
    return {"block_v": block_v, "num_warps": num_warps}


TILING = _tiling_from_env()

CAPTURED_SERIAL_MAX_NODES = 24
PARALLEL_MAX_NODES = 33  # policy: parallel.MAX_NODES (64) is what the kernel takes
# the path-parallel verifier while its (V-tile, node) programs fit on the GPU at once (paths.py)
PATHS_MAX_NODES = 64  # the widest topology its path tables take (`ops.path_tables`)
PATHS_MAX_PROGRAMS = 512
TREE_VERIFIER = os.environ.get("SPECLA_TREE_VERIFIER", "auto")
if TREE_VERIFIER not in ("auto", "paths", "parallel", "serial", "hybrid"):
    raise ValueError(f"SPECLA_TREE_VERIFIER={TREE_VERIFIER!r}: expected auto, paths, parallel, serial or hybrid")
# `SPECLA_BEAM_EXPAND=torch`: the rollout's depth step as the plain torch reference, which
# Inductor fuses as it did before `beam_expand` existed (an A/B switch for benchmarks)
BEAM_EXPAND = os.environ.get("SPECLA_BEAM_EXPAND", "auto")
if BEAM_EXPAND not in ("auto", "torch"):
    raise ValueError(f"SPECLA_BEAM_EXPAND={BEAM_EXPAND!r}: expected auto or torch")
# `SPECLA_HEAD_EXPAND=modules`: a tree rollout's depth step as the drafter's norm and LM head
# (modules: Inductor's norm, cuBLAS) then `beam_expand`, instead of one `head_expand` (an A/B
# switch for benchmarks), read when the rollout is traced
HEAD_EXPAND = os.environ.get("SPECLA_HEAD_EXPAND", "auto")
if HEAD_EXPAND not in ("auto", "modules"):
    raise ValueError(f"SPECLA_HEAD_EXPAND={HEAD_EXPAND!r}: expected auto or modules")
# `SPECLA_DRAFT_FUSED=torch`: the drafter's step as separate norm, matmul, gate and add kernels
# (as Inductor fuses them) instead of `ops.fused_linear` and `ops.draft_inputs` (an A/B switch
# for benchmarks), read when the rollout is traced
DRAFT_FUSED = os.environ.get("SPECLA_DRAFT_FUSED", "auto")
if DRAFT_FUSED not in ("auto", "torch"):
    raise ValueError(f"SPECLA_DRAFT_FUSED={DRAFT_FUSED!r}: expected auto or torch")
_exact = False


@contextlib.contextmanager
def exact_arithmetic(on: bool = True):
    """Within: branching topologies take the verifiers whose nodes advance a resident state
    with the commit's update (serial, hybrid), never the parallel one (exact mode)."""
    global _exact
    old, _exact = _exact, on
    try:
        yield
    finally:
        _exact = old


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown op backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


@contextlib.contextmanager
def backend(name: str):
    old = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def use_triton(t: torch.Tensor) -> bool:
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)


def _gdn_triton(state: torch.Tensor) -> bool:
    return use_triton(state) and state.dtype == torch.float32


# From this many tokens on, a plain sequence goes to fla's chunk (prefill) kernel. Its GPU cost
# is small (~26 us per layer in graph replay, DESIGN §6); called eagerly it spends ~1 ms of host
# time per layer in fla's wrappers and autotuner lookups (H200 profile, 2026-12-01), where the
# serial kernel is one launch at ~1 us per token. A graph-replayed prefill chunk
# (`GraphTarget.prefill`, `chunked=True`) pays no host time: it takes the chunk kernel from
# chunk_tokens(K) on. At the demo shape (K = 64) and the graphed chunk widths (64-512), fla's
# five kernels cost ~33 us a layer (its KKT solve alone 16 us) plus a state copy and an output
# cast, and the serial kernel's one launch wins at 64 tokens and ties at 128 (H100, `bench
# prefill --modes sequence`: 0.74 against 1.01 ms at 64, 1.05 against 1.07 at 128, 1.66 against
# 1.17 at 256; prefill_fla_e81b74a_h100.json, prefill_serial_e81b74a_h100.json). A token's
# serial step grows with K (~1 us at K = 256, above), so wider heads keep fla from 64 tokens.
# `SPECLA_CHUNK_TOKENS` sets the bound for every K (an A/B switch).
CHUNK_MIN_TOKENS = 512
CHUNK_TOKENS = int(os.environ["SPECLA_CHUNK_TOKENS"]) if "SPECLA_CHUNK_TOKENS" in os.environ else None


def chunk_tokens(K: int) -> int:
    """Tokens from which a graph-replayed prefill chunk takes fla's chunk kernel, for key heads
    of K dims."""
    if CHUNK_TOKENS is not None:
        return CHUNK_TOKENS
    return 128 if K <= 64 else 64


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, chain=False, valid=None):
    """chain: the caller promises parents[:, j] = j - 1, which sends the verify to the serial
    kernel's chain mode without looking at the parents (inside a CUDA-graph capture it could
    not look). valid [B]: real nodes per row, the rest padding whose outputs nobody reads
    (`naive.gdn_tree_verify`); the serial and parallel kernels stop there."""
    if not _gdn_triton(state):
        return gdn_ref.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending, valid)
    from specla.ops.gdn import hybrid, parallel, paths, schedule, serial

    plan = None if chain else schedule.plan_for(parents)
    if chain or plan.is_chain(parents):
        return serial.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending, valid, chain=True,
                                      **TILING)
    n = parents.shape[1]
    kind = "auto" if _exact else TREE_VERIFIER
    if kind == "auto" and not _exact:
        tiles = v.shape[0] * v.shape[2] * -(-v.shape[3] // TILING["block_v"])  # the programs a node
        if n <= PATHS_MAX_NODES and tiles * n <= PATHS_MAX_PROGRAMS:
            kind = "paths"
        elif n <= PARALLEL_MAX_NODES and min(k.shape[3], v.shape[3]) >= 16:
            kind = "parallel"
    if kind == "paths":
        return paths.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending, valid, **TILING)
    if kind == "parallel":
        return parallel.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending, valid)
    if kind == "auto":
        prefer = plan.prefer_serial(parents)
        if prefer is None:  # inside a capture: decided by size (module docstring)
            prefer = n <= CAPTURED_SERIAL_MAX_NODES
        kind = "serial" if prefer else "hybrid"
    if kind == "serial":
        return serial.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending, valid, **TILING)
    # not the in-kernel serial fallback (schedule="auto"), which the H200 timed 1.7-1.9x slower
    # on 16-node trees in graph replay (kernels.json, hybrid_auto_ms)
    return hybrid.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending, **TILING)


def ancestor_closure(parents, width=None):
    """`schedule.ancestor_closure`: one Triton launch (`gdn/closure.py`) where Triton runs, up to
    64 nodes; the reference's batched matmuls elsewhere."""
    if use_triton(parents) and (width or parents.shape[1]) <= 64:
        from specla.ops.gdn import closure

        return closure.ancestor_closure(parents, width)
    from specla.ops.gdn import schedule

    return schedule.ancestor_closure(parents, width)


def path_tables(parents, valid=None):
    """`schedule.path_tables`: one Triton launch (`gdn/closure.py`) where Triton runs, up to 64
    nodes; torch ops elsewhere."""
    if use_triton(parents) and parents.shape[1] <= 64:
        from specla.ops.gdn import closure

        return closure.path_tables(parents, valid)
    from specla.ops.gdn import schedule

    return schedule.path_tables(parents, valid)


def gdn_commit(state, k, g, u, path, length):
    if not _gdn_triton(state):
        return gdn_ref.gdn_commit(state, k, g, u, path, length)
    from specla.ops.gdn import commit

    return commit.gdn_commit(state, k, g, u, path, length, **TILING)


def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gdn_sequence(q, k, v, g, beta, state, scale, chunked: bool = False):
    """Consume a plain sequence: short ones (decode, chains) on the serial kernel, long ones
    (prefill; from `chunk_tokens(K)` when `chunked`: a graph-replayed chunk) on fla's chunk kernel;
    without fla everything runs on the serial kernel."""
    if not _gdn_triton(state):
        return gdn_ref.gdn_recurrent(q, k, v, g, beta, state, scale)
    chunk = _fla_chunk() if v.shape[1] >= (chunk_tokens(k.shape[-1]) if chunked else CHUNK_MIN_TOKENS) else None
    if chunk is None:
        from specla.ops.gdn import serial

        return serial.gdn_chain_sequence(q, k, v, g, beta, state, scale, **TILING)
    # fla layout: q, k [B, T, H, K], v [B, T, HV, V], log-decay g and beta [B, T, HV], state
    # [B, HV, K, V] (state_v_first=False); q and k arrive l2-normalised.
    o, final = chunk(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=state,
                     output_final_state=True, use_qk_l2norm_in_kernel=False)
    state.copy_(final)
    return o.to(state.dtype)


def tree_conv(x, conv_state, weight, bias, parents):
    if not use_triton(x) or x.dtype == torch.float64:
        return conv_ref.tree_conv(x, conv_state, weight, bias, parents)
    from specla.ops.conv import triton as conv_triton

    return conv_triton.tree_conv(x, conv_state, weight, bias, parents)


def conv_commit(conv_state, x, path, length):
    if not use_triton(conv_state) or conv_state.dtype == torch.float64:
        return conv_ref.conv_commit(conv_state, x, path, length)
    from specla.ops.conv import triton as conv_triton

    return conv_triton.conv_commit(conv_state, x, path, length)


def gated_rms_norm(o, z, weight, eps, act, out_dtype):
    if not use_triton(o) or o.dtype != torch.float32:
        return norm_ref.gated_rms_norm(o, z, weight, eps, act, out_dtype)
    from specla.ops.norm import triton as norm_triton

    return norm_triton.gated_rms_norm(o, z, weight, eps, act, out_dtype)


def step_conv(x, conv_state, weight, bias):
    if not use_triton(x) or x.dtype == torch.float64:
        return conv_ref.step_conv(x, conv_state, weight, bias)
    from specla.ops.conv import triton as conv_triton

    return conv_triton.step_conv(x, conv_state, weight, bias)


def step_prelude(x, conv_state, weight, bias, a, b, A_log, dt_bias, num_heads, head_dim, neg_eigval,
                 state_dtype=torch.float32):
    if not use_triton(x) or x.dtype == torch.float64 or state_dtype != torch.float32:
        return conv_ref.step_prelude(x, conv_state, weight, bias, a, b, A_log, dt_bias, num_heads, head_dim,
                                     neg_eigval, state_dtype)
    from specla.ops.conv import triton as conv_triton

    return conv_triton.step_prelude(x, conv_state, weight, bias, a, b, A_log, dt_bias, num_heads, head_dim,
                                    neg_eigval, state_dtype)


def tree_prelude_takes(x, state_dtype) -> bool:
    """Whether `tree_prelude` runs as one kernel for these pre-conv inputs and state precision
    (else the fused path keeps ops.tree_conv and its compiled factors region)."""
    return use_triton(x) and x.dtype != torch.float64 and state_dtype == torch.float32


def tree_prelude(x, conv_state, weight, bias, parents, a, b, A_log, dt_bias, num_heads, head_dim, neg_eigval,
                 state_dtype=torch.float32):
    if not tree_prelude_takes(x, state_dtype):
        return conv_ref.tree_prelude(x, conv_state, weight, bias, parents, a, b, A_log, dt_bias, num_heads,
                                     head_dim, neg_eigval, state_dtype)
    from specla.ops.conv import triton as conv_triton

    return conv_triton.tree_prelude(x, conv_state, weight, bias, parents, a, b, A_log, dt_bias, num_heads,
                                    head_dim, neg_eigval, state_dtype)


def conv_sequence(x, conv_state, weight, bias, valid=None):
    return conv_ref.conv_sequence(x, conv_state, weight, bias, valid)


# tilings of the batch-1 matmul kernels (`ops.linear.triton` TILINGS / SKINNY_TILINGS, all of
# which `specla bench gemv` times): per weight shape the measured fastest kernel and tiling
# (`ops.linear.tilings`), else these
GEMV_TILING = ("gemv", {"block_n": 8, "block_k": 512, "num_warps": 4})
SKINNY_TILING = ("skinny", {"block_n": 32, "block_k": 128, "num_warps": 4})
LINEAR_TILINGS = linear_tilings.load()


@torch.library.custom_op("specla::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times weightᵀ for the few rows of a batch-1 step: where Triton runs, one row
    goes to the GEMV kernel and up to SKINNY_MAX_ROWS rows (a verify) to the skinny GEMM
    (`ops.linear`), each at its shape's measured tiling (`LINEAR_TILINGS`); more rows (a
    prefill), and shapes where cuBLAS measured faster, to F.linear; the reference elsewhere and
    for fp64. A
    custom op, so that inside a compiled region it stays one opaque call (`fused.GEMVS`)."""
    if not use_triton(x) or x.dtype == torch.float64:
        return linear_ref.skinny(x, weight)
    from specla.ops.linear import triton as linear_triton

    rows = x.numel() // max(x.shape[-1], 1)
    kernel, tiling = "cublas", None
    if rows == 1:
        kernel, tiling = LINEAR_TILINGS.get(("gemv", *weight.shape), GEMV_TILING)
    elif rows <= linear_triton.SKINNY_MAX_ROWS and x.shape[-1] >= 16:
        kernel, tiling = LINEAR_TILINGS.get(("skinny", *weight.shape), SKINNY_TILING)
    if kernel == "gemv":
        return linear_triton.gemv(x, weight, **tiling)
    if kernel == "skinny" and x.shape[-1] >= 16:
        return linear_triton.skinny(x, weight, **tiling)
    return torch.nn.functional.linear(x, weight)


@torch.library.custom_op("specla::invariant_linear", mutates_args=())
def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x times weightᵀ with every row's result independent of how many rows come with it, for
    up to SKINNY_MAX_ROWS rows: where Triton runs, the skinny GEMM with 32-row blocks at one
    tiling per weight shape whatever the row count, so each row is the same chain of `tl.dot`s
    over the same K tiles (cuBLAS picks another kernel for 1, 9 or 17 rows, and those round
    differently); elsewhere the reference row by row. More rows (a prefill, which every route
    shares) go to F.linear. The fused path's `gemv="invariant"` (docs/exact.md): an AR step
    then computes a position as a verify does whatever cuBLAS would pick. A custom op, so that
    a compiled region keeps it one opaque call."""
    from specla.ops.linear import triton as linear_triton

    K = x.shape[-1]
    if x.numel() // max(K, 1) > linear_triton.SKINNY_MAX_ROWS:
        return torch.nn.functional.linear(x, weight)
    if not use_triton(x) or x.dtype == torch.float64 or K < 16:
        return linear_ref.rowwise(x, weight)
    _, tiling = LINEAR_TILINGS.get(("skinny", *weight.shape), SKINNY_TILING)
    if tiling is None:  # cuBLAS measured fastest for this shape: the default tiling then
        tiling = SKINNY_TILING[1]
    tiling = {k: v for k, v in tiling.items() if k != "block_m"}  # one row block for every row count
    return linear_triton.skinny(x, weight, block_m=linear_triton.SKINNY_MAX_ROWS, **tiling)


# `SPECLA_FP32_LINEAR=rows`: fp32 products of 2-32 rows by specla's multiply-add kernel
# (`_fp32_linear`) instead of cuBLAS. On the H200 it cut the demo's fp32 chain round from 2.0 to
# 1.28 ms (rounds_fp32_rows_accacad.json); opt-in until the fp32 exact-match run is repeated with
# it (`e2e_fp32.json` measured cuBLAS's arithmetic).
FP32_LINEAR = os.environ.get("SPECLA_FP32_LINEAR", "cublas")
if FP32_LINEAR not in ("cublas", "rows"):
    raise ValueError(f"SPECLA_FP32_LINEAR={FP32_LINEAR!r}: expected cublas or rows")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The model's and the drafter's matmul: F.linear, or under SPECLA_FP32_LINEAR=rows for fp32
    activations where Triton runs, outside autograd, `_fp32_linear`."""
    if (FP32_LINEAR == "rows" and x.dtype == torch.float32 and use_triton(x)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return _fp32_linear(x, weight)
    return torch.nn.functional.linear(x, weight)


@torch.library.custom_op("specla::fp32_linear", mutates_args=())
def _fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """2 to SKINNY_MAX_ROWS fp32 rows by multiply-adds (`ops.linear.triton.rows`), the rest on
    cuBLAS. With TF32 off (fp32 is meant to be fp32), cuBLAS takes a memset and an FFMA kernel
    of 26-32 µs for the demo target's 9-row verify matmuls that take 3-4 µs at 1 row (H200,
    `benchmarks/diagnostics/gemm_rows.py`): an fp32 chain round cost 2.0 ms against bf16's 0.9.
    A custom op, so that a compiled region keeps it one opaque call."""
    from specla.ops.linear import triton as linear_triton

    if 2 <= x.numel() // max(x.shape[-1], 1) <= linear_triton.SKINNY_MAX_ROWS:
        return linear_triton.rows(x, weight)
    return torch.nn.functional.linear(x, weight)


def _fused_rows(x: torch.Tensor, rows: int | None = None, width: int | None = None) -> bool:
    """Whether the fused kernels take x's rows (or `rows` entries of `width` values): Triton, not
    fp64, at most FUSED_MAX_ROWS rows of at most FUSED_ONE_TILE values (one tile a row)."""
    from specla.ops.linear import triton as linear_triton

    rows = x.numel() // max(x.shape[-1], 1) if rows is None else rows
    width = x.shape[-1] if width is None else width
    return (use_triton(x) and x.dtype != torch.float64 and rows <= linear_triton.FUSED_MAX_ROWS
            and width <= linear_triton.FUSED_ONE_TILE)


# Above this many outputs, several rows stay on norm + cuBLAS: the demo's LM head (8192
# outputs) at 4 rows took 5.4 µs fused at its best tiling against 4.8 µs for the modules
# (fused_linear_adcfc79.json); cuBLAS runs several rows on the tensor cores.
FUSED_MAX_OUTPUTS_MULTIROW = 4096


def fuses_linear(x: torch.Tensor, weight: torch.Tensor, rows: int | None = None) -> bool:
    """Whether a drafter should call `fused_linear` (or `draft_inputs`) for x and weight: it
    runs x's rows (or `rows` entries) as one Triton launch, outside autograd, unless
    SPECLA_DRAFT_FUSED=torch (else the caller composes its modules: training, fp64, CPU, more
    rows than a draft step has, rows longer than a tile, as the 1.3B stand-in's, a wide matmul of
    several rows)."""
    rows = x.numel() // max(x.shape[-1], 1) if rows is None else rows
    return (DRAFT_FUSED == "auto" and not torch.is_grad_enabled() and _fused_rows(x, rows, weight.shape[1])
            and (rows == 1 or weight.shape[0] <= FUSED_MAX_OUTPUTS_MULTIROW))


@torch.library.custom_op("specla::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                 eps: float = 1e-6, residual: Optional[torch.Tensor] = None, glu: bool = False) -> torch.Tensor:
    """A draft step's matmul with the RMS norm before it, SwiGLU's gate or the residual add
    after it (`ops.linear.naive.fused`): one Triton launch where `_fused_rows`, the reference
    elsewhere (callers ask `fuses_linear` first). On the demo
    drafter's step (H200) every norm, gate and add was a launch of its own: 4.1-6.0 µs a
    matmul with them against 2.0-2.8 fused (fused_linear_adcfc79.json). A custom op, so that
    inside the drafter's compiled rollout it stays one opaque call."""
    if not _fused_rows(x):
        return linear_ref.fused(x, weight, norm_weight, eps, residual, glu)
    from specla.ops.linear import triton as linear_triton

    return linear_triton.fused(x, weight, norm_weight, eps, residual, glu)


@fused_linear.register_fake
def _fused_linear_shape(x, weight, norm_weight=None, eps=1e-6, residual=None, glu=False):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2 if glu else weight.shape[0])


@torch.library.custom_op("specla::draft_inputs", mutates_args=())
def draft_inputs(table: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor, src: torch.Tensor,
                 norm_emb: torch.Tensor, norm_feat: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """An EAGLE draft step's input (`ops.linear.naive.draft_inputs`: the tokens' embeddings and
    the parents' features, each RMS-normalised, through fc): one Triton launch where Triton runs
    and the entries are few (callers ask `fuses_linear` with fc's weight), the reference
    elsewhere. A custom op, so that inside the drafter's compiled rollout it stays one opaque
    call."""
    if not _fused_rows(h, tokens.numel(), weight.shape[1]):
        return linear_ref.draft_inputs(table, tokens, h, src, norm_emb, norm_feat, eps, weight)
    from specla.ops.linear import triton as linear_triton

    return linear_triton.draft_inputs(table, tokens, h, src, norm_emb, norm_feat, eps, weight)


@draft_inputs.register_fake
def _draft_inputs_shape(table, tokens, h, src, norm_emb, norm_feat, eps, weight):
    return h.new_empty(*tokens.shape, weight.shape[0])


@torch.library.custom_op("specla::masked_attention", mutates_args=())
def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """A draft step's attention (`ops.attention.naive.masked_attention`): one or two Triton
    launches where Triton runs (cuDNN's SDPA took ~6-7 µs a call for these few queries, fp32's
    memory-efficient kernel 26 µs), the reference elsewhere and for float64. A custom op, so
    that inside the drafter's compiled rollout it stays one opaque call."""
    if not use_triton(q) or q.dtype == torch.float64:
        return attention_ref.masked_attention(q, keys, values, mask, scale)
    from specla.ops.attention import triton as attention_triton

    return attention_triton.masked_attention(q, keys, values, mask, scale)


@masked_attention.register_fake
def _masked_attention_shape(q, keys, values, mask, scale):
    return q.new_empty(*q.shape[:2], q.shape[2] * q.shape[3])


@torch.library.custom_op("specla::draft_attention", mutates_args=("keys", "values"))
def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    length: torch.Tensor, depth: int, start: int, rows: Optional[torch.Tensor],
                    inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """A draft step's RoPE, cache writes, mask and attention (`ops.attention.naive.draft_attention`):
    the masked attention's one or two Triton launches where Triton runs, which left two Inductor
    kernels a step behind (RoPE + store, the mask), the reference elsewhere and for float64.
    Writes keys and values in place: they are graph inputs (views of the drafter's cache) of
    the compiled rollout, which updates them where they are, without a copy."""
    if not use_triton(q) or q.dtype == torch.float64:
        return attention_ref.draft_attention(q, k, v, keys, values, length, depth, start, rows, inv_freq, scale)
    from specla.ops.attention import triton as attention_triton

    return attention_triton.draft_attention(q, k, v, keys, values, length, depth, start, rows, inv_freq, scale)


@draft_attention.register_fake
def _draft_attention_shape(q, k, v, keys, values, length, depth, start, rows, inv_freq, scale):
    return q.new_empty(*q.shape[:2], q.shape[2] * q.shape[3])


@torch.library.custom_op("specla::beam_expand", mutates_args=())
def beam_expand(logits: torch.Tensor, beam_scores: torch.Tensor, topk: int,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rollout depth (`ops.beam.naive.beam_expand`): one or two Triton launches where Triton
    runs (Inductor made a dozen or more kernels of it), the reference elsewhere and for float64.
    A custom op, so that inside the drafter's compiled rollout it stays one opaque call."""
    if not use_triton(logits) or logits.dtype == torch.float64:
        return beam_ref.beam_expand(logits, beam_scores, topk, scale)
    from specla.ops.beam import triton as beam_triton

    return beam_triton.beam_expand(logits, beam_scores, topk, scale)


@beam_expand.register_fake
def _beam_expand_shape(logits, beam_scores, topk, scale=1.0):
    B, nb, _ = logits.shape
    return (logits.new_empty(B, nb * topk, dtype=torch.long),
            logits.new_empty(B, nb * topk, dtype=accumulation_dtype(logits.dtype)),
            logits.new_empty(B, topk, dtype=torch.long))


def fuses_head(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a tree rollout should score its beams' hidden states h [B, nb, D] with
    `head_expand` (the LM head weight [V, D] inside the depth step's chunk kernel): Triton,
    outside autograd, not fp64, at most 16 beams of rows one program holds, unless
    SPECLA_HEAD_EXPAND=modules, SPECLA_DRAFT_FUSED=torch or SPECLA_BEAM_EXPAND=torch."""
    from specla.ops.beam import triton as beam_triton

    return (HEAD_EXPAND == DRAFT_FUSED == BEAM_EXPAND == "auto" and not torch.is_grad_enabled() and use_triton(h)
            and h.dtype != torch.float64 and h.shape[-2] <= 16 and weight.shape[1] <= beam_triton.MAX_HEAD_WIDTH)


@torch.library.custom_op("specla::head_expand", mutates_args=())
def head_expand(h: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                beam_scores: Optional[torch.Tensor], topk: int, scale: float = 1.0,
                rows: Optional[torch.Tensor] = None, start: int = 0, entries: int = 0,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor]:
    """`beam_expand` of the logits of a drafter's head, and the next beams' tokens, scores,
    parents and ancestor rows (`ops.beam.naive.head_expand`): two
    Triton launches from the beams' hidden states where `fuses_head` (the norm, the head and
    the chunks' reductions in the first), the reference elsewhere. A custom op, so that inside
    the drafter's compiled rollout it stays one opaque call."""
    if not fuses_head(h, weight):
        return beam_ref.head_expand(h, weight, norm_weight, eps, beam_scores, topk, scale, rows, start, entries)
    from specla.ops.beam import triton as beam_triton

    return beam_triton.head_expand(h, weight, norm_weight, eps, beam_scores, topk, scale, rows, start, entries)


@head_expand.register_fake
def _head_expand_shape(h, weight, norm_weight, eps, beam_scores, topk, scale=1.0, rows=None, start=0, entries=0):
    B, nb, _ = h.shape
    acc = accumulation_dtype(h.dtype)
    return (h.new_empty(B, nb * topk, dtype=torch.long), h.new_empty(B, nb * topk, dtype=acc),
            h.new_empty(B, topk, dtype=torch.long), h.new_empty(B, topk, dtype=torch.long),
            h.new_empty(B, topk, dtype=acc), h.new_empty(B, topk, dtype=torch.long),
            h.new_empty(B, topk, entries, dtype=torch.bool))


@torch.library.custom_op("specla::build_tree", mutates_args=())
def build_tree(root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, budget: int,
               tau: Optional[float], depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rollout pool's selection and packing (`ops.tree.naive.build_batch`): one Triton launch
    where Triton runs, up to 256 pool nodes, the reference elsewhere and for float64 scores. A
    custom op, so that inside the drafter's compiled rollout it stays one opaque call."""
    if not use_triton(scores) or scores.dtype == torch.float64 or max(scores.shape[1], budget + 1) > 256:
        return tree_ref.build_batch(root, tokens, parents, scores, budget, tau, depth)
    from specla.ops.tree import triton as tree_triton

    return tree_triton.build_batch(root, tokens, parents, scores, budget, tau, depth)


@build_tree.register_fake
def _build_tree_shape(root, tokens, parents, scores, budget, tau, depth):
    B, P = scores.shape
    M = min(budget, P)
    return (tokens.new_empty(B, M + 1), tokens.new_empty(B, M + 1), tokens.new_empty(B))


@torch.library.custom_op("specla::greedy_walk", mutates_args=())
def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor,
                valid: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance's walk over a topology (`ops.accept.naive.greedy_walk`): one Triton
    launch where Triton runs, the reference elsewhere. A custom op, so that inside the round's
    compiled acceptance it stays one opaque call (Inductor made ~22 kernels of a 17-node walk)."""
    if not use_triton(tokens):
        return accept_ref.greedy_walk(tokens, parents, target, valid)
    from specla.ops.accept import triton as accept_triton

    return accept_triton.greedy_walk(tokens, parents, target, valid)


@greedy_walk.register_fake
def _greedy_walk_shape(tokens, parents, target, valid=None):
    B, n = tokens.shape
    return (tokens.new_empty(B, n, dtype=torch.long), tokens.new_empty(B, dtype=torch.long),
            tokens.new_empty(B, dtype=torch.long))


@skinny_linear.register_fake
@invariant_linear.register_fake
@_fp32_linear.register_fake
def _skinny_linear_shape(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
