"""The fused decode path: each layer's elementwise glue compiled into a few kernels.

`Model.forward` / `Model.verify` in plain PyTorch launch ~50 small kernels per GDN layer
(fp32 RMSNorms, l2norms, softplus/exp gates, the gated output norm, SwiGLU, conv-state
shuffling, dtype casts). At batch 1 a decode step is launch-bound even inside a CUDA graph
(DESIGN §6: 4.03 ms per AR step against a 0.70 ms weight floor). `fuse(model)` (or
`SPECLA_COMPILE=1`, applied when a target is built, `specla.engine`) routes the decode-time
calls through this module instead:

- one AR step (`forward` with T = 1) and every verify (`verify`, any topology);
- per GDN layer, `torch.compile`d pure functions of the layer's tensors, with specla's
  Triton ops called eagerly between them (opaque to the compiler):

      [residual add + attn RMSNorm + in_proj] -> ops.step_prelude (conv, silu, factors)       (AR)
      [residual add + attn RMSNorm + in_proj + short conv + silu + l2norm(q|k) + g + beta]   (prefill)
      [residual add + attn RMSNorm + in_proj] -> ops.tree_prelude (tree conv, silu, factors)  (verify)
        (without Triton, or for an fp64 or low-precision state: ops.tree_conv -> [silu'd conv out -> factors])
      ops.gdn_sequence / ops.gdn_tree_verify -> ops.gated_rms_norm                (Triton)
      [o_proj + residual add + MLP RMSNorm + gate|up + SwiGLU + down]
      ... next layer's first region adds the MLP output to the residual ...
      [residual add + final RMSNorm + LM head]

  An AR step's conv and factors are one Triton kernel, so are a verify's, and
  so is the gated output norm: Inductor made seven small kernels of the former and two of the
  latter (several reductions over differently shaped slices; ~10 us and nine launches a layer
  of a 1.62 ms AR step on the H200). The MLP output is handed to the next region unsummed, so
  every residual add fuses into the RMSNorm that reads it. Weights are arguments (not closed over), so one compiled graph
  serves all layers of a shape; the layer's constants (eps, head sizes, dtypes) are closure
  constants. gate_proj and up_proj run as one matmul over a concatenated copy of the two
  weights (`concat_mlp`; it costs their memory once more).
- Attention and MoE layers (hybrid stacks) run their plain modules in between.

Compilation is static apart from one dimension (`fullgraph=True`, `dynamic=False` unless a
call marks a dimension): the AR step (T = 1) is one static graph per region; verifies mark
their node dimension dynamic (`dynamic_tokens`, the default), so one graph per region serves
every topology size — drafters whose sizes vary round to round (prompt lookup, pruned trees
run eagerly) never trigger a compile storm. `dynamic_tokens=False` (`SPECLA_COMPILE_DYNAMIC=0`)
compiles one static graph per verify size instead. `GraphTarget` runs every function twice
before it captures (warm-up), so compilation and Inductor's autotuning happen before capture
and a replay never recompiles. Prefill (T > 1 through `forward`, up to MAX_PREFILL tokens a
call) runs the AR step's regions with the token dimension symbolic: one compile serves every
prompt length, and a prompt costs a few kernels a layer instead of the plain path's ~50 eager
launches (prefill was a third of a 128-token generation on the demo target). With static
shapes (`dynamic_tokens=False`) prefill stays on the plain path, so prompt lengths never
trigger compiles; verify shapes beyond `max_shapes` distinct ones fall back to the plain path
(a GraphTarget uses one shape per budget).

Inductor is told to round like eager (`emulate_precision_casts`), so the fused path equals
the plain one up to the accumulation order of reductions: fp32 runs agree to ~1e-6, bf16
runs to bf16 rounding.

Modes (`SPECLA_COMPILE` or `fuse(model, mode=...)`): `default` (Inductor's Triton kernels for
the glue, cuBLAS for the matmuls), `max-autotune` (also lets Inductor autotune Triton matmul
templates against cuBLAS and fuse epilogues into them; much longer compiles).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F

from specla import ops
from specla.layers import GatedMLP
from specla.model import GatedDeltaNet, ModelOutput
from specla.ops.conv import naive as conv_ref
from specla.ops.gdn import naive as gdn_ref
from specla.precision import accumulation_dtype
from specla.state import GDNRecord

ENV = "SPECLA_COMPILE"
MODES = ("default", "max-autotune")
GEMVS = ("cublas", "triton", "invariant")  # how a batch-1 step's matmuls run (`_linear`)
MAX_TOKENS = 256  # verify topologies larger than this stay on the plain path
MAX_PREFILL = 4096  # longer prefill calls stay on the plain path


def env_mode() -> str | None:
    """The mode `SPECLA_COMPILE` asks for: None (off), 'default' or 'max-autotune'."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return None
    if v in ("1", "true", "yes", "on", "default"):
        return "default"
    if v in MODES:
        return v
    raise ValueError(f"{ENV}={v!r}: use 0, 1 or one of {', '.join(MODES)}")


def fuse(model, enable: bool = True, **options):
    """Opt `model` in to the fused decode path (AR steps and verifies through torch.compile'd
    per-layer regions; options: `FusedModel`'s); `fuse(model, False)` returns it to the plain
    path. Returns the model."""
    model._fused = FusedModel(model, **options) if enable else None
    return model


def maybe_fuse(model) -> None:
    """Fuse `model` when `SPECLA_COMPILE` asks for it (called when a target is built);
    `SPECLA_COMPILE_DYNAMIC=0` compiles one static graph per verify size instead of one
    graph with a symbolic node count; `SPECLA_COMPILE_GEMV=triton` runs the steps' and
    verifies' matmuls through specla's batch-1 kernels (`_linear`; `invariant`: kernels whose
    rows do not depend on the row count)."""
    mode = env_mode()
    if mode is not None and getattr(model, "_fused", None) is None:
        dyn = os.environ.get(ENV + "_DYNAMIC", "1").strip().lower() not in ("0", "false", "no", "off")
        fuse(model, mode=mode, dynamic_tokens=dyn, gemv=os.environ.get(ENV + "_GEMV", "cublas").strip().lower())


def _options(mode: str) -> dict:
    import torch._inductor.config as ic

    opts = {}
    if hasattr(ic, "emulate_precision_casts"):
        opts["emulate_precision_casts"] = True  # round intermediates where eager would
    if mode == "max-autotune":
        opts.update({"max_autotune": True, "max_autotune_gemm": True})
    return opts


def _raise_recompile_limit(limit: int = 64) -> None:
    """Each (function, shape) is one cache entry; the default limit (8) is too small."""
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit"):
        try:
            if getattr(dc, name) < limit:
                setattr(dc, name, limit)
            return
        except AttributeError:
            continue


def _compile_count() -> int:
    """Graphs dynamo has compiled so far in this process (0 if the counter is unavailable)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private counter; the stance is the main check
        return 0


def _refuse_compiles():
    """A context in which dynamo raises instead of compiling (torch >= 2.6); a no-op otherwise."""
    try:
        return torch.compiler.set_stance("fail_on_recompile")
    except Exception:  # noqa: BLE001
        return contextlib.nullcontext()


@contextlib.contextmanager
def no_compiles():
    """Around a CUDA graph capture of compiled code: nothing may compile in it.

    The warm-up before a capture compiles everything the capture runs; a cache miss under
    capture (a guard failing on a new shape, dtype or option) would compile — and autotune,
    and run the new graph — inside the capture, which either fails obscurely or records a
    graph nobody checked. So dynamo is told to refuse any compile (stance
    `fail_on_recompile`), and a compile counter is compared around the capture as a second
    check; either turns into a RuntimeError naming the cause."""
    before = _compile_count()
    try:
        with _refuse_compiles():
            yield
    except Exception as e:
        if "fail_on_recompile" in str(e) or "recompile" in type(e).__name__.lower():
            raise RuntimeError(
                "specla.fused: a compiled region needed a (re)compile during CUDA graph capture "
                "(the warm-up did not cover this call: new shape, dtype or guard). The graph is "
                "discarded; run without SPECLA_COMPILE or report this. Cause: "
                f"{(str(e).splitlines() or [''])[0][:300]}") from e
        raise
    after = _compile_count()
    if after != before:
        raise RuntimeError(f"specla.fused: {after - before} graph(s) compiled during CUDA graph capture; "
                           "the captured graph is not trusted (run without SPECLA_COMPILE)")


def mode_of(model) -> str | None:
    """The compile mode of a fused model (`fuse`, `SPECLA_COMPILE`); None when plain."""
    fz = getattr(model, "_fused", None)
    return fz.mode if fz is not None and fz.compile else None


def compile_for_graph(fn, mode: str | None, dynamic: bool = False, combo: bool = False):
    """(compiled fn, capture guard factory) for a function captured in a CUDA graph beside a
    fused target (`mode`: its compile mode, `mode_of`); (fn, a no-op guard) when mode is None.
    dynamic: shapes are static except dimensions a call marks (`mark_dynamic`). combo:
    Inductor's combo kernels, one launch for kernels that do not depend on each other (a
    round's bookkeeping: ~17 small kernels of ~2.6 µs, most of them independent stores).

    A drafter's step is a handful of small matmuls among dozens of elementwise ops, norms,
    masks and gathers; compiled whole (static shapes, `fullgraph`), one graph replay launches
    a few fused kernels per step instead of ~175. The warm-up before a capture compiles;
    the guard makes a compile inside the capture raise instead."""
    if mode is None:
        return fn, contextlib.nullcontext
    _raise_recompile_limit()
    opts = {**_options(mode), **({"combo_kernels": True} if combo else {})}
    return torch.compile(fn, dynamic=None if dynamic else False, fullgraph=True, options=opts), no_compiles


# ---- pure functions of a layer's tensors (compiled) ------------------------------------------

def _rms(x, w, eps: float, zc: bool):
    """`layers.RMSNorm.forward` with the weight as an argument."""
    xf = x if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    w = w.to(y.dtype)
    return (y * (1 + w if zc else w)).to(x.dtype)


def _make_factors(H, K, neg, sdt):
    def factors(xc, a, b, A_log, dt_bias):
        """`ops.gdn.naive.factors` (q and k l2-normalised together: one reduction)."""
        return gdn_ref.factors(xc.to(sdt), a, b, A_log, dt_bias, H, K, neg, sdt)
    return factors


def _linear(x, w, gemv: str):
    """`ops.linear` (F.linear, or fp32's few-row products by multiply-adds under
    SPECLA_FP32_LINEAR=rows), or with gemv "triton" specla's batch-1 matmul kernels for every
    dtype (`ops.skinny_linear`, a custom op: one opaque call inside the compiled region): the
    GEMV for an AR step's single row, the skinny GEMM for a verify's few. Inductor generating the GEMV itself, as a
    reduction with the norm fused into its loads, was measured slower than cuBLAS on the H200
    (AR step 2.08 against 1.64 ms; docs/benchmark-log.md). With gemv "invariant", `ops.invariant_linear`:
    a row's result does not depend on how many rows the call has, by construction (cuBLAS's
    measured so at the demo target's shapes, row_invariance_e7ca6a9.json, but promises nothing)."""
    if gemv == "invariant":
        return ops.invariant_linear(x, w)
    return ops.skinny_linear(x, w) if gemv == "triton" else ops.linear(x, w)


def _make_seq_pre(eps, zc, sizes, conv, use_gate, factor_consts, gemv="cublas"):
    factors = _make_factors(*factor_consts)

    def seq_pre(x, r, norm_w, in_w, conv_state, conv_w, conv_b, A_log, dt_bias, valid=None):
        """Residual add, norm, projection, short conv (conv state advanced in place), factors.
        valid [B] (a graph prefill's padded chunk): the conv state stops at the valid[b]-th
        token and a padding token neither decays nor writes the state (g = β = 0)."""
        if r is not None:
            x = x + r
        xp, z, a, b = torch.split(_linear(_rms(x, norm_w, eps, zc), in_w, gemv), sizes, dim=-1)
        if conv:
            xc = conv_ref.conv_taps(xp, conv_state, conv_w, conv_b, valid)  # multiply-adds: it fuses
        else:
            xc = F.silu(xp)
        q, k, v, g, beta = factors(xc, a, b, A_log, dt_bias)
        if valid is not None:
            g, beta = gdn_ref.mask_padding(g, beta, valid)
        return x, q, k, v, g, beta, (z if use_gate else None)
    return seq_pre


def _make_tree_in(eps, zc, sizes, use_gate, gemv="cublas"):
    def tree_in(x, r, norm_w, in_w):
        """Residual add, norm, projection: the pre-conv inputs go to ops.tree_conv."""
        if r is not None:
            x = x + r
        xp, z, a, b = torch.split(_linear(_rms(x, norm_w, eps, zc), in_w, gemv), sizes, dim=-1)
        return x, xp, (z if use_gate else None), a, b
    return tree_in


def _make_post(eps_m, zc, I, gemv="cublas"):
    def post(y, x, o_w, mlp_norm_w, w1, w2, down_w):
        """o_proj of the normed mixer output y, residual add, MLP norm, SwiGLU MLP; the MLP
        output is returned unsummed (the next region adds it to the residual)."""
        x = x + _linear(y, o_w, gemv)
        h = _rms(x, mlp_norm_w, eps_m, zc)
        if w2 is None:  # w1 = [gate; up]
            gu = _linear(h, w1, gemv)
            gate, up = gu[..., :I], gu[..., I:]
        else:
            gate, up = _linear(h, w1, gemv), _linear(h, w2, gemv)
        return x, _linear(F.silu(gate) * up, down_w, gemv)
    return post


def _make_head(eps, zc, gemv="cublas"):
    def head(x, r, norm_w, lm_w):
        if r is not None:
            x = x + r
        return x, _linear(_rms(x, norm_w, eps, zc), lm_w, gemv)
    return head


def _make_embed():
    def embed(tokens, table):
        """The token embeddings as a gather Inductor writes: eagerly a verify of a drafter
        graph's 13 tokens (a strided view) took one 10.6 µs index_select on the H200
        (controlled_55d95ad_h200.json)."""
        return F.embedding(tokens, table)
    return embed


_MAKERS = {"factors": _make_factors, "seq_pre": _make_seq_pre, "tree_in": _make_tree_in,
           "post": _make_post, "head": _make_head, "embed": _make_embed}
_COMPILED: dict = {}


class _Region:
    """A compiled region. Should Inductor fail to compile it with eager-style rounding
    (`emulate_precision_casts`), it is compiled again without that option, with a warning
    (Inductor then keeps some bf16 intermediates in fp32: still within bf16 rounding). Any
    other failure, or a failure without the option, raises."""

    def __init__(self, fn, mode: str, dynamic: bool):
        self.fn, self.dynamic, self.opts = fn, dynamic, _options(mode)
        self.call = self._compile()

    def _compile(self):
        return torch.compile(self.fn, dynamic=None if self.dynamic else False, fullgraph=True,
                             options=dict(self.opts))

    def __call__(self, *args):
        from torch._dynamo.exc import BackendCompilerFailed

        try:
            return self.call(*args)
        except BackendCompilerFailed as e:  # raised before the graph runs: nothing was written
            if not self.opts.pop("emulate_precision_casts", False):
                raise
            import warnings

            warnings.warn(f"specla.fused: Inductor failed with emulate_precision_casts ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); compiling without it", stacklevel=2)
            self.call = self._compile()
            return self.call(*args)


def compiled(kind: str, consts: tuple, mode: str = "default", dynamic: bool = False):
    """The compiled function of `kind` for these closure constants (shared by every layer and
    every model with the same constants). `dynamic`: shapes are static unless a call marks a
    dimension dynamic (`FusedModel(dynamic_tokens=True)` marks the token dimension)."""
    key = (kind, consts, mode, dynamic)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _Region(_MAKERS[kind](*consts), mode, dynamic)
    return fn


def eager(kind: str, consts: tuple):
    """The same function uncompiled (tests: it is what the compiler sees)."""
    return _MAKERS[kind](*consts)


# ---- the fused model -------------------------------------------------------------------------

def mark_dynamic(dim: int, *ts) -> None:
    """Mark dimension `dim` of these inputs of a compiled function dynamic (None skipped): one
    compiled graph then serves every size of it."""
    import torch._dynamo

    for t in ts:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, dim)



class _Layer:
    """One fusable block (GDN mixer + SwiGLU MLP): its compiled regions and weight handles."""

    def __init__(self, blk, sdt, mode, concat_mlp, compile_fn, gemv):
        mix, cfg = blk.mixer, blk.mixer.cfg
        self.blk, self.mix = blk, mix
        sizes = (sum(mix.split[:3]), mix.split[3], mix.split[4], mix.split[5])
        an, mn = blk.attn_norm, blk.mlp_norm
        self.conv = cfg.use_short_conv
        fc = (mix.H, mix.K, bool(cfg.allow_neg_eigval), sdt)
        self.seq_pre = compile_fn("seq_pre", (an.eps, an.zero_centered, sizes, self.conv,
                                              cfg.use_gate, fc, gemv), mode)
        self.tree_in = compile_fn("tree_in", (an.eps, an.zero_centered, sizes, cfg.use_gate, gemv), mode)
        self.factors = compile_fn("factors", fc, mode)
        I = blk.mlp.gate_proj.weight.shape[0]
        self.post = compile_fn("post", (mn.eps, mn.zero_centered, I, gemv), mode)
        self.concat_mlp = concat_mlp

    def mlp_weights(self):
        mlp = self.blk.mlp
        if not self.concat_mlp:
            return mlp.gate_proj.weight, mlp.up_proj.weight
        return mlp.gate_up_weight(), None

    def conv_args(self):
        mix = self.mix
        return (mix.conv_weight, mix.conv_bias) if self.conv else (None, None)

    def post_call(self, y, x):
        blk, mix = self.blk, self.mix
        w1, w2 = self.mlp_weights()
        return self.post(y, x, mix.o_proj.weight, blk.mlp_norm.weight, w1, w2, blk.mlp.down_proj.weight)


class FusedModel:
    """Decode-time forward/verify of a `Model` through compiled regions (see the module doc).

    Not an nn.Module: it owns no parameters (the concatenated gate|up copies aside, which are
    rebuilt whenever the model's weights change) and never enters the state dict.
    """

    def __init__(self, model, mode: str = "default", concat_mlp: bool = True, max_shapes: int = 16,
                 compile: bool = True, dynamic_tokens: bool = True, gemv: str = "cublas"):
        if mode not in MODES:
            raise ValueError(f"unknown fuse mode {mode!r}; choose one of {', '.join(MODES)}")
        if gemv not in GEMVS:
            raise ValueError(f"unknown gemv {gemv!r}; choose one of {', '.join(GEMVS)}")
        self.model, self.mode, self.max_shapes, self.gemv = model, mode, max_shapes, gemv
        self.dynamic_tokens = dynamic_tokens
        _raise_recompile_limit()
        if compile:
            compile_fn = lambda kind, consts, mode: compiled(kind, consts, mode, dynamic_tokens)  # noqa: E731
        else:
            compile_fn = lambda kind, consts, mode: eager(kind, consts)  # noqa: E731
        sdt = accumulation_dtype(model.dtype)
        self.layers = [_Layer(blk, sdt, mode, concat_mlp, compile_fn, gemv)
                       if isinstance(blk.mixer, GatedDeltaNet) and type(blk.mlp) is GatedMLP else None
                       for blk in model.layers]
        n = model.norm
        self.head = compile_fn("head", (n.eps, n.zero_centered, gemv), mode)
        self.embed = compile_fn("embed", (), mode)
        self.shapes: set = set()
        self.compile = compile

    @contextlib.contextmanager
    def capturing(self):
        """Around a CUDA graph capture (`GraphTarget`): `no_compiles` when the regions compile."""
        with no_compiles() if self.compile else contextlib.nullcontext():
            yield

    def takes(self, tokens: torch.Tensor, verify: bool) -> bool:
        """Whether this call goes through the fused path: AR steps (T = 1), verifies of at
        most MAX_TOKENS nodes and, with `dynamic_tokens`, prefills of at most MAX_PREFILL
        tokens, for the first `max_shapes` distinct shapes (fixed per graph; with
        `dynamic_tokens` every size above 1 of a batch is one shape)."""
        B, n = tokens.shape
        if n > (MAX_TOKENS if verify else MAX_PREFILL if self.dynamic_tokens else 1):
            return False
        key = (verify, B, "n" if self.dynamic_tokens and n > 1 else n, tokens.device)
        if key not in self.shapes:
            if len(self.shapes) >= self.max_shapes:
                return False
            self.shapes.add(key)
        return True

    def run(self, tokens, cache, capture=(), parents=None, chain=False, valid=None, logits=True):
        """forward (parents None: consume the tokens, advance the cache) or verify (`chain`:
        the topology is a chain, `Model.verify`); `logits` False skips the LM head."""
        m = self.model
        if self.dynamic_tokens and tokens.shape[1] > 1:
            mark = functools.partial(mark_dynamic, 1)  # one graph for every verify or prefill size
        else:
            mark = lambda *ts: None  # noqa: E731
        mark(tokens)
        x, r = self.embed(tokens, m.embeddings.weight), None  # r: the last MLP output, not yet added to x
        hidden, records, want = {}, [], None  # want: the captured layer whose x is x + r
        # a verify folds every pending update; with the pending buffers stacked (a PendingBank)
        # their lengths are cleared by one kernel after the last layer, not one per layer
        bank = getattr(cache, "bank", None)
        bank = bank if parents is not None and bank is not None and bank.attached(cache) else None
        banked = set(bank.layers) if bank is not None else ()
        if parents is None:
            cache.flush()  # a plain sequence starts from the committed state (free when clean)

        def settle(x, r, want):
            if r is not None:
                x = x + r
            if want is not None:
                hidden[want] = x
            return x

        for i, blk in enumerate(m.layers):
            st, lay = cache.layers[i], self.layers[i]
            if lay is None:
                x = settle(x, r, want)
                r, want = None, None
                # a block the fused path does not cover (attention mixer, MoE MLP): Model's own code
                x, rec = blk.run(x, st, cache.length, parents, chain, valid)
                records.append(rec)
                if i in capture:
                    hidden[i] = x
                continue
            mix = lay.mix
            cw, cb = lay.conv_args()
            if parents is None and st.conv is not None and tokens.shape[1] == 1 and valid is None:
                # an AR step: the conv and the factors are one kernel (Inductor made seven of them)
                x, xp, z, a, b = lay.tree_in(x, r, blk.attn_norm.weight, mix.in_proj.weight)
                q, k, v, g, beta = ops.step_prelude(xp, st.conv, cw, cb, a, b, mix.A_log, mix.dt_bias, mix.H,
                                                    mix.K, bool(mix.cfg.allow_neg_eigval), st.S.dtype)
            elif parents is None:
                mark(x, r)
                x, q, k, v, g, beta, z = lay.seq_pre(x, r, blk.attn_norm.weight, mix.in_proj.weight, st.conv,
                                                     cw, cb, mix.A_log, mix.dt_bias, valid)
            elif st.conv is not None:
                mark(x, r)
                x, xp, z, a, b = lay.tree_in(x, r, blk.attn_norm.weight, mix.in_proj.weight)
                if ops.tree_prelude_takes(xp, st.S.dtype):  # one kernel, as for an AR step
                    q, k, v, g, beta = ops.tree_prelude(xp, st.conv, cw, cb, parents, a, b, mix.A_log, mix.dt_bias,
                                                        mix.H, mix.K, bool(mix.cfg.allow_neg_eigval), st.S.dtype)
                else:
                    xc = ops.tree_conv(xp, st.conv, cw, cb, parents)
                    mark(xc, a, b)
                    q, k, v, g, beta = lay.factors(xc, a, b, mix.A_log, mix.dt_bias)
            else:  # no short conv: nothing is written, the sequence region serves
                mark(x, r)
                x, q, k, v, g, beta, z = lay.seq_pre(x, r, blk.attn_norm.weight, mix.in_proj.weight, None,
                                                     None, None, mix.A_log, mix.dt_bias)
                xp = None
            if want is not None:
                hidden[want] = x
            if parents is None:
                o = ops.gdn_sequence(q, k, v, g, beta, st.S, mix.scale, chunked=valid is not None)
            else:
                o, u = ops.gdn_tree_verify(q, k, v, g, beta, st.S, parents, mix.scale, st.pending, chain, valid)
                if st.pending is not None and i not in banked:  # folded into S by the verify
                    st.pending[3].zero_()
                records.append(GDNRecord(x=xp if st.conv is not None else None, k=k, g=g, u=u))
            y = ops.gated_rms_norm(o, z, mix.o_norm_weight, mix.cfg.norm_eps, mix.cfg.gate_activation, x.dtype)
            mark(y, x)
            x, r = lay.post_call(y, x)
            want = i if i in capture else None
        mark(x, r)
        lg = None
        if logits:
            x, lg = self.head(x, r, m.norm.weight, m.lm_head.weight)
        elif want is not None:  # no head: the last layer's stream only where it is captured
            x = settle(x, r, None)
        if want is not None:
            hidden[want] = x
        if bank is not None:
            bank.length.zero_()  # every banked layer's pending update was folded above
        if parents is None:
            cache.length.add_(tokens.shape[1] if valid is None else valid)
        out = ModelOutput(lg, hidden)
        if parents is not None:
            out.records = records
        return out

    def forward(self, tokens, cache, capture=(), valid=None, logits=True):
        return self.run(tokens, cache, capture, valid=valid, logits=logits)

    def verify(self, tokens, parents, cache, capture=(), chain=False, valid=None):
        return self.run(tokens, cache, capture, parents, chain, valid)
