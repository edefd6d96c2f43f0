"""The fused decode path (`specla.fused`, `fused.fuse(model)`) against the plain path, on CPU.

- The regions run uncompiled (what torch.compile sees) on varied tiny configs, hybrid and MoE
  stacks included: logits, captured hidden states, factor records and caches match the plain
  path in float64 (1e-10) — the fused code computes the same function.
- Compiled (Inductor's C++ backend on CPU) at the `tiny` benchmark shape in fp32: logits of an
  AR step and of a tree verify within 1e-5 of the plain path, the decode loop's greedy tokens
  (AR and a chain route) equal, and warm calls never recompile (what CUDA-graph capture
  relies on). These need a C++ compiler; they are skipped only when none is installed.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from specla import topology
from specla.fused import fuse
from specla.config import ATTENTION, GDN
from specla.decode import Decoder
from specla.drafters.base import Draft, DraftContext, Drafter
from specla.shapes import random_model as shape_model
from specla.shapes import shape_config

from conftest import random_model, tiny_config


def _run(model, prompt, root, tokens, parents, capture, chunk):
    cache = model.new_cache(1, 128)
    # a prompt's prefill as the decode loop runs it: no LM head, the last layer captured
    last = model.cfg.num_hidden_layers - 1
    pre = model.forward(prompt, cache, (last,), logits=False)
    assert pre.logits is None and pre.hidden[last].shape[:2] == prompt.shape
    # a graph prefill's padded chunk: 3 real tokens, the rest padding the states must ignore
    pad = model.forward(chunk, cache, capture, valid=torch.tensor([3]))
    step = model.forward(root, cache, capture)
    ver = model.verify(tokens, parents, cache, capture)
    cache.flush()
    return step, ver, cache, pad, pre.hidden[last]


def _err(x, y) -> float:
    """Max abs difference, relative to the reference's scale when it exceeds 1 (an fp32 hidden
    state of magnitude ~3.4 carries rounding of ~1e-5 after a few compiled layers on some CPUs)."""
    return float((x - y).abs().max()) / max(1.0, float(x.abs().max()))


def _compare(model, fused_kw, seed=0, tol=1e-10, capture=(0,)):
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    V = cfg.vocab_size
    prompt = torch.randint(0, V, (1, 7), generator=g)
    root = torch.randint(0, V, (1, 1), generator=g)
    tokens = torch.randint(0, V, (1, 6), generator=g)
    parents = torch.tensor([[-1, 0, 1, 0, 3, 1]])
    chunk = torch.randint(0, V, (1, 5), generator=g)
    fuse(model, False)
    a = _run(model, prompt, root, tokens, parents, capture, chunk)
    fuse(model, **fused_kw)
    b = _run(model, prompt, root, tokens, parents, capture, chunk)
    fuse(model, False)
    diff = {}
    for name, (x, y) in {"step": (a[0].logits, b[0].logits), "verify": (a[1].logits, b[1].logits),
                         "padded": (a[3].logits[:, :3], b[3].logits[:, :3]), "headless": (a[4], b[4])}.items():
        diff[name] = _err(x, y)
    for i in capture:
        diff[f"hidden{i}"] = _err(a[1].hidden[i], b[1].hidden[i])
        diff[f"step_hidden{i}"] = _err(a[0].hidden[i], b[0].hidden[i])
    for j, (ra, rb) in enumerate(zip(a[1].records, b[1].records)):
        for f, x in vars(ra).items():
            if x is not None:
                diff[f"rec{j}.{f}"] = _err(x, getattr(rb, f))
    for j, (sa, sb) in enumerate(zip(a[2].layers, b[2].layers)):
        for f, x in vars(sa).items():
            if isinstance(x, torch.Tensor):
                diff[f"state{j}.{f}"] = _err(x, getattr(sb, f))
    bad = {k: v for k, v in diff.items() if not v <= tol}
    assert not bad, bad
    return diff


@pytest.mark.parametrize("seed", range(6))
def test_uncompiled_regions_equal_plain(seed):
    cfg = tiny_config(seed, num_hidden_layers=2)
    _compare(random_model(cfg, seed), dict(compile=False), seed, capture=(0, 1))


@pytest.mark.parametrize("seed", range(3))
def test_uncompiled_triton_gemv_equals_plain(seed):
    """gemv="triton": the steps' and verifies' matmuls through ops.skinny_linear compute the same
    function: float64 (the reference), and fp32 through the Triton kernels themselves (GEMV for
    the AR step, skinny GEMM for the 6-node verify) under the interpreter."""
    from specla import ops

    cfg = tiny_config(seed, num_hidden_layers=2)
    _compare(random_model(cfg, seed), dict(compile=False, gemv="triton"), seed, capture=(0, 1))
    with ops.backend("triton"):
        _compare(random_model(cfg, seed).float(), dict(compile=False, gemv="triton"), seed, tol=1e-5, capture=(0,))
    with pytest.raises(ValueError, match="gemv"):
        fuse(random_model(cfg, seed), compile=False, gemv="cutlass")


def _hybrid_cfg(moe: bool):
    return tiny_config(
        1, num_hidden_layers=4, layer_types=[GDN, GDN, ATTENTION, GDN], attn_num_heads=4, attn_num_kv_heads=2,
        attn_head_dim=8, attn_output_gate=True, partial_rotary_factor=0.5, norm_style="zero_centered",
        **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
           if moe else {}))


@pytest.mark.parametrize("moe", [False, True])
def test_uncompiled_hybrid_equal_plain(moe):
    """Attention and MoE blocks run their plain modules between fused GDN blocks."""
    model = random_model(_hybrid_cfg(moe), 3)
    _compare(model, dict(compile=False), 3, capture=(1, 2, 3))
    _compare(model, dict(compile=False, concat_mlp=False), 4, capture=(0, 2))


def test_which_shapes_take_the_fused_path():
    from specla.fused import MAX_PREFILL

    model = random_model(tiny_config(2), 2)
    z = lambda n: torch.zeros(1, n, dtype=torch.long)  # noqa: E731
    fuse(model, compile=False, max_shapes=2, dynamic_tokens=False)
    f = model._fused
    assert not f.takes(z(5), verify=False)  # static shapes: prefill stays plain
    assert f.takes(z(1), verify=False)
    assert f.takes(z(9), verify=True)
    assert not f.takes(z(10), verify=True)  # past max_shapes
    assert f.takes(z(9), verify=True)
    assert not f.takes(z(1000), verify=True)  # past MAX_TOKENS
    fuse(model, compile=False, max_shapes=3)  # dynamic tokens: every verify (prefill) size is one shape
    f = model._fused
    assert all(f.takes(z(n), verify=True) for n in (2, 9, 10, 17, 33))
    assert f.takes(z(1), verify=False) and all(f.takes(z(n), verify=False) for n in (3, 70, MAX_PREFILL))
    assert not f.takes(z(MAX_PREFILL + 1), verify=False)


def test_env_flag(monkeypatch):
    from specla import fused
    from specla.engine import EagerTarget

    model = random_model(tiny_config(2), 2)
    monkeypatch.setenv(fused.ENV, "0")
    EagerTarget(model, 1, 32)
    assert getattr(model, "_fused", None) is None
    monkeypatch.setenv(fused.ENV, "1")
    EagerTarget(model, 1, 32)
    assert model._fused is not None and model._fused.mode == "default"
    monkeypatch.setenv(fused.ENV, "bogus")
    with pytest.raises(ValueError):
        fused.env_mode()


# compiled (Inductor, C++ backend on CPU) ---------------------------------------------------

def _cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


# Inductor's CPU backend compiles C++; the one legitimate reason to skip is a missing compiler.
needs_cxx = pytest.mark.skipif(_cxx() is None, reason="torch.compile on CPU needs a C++ compiler (none found)")


@pytest.fixture(scope="module")
def tiny_fp32():
    return shape_model(shape_config("tiny"), device="cpu", dtype=torch.float32, seed=5)


class ChainOracle(Drafter):
    """Fixed-size chains (one verify shape) that follow a known continuation, missing on purpose
    every third round."""

    name = "chain-oracle"

    def __init__(self, oracle: list[int], vocab: int, length: int = 4):
        self.oracle, self.vocab, self.length = oracle, vocab, length
        self.max_nodes = length + 1
        self.round = 0

    def propose(self, ctx: DraftContext) -> Draft:
        hist = ctx.history[0]
        toks = [hist[-1]]
        for d in range(1, self.length + 1):
            pos = len(hist) - 1 + d
            t = self.oracle[pos] if pos < len(self.oracle) else 0
            if self.round % 3 == 2 and d == 2:
                t = (t + 1) % self.vocab
            toks.append(t)
        self.round += 1
        return Draft(torch.tensor([toks]), topology.chain(len(toks)))


@needs_cxx
@pytest.mark.parametrize("dynamic_tokens", [True, False])
def test_compiled_equals_plain_fp32(tiny_fp32, dynamic_tokens):
    import torch._dynamo.utils as du

    model = tiny_fp32
    kw = dict(dynamic_tokens=dynamic_tokens)
    diff = _compare(model, kw, 0, tol=1e-5, capture=(1,))
    assert diff["step"] < 1e-5 and diff["verify"] < 1e-5
    # warm calls with the same shapes reuse the compiled graphs: nothing recompiles (capture-safe)
    before = du.counters["stats"]["unique_graphs"]
    _compare(model, kw, 1, tol=1e-5, capture=(1,))
    assert du.counters["stats"]["unique_graphs"] == before


@needs_cxx
def test_compiled_triton_gemv_equals_plain_fp32(tiny_fp32):
    """Inside compiled regions ops.skinny_linear is one opaque call (here its CPU reference)."""
    diff = _compare(tiny_fp32, dict(gemv="triton"), 2, tol=1e-5, capture=(1,))
    assert diff["step"] < 1e-5


@needs_cxx
def test_compiled_decode_greedy_tokens_equal(tiny_fp32):
    model = tiny_fp32
    prompt = torch.randint(0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    fuse(model, False)
    ar = Decoder(model, graphs=False).generate(prompt, 24).tokens
    drafter = ChainOracle(prompt + ar, model.cfg.vocab_size, length=5)  # verify shape [1, 6], as above
    chain = Decoder(model, drafter, graphs=False).generate(prompt, 24)
    fuse(model)
    try:
        ar_fused = Decoder(model, graphs=False).generate(prompt, 24).tokens
        drafter = ChainOracle(prompt + ar, model.cfg.vocab_size, length=5)
        chain_fused = Decoder(model, drafter, graphs=False).generate(prompt, 24)
    finally:
        fuse(model, False)
    assert ar_fused == ar
    assert chain_fused.tokens == chain.tokens == ar
    assert chain_fused.mean_accepted_length > 1.5


@needs_cxx
def test_graphed_fused_ar_tokens_equal_plain(tiny_fp32, monkeypatch):
    """The decode loop's graphed target beside a compiled fused model (CUDA graphs emulated):
    its AR steps — compiled top-1, settle and commit — and its chain and tree rounds — compiled
    acceptance and settling in one region, the commit's stacked work in another — emit the
    plain eager path's tokens."""
    from drafters import OracleTreeDrafter
    from graph_emulation import emulate_graphs

    from specla.ops.beam.naive import first_max

    model = tiny_fp32
    prompt = torch.randint(0, model.cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    fuse(model, False)
    ar = Decoder(model, graphs=False).generate(prompt, 16).tokens
    emulate_graphs(monkeypatch)
    fuse(model)
    targets: dict = {}
    try:
        graphed = Decoder(model, graphs=True, targets=targets).generate(prompt, 16).tokens
        chain = Decoder(model, ChainOracle(prompt + ar, model.cfg.vocab_size, length=5), graphs=True).generate(prompt, 16)
        tree = Decoder(model, OracleTreeDrafter([prompt + ar], model.cfg.vocab_size, max_nodes=6, seed=1),
                       graphs=True).generate(prompt, 16)
    finally:
        fuse(model, False)
    (target,) = targets.values()
    assert type(target).__name__ == "GraphTarget" and target._top1 is not first_max  # the compiled top-1 ran
    assert graphed == chain.tokens == tree.tokens == ar
    assert chain.mean_accepted_length > 1.5 and tree.mean_accepted_length > 1.2


@needs_cxx
def test_compiled_dynamic_tokens_one_graph_for_all_sizes(tiny_fp32):
    """dynamic_tokens: verifies of any size share one compiled graph per region."""
    import torch._dynamo.utils as du

    model = tiny_fp32
    diff = _compare(model, dict(dynamic_tokens=True), 2, tol=1e-5)
    assert diff["verify"] < 1e-5
    before = du.counters["stats"]["unique_graphs"]
    for n in (3, 9):
        cache = model.new_cache(1, 64)
        fuse(model, False)
        model.forward(torch.tensor([[1, 2, 3]]), cache)
        tokens = torch.arange(n)[None] + 5
        parents = torch.tensor([[-1] + [max(0, j - 2) for j in range(1, n)]])
        plain = model.verify(tokens, parents, cache.clone()).logits
        fuse(model, dynamic_tokens=True)
        fused = model.verify(tokens, parents, cache).logits
        fuse(model, False)
        assert (plain - fused).abs().max() < 1e-5
    assert du.counters["stats"]["unique_graphs"] == before


def test_uncompiled_regions_with_triton_kernels():
    """The fused regions hand strided views (q|k from one buffer, in_proj slices) to specla's
    Triton kernels (interpreter on CPU): serial step, hybrid tree verify, conv, pending fold."""
    from specla import ops

    model = shape_model(shape_config("tiny"), device="cpu", dtype=torch.float32, seed=5)
    with ops.backend("triton"):
        diff = _compare(model, dict(compile=False), 0, tol=1e-5, capture=(1,))
    assert diff["step"] < 1e-5 and diff["verify"] < 1e-5


def test_region_recompiles_without_precision_emulation(monkeypatch):
    """An Inductor failure with emulate_precision_casts falls back to compiling without it."""
    import torch._dynamo.exc as dexc

    from specla import fused

    calls = []

    class FakeCompiled:
        def __init__(self, opts):
            self.opts = opts

        def __call__(self, x):
            calls.append(dict(self.opts))
            if self.opts.get("emulate_precision_casts"):
                raise dexc.BackendCompilerFailed.__new__(dexc.BackendCompilerFailed)
            return x + 1

    monkeypatch.setattr(fused, "_options", lambda mode: {"emulate_precision_casts": True})
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, fullgraph, options: FakeCompiled(options))
    region = fused._Region(lambda x: x + 1, "default", False)
    with pytest.warns(UserWarning, match="emulate_precision_casts"):
        assert region(1) == 2
    assert region(2) == 3
    assert calls == [{"emulate_precision_casts": True}, {}, {}]


def test_no_compile_during_capture():
    """Under `FusedModel.capturing()` (what GraphTarget wraps a capture in) a compile raises."""
    from types import SimpleNamespace

    from specla.fused import FusedModel

    f = torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        with FusedModel.capturing(SimpleNamespace(compile=True)):
            f(torch.ones(3))
    f(torch.ones(3))  # compiles outside
    with FusedModel.capturing(SimpleNamespace(compile=True)):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))  # a cache hit is fine


@needs_cxx
def test_compiled_greedy_acceptance_equals_eager():
    """`GraphTarget` compiles greedy acceptance beside a fused model: same path, length and
    bonus as the eager walk on random trees with planted matches, padding and ties."""
    from specla import acceptance, fused

    accept, _ = fused.compile_for_graph(acceptance.greedy, "default")
    g = torch.Generator().manual_seed(0)
    B, n, V = 3, 9, 16
    for _ in range(6):
        parents = torch.tensor([[-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)]
                                for _ in range(B)])
        logits = torch.randint(0, 3, (B, n, V), generator=g).float()  # many ties: argmax picks the lowest id
        target = logits.argmax(-1)
        tokens = torch.randint(0, V, (B, n), generator=g)
        plant = torch.rand(B, n, generator=g) < 0.6  # most nodes carry their parent's argmax
        tokens = torch.where(plant, target.gather(1, parents.clamp(min=0)), tokens)
        valid = torch.randint(1, n + 1, (B,), generator=g)
        want, got = acceptance.greedy(tokens, parents, logits, valid), accept(tokens, parents, logits, valid)
        assert torch.equal(want.path, got.path) and torch.equal(want.length, got.length)
        assert torch.equal(want.bonus, got.bonus)
    assert int(want.length.max()) > 2  # the planted matches made real paths


@needs_cxx
def test_compiled_top1_equals_torch_max():
    """`GraphTarget` compiles an AR step's top-1 (`first_max`) beside a fused model: the same
    value and first index as torch's max over vocabularies of one chunk and of many, with ties
    across chunks, in fp32 and bf16."""
    from specla import fused
    from specla.ops.beam.naive import first_max

    top1, _ = fused.compile_for_graph(first_max, "default")
    g = torch.Generator().manual_seed(2)
    for V in (37, 1500):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randint(0, 4, (3, V), generator=g).to(dtype)  # ties everywhere
            x[1, -1] = 9  # the maximum in the last chunk
            want, got = x.max(-1), top1(x)
            assert torch.equal(want.values, got[0]) and torch.equal(want.indices, got[1])


@needs_cxx
def test_compiled_settle_equals_eager():
    """`GraphTarget` compiles a round's settling beside a fused model, alone and after greedy
    acceptance in one region (`greedy_settle`, a greedy round's): the same path, path tokens,
    hidden states, counts, report and buffer updates as eager, with EOS hits, budgets running
    out and rows already done."""
    from specla import acceptance, fused
    from specla.engine import greedy_settle, settle

    compiled_settle, _ = fused.compile_for_graph(settle, "default")
    compiled_round, _ = fused.compile_for_graph(greedy_settle, "default")
    g = torch.Generator().manual_seed(1)
    B, n, V, D = 3, 7, 12, 4
    for _ in range(4):
        parents = torch.tensor([[-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)]
                                for _ in range(B)])
        logits = torch.randn(B, n, V, generator=g)
        tokens = torch.where(torch.rand(B, n, generator=g) < 0.7, logits.argmax(-1).gather(1, parents.clamp(min=0)),
                             torch.randint(0, V, (B, n), generator=g))
        valid = torch.randint(1, n + 1, (B,), generator=g)
        acc = acceptance.greedy(tokens, parents, logits, valid)
        hidden = {2: torch.randn(B, n, D, generator=g)}
        bufs = [torch.randint(0, 5, (B,), generator=g), torch.tensor([False, True, False]),
                torch.randint(5, 9, (B,), generator=g), torch.tensor([3, 7, -1, -1]), torch.randint(0, V, (B,), generator=g)]
        a_bufs, b_bufs = [t.clone() for t in bufs], [t.clone() for t in bufs]
        want = settle(tokens, parents, valid, logits, hidden, acc, *a_bufs)
        got = compiled_settle(tokens, parents, valid, logits, hidden, acc, *b_bufs)
        for x, y in zip([want[0], want[2], want[3], *a_bufs], [got[0], got[2], got[3], *b_bufs]):
            assert torch.equal(x, y)
        assert torch.equal(want[1][2], got[1][2])
        c_bufs = [t.clone() for t in bufs]
        path, got = compiled_round(tokens, parents, valid, logits, hidden, *c_bufs)
        assert torch.equal(path, acc.path)
        for x, y in zip([want[0], want[1][2], want[2], want[3], *a_bufs], [got[0], got[1][2], got[2], got[3], *c_bufs]):
            assert torch.equal(x, y)
