"""DSpark and ReaDy block drafters: exactness (float64), committed-state reads under delayed commit,
train/draft consistency, checkpoints, committed states for training, two-stage training (CPU)."""

import json
import shutil

import pytest
import torch

from specla import fused
from specla.api import DEMO_DIR
from specla.decode import Decoder
from specla.drafters import dspark as dspark_kind
from specla.drafters import ready as ready_kind
from specla.drafters.blocks import block_drafter, find_block_drafter, load_block_drafter, save_block_drafter
from specla.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel
from specla.drafters.ready import ReadyConfig, ReadyDrafter, ReadyModel
from specla.errors import CheckpointError, InputError
from specla.ops import reader as reader_ops
from specla.ops.reader import naive as reader_naive
from specla.train.block_drafter import committed_states, target_pass, train_block_drafter

from conftest import random_model, tiny_config
from graph_emulation import emulate_graphs
from test_exactness import assert_same_state, make_prompt

NEW = 64


def randomize(m, seed: int):
    """Every weight random (the zero-initialised reader output and Markov bias too)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.3
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale + (1.0 if "norm" in name else 0.0))
    return m


def block_model(kind: str, cfg, seed: int, dtype=torch.float64, **over):
    torch.manual_seed(seed)
    m = DSparkModel(DSparkConfig.for_target(cfg, **over)) if kind == "dspark" else \
        ReadyModel(ReadyConfig.for_target(cfg, **over))
    return randomize(m.to(dtype).eval(), seed)


def make_drafter(kind, m, model, **opts):
    return (DSparkDrafter if kind == "dspark" else ReadyDrafter)(m, model, **opts)


# exactness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["dspark", "ready"])
def test_block_drafters_equal_ar(kind, seed):
    cfg = tiny_config(seed, vocab_size=24)  # small vocabularies: random drafts are sometimes right
    model = random_model(cfg, seed)
    over = {"inject_site": "pre"} if kind == "ready" and seed % 2 else {}
    m = block_model(kind, cfg, seed, **over)
    prompt = make_prompt(cfg, seed, 6 + seed % 5)
    ar_rows, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), NEW)
    accepted = 0
    for threshold in (0.0, 0.3):
        for delayed in (True, False):
            drafter = make_drafter(kind, m, model, threshold=threshold)
            rows, res, cache = Decoder(model, drafter, delayed=delayed).run(torch.tensor([prompt]), NEW)
            assert rows == ar_rows, (threshold, delayed)
            assert_same_state(cache, ar_cache)
            assert all(1 <= r.drafted <= 7 for r in res.rounds)
            if threshold == 0:
                assert all(r.drafted == 7 for r in res.rounds[:-1])
            accepted += sum(r.accepted for r in res.rounds)
    assert accepted > 0


@pytest.mark.parametrize("kind", ["dspark", "ready"])
def test_block_drafters_on_the_fused_path_equal_ar(kind):
    """The fused decode path (`fused.fuse`, the regions uncompiled: what torch.compile sees) feeds
    block drafters the same features and committed states: float64 tokens and state equal AR's."""
    cfg = tiny_config(2, vocab_size=24)
    model = random_model(cfg, 2)
    m = block_model(kind, cfg, 2)
    prompt = torch.tensor([make_prompt(cfg, 2, 9)])
    ar_rows, _, ar_cache = Decoder(model).run(prompt, NEW)
    fused.fuse(model, compile=False)
    try:
        rows, res, cache = Decoder(model, make_drafter(kind, m, model)).run(prompt, NEW)
    finally:
        fused.fuse(model, False)
    assert rows == ar_rows
    assert_same_state(cache, ar_cache)
    assert sum(r.accepted for r in res.rounds) > 0


@pytest.mark.parametrize("kind", ["dspark", "ready"])
def test_block_drafters_attend_over_a_window_of_a_large_cache(monkeypatch, kind):
    """Graphed (emulated) with a cache far larger than the context, a block drafter attends
    over the leading slots the generation needs (a graph per window), extends its context from
    a graph per accepted-path width, and drafts exactly what an eager drafter with a small,
    growing cache drafts."""
    emulate_graphs(monkeypatch)
    cfg = tiny_config(1, vocab_size=24)
    model = random_model(cfg, 1)
    m = block_model(kind, cfg, 1)
    small = make_drafter(kind, m, model, initial_capacity=8)
    large = make_drafter(kind, m, model, initial_capacity=1024)
    large.graphs = True
    for seed, length, window in ((2, 100, 256), (3, 8, 128)):  # prompts of 150 and 12 tokens, + 32
        prompt = torch.tensor([make_prompt(cfg, seed, length)])
        a = Decoder(model, small).run(prompt, 32)
        b = Decoder(model, large).run(prompt, 32)
        assert a[0] == b[0] == Decoder(model).run(prompt, 32)[0]
        assert [r.accepted for r in a[1].rounds] == [r.accepted for r in b[1].rounds]
        assert window in large._graphs and large.capacity == 1024
        assert list(large._extend_graphs) == [8]  # rounds extend by the 8-node path from a graph


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile on CPU needs a C++ compiler (none found)")
@pytest.mark.parametrize("kind", ["dspark", "ready"])
def test_compiled_graphed_block_drafting_equals_eager(monkeypatch, kind):
    """With a compile mode the graphed block forward and extend run compiled: tokens and accepted
    counts equal the eager drafter's and AR's (float64), and the window is symbolic: narrower
    windows capture graphs without compiling. ReaDy's state read is one custom op inside the
    graph (`ops.reader.committed_read`), so ReaDy compiles no more than DSpark."""
    emulate_graphs(monkeypatch)
    cfg = tiny_config(1, vocab_size=24)
    model = random_model(cfg, 1)
    m = block_model(kind, cfg, 1)
    eager = make_drafter(kind, m, model, initial_capacity=8)
    graphed = make_drafter(kind, m, model, initial_capacity=512, compile="default")
    graphed.graphs = True
    targets: dict = {}  # the target and its cache kept across generations, as `SpecLA.generate` keeps them
    # prompts of 375, 150 and 15 tokens: windows of 512 (as wide as the cache), 256 and 128
    for i, (length, new) in enumerate(((250, 16), (100, 16), (10, 24))):
        prompt = torch.tensor([make_prompt(cfg, 3 + i, length)])
        ar = Decoder(model).run(prompt, new)[0]
        a = Decoder(model, eager).run(prompt, new)
        before = fused._compile_count()
        b = Decoder(model, graphed, targets=targets).run(prompt, new)
        compiled = fused._compile_count() - before
        if i == 0:
            assert compiled >= 2  # the block forward and the extend
        else:
            assert compiled == 0
        assert a[0] == b[0] == ar
        assert [r.accepted for r in a[1].rounds] == [r.accepted for r in b[1].rounds]
    assert sorted(graphed._graphs) == [128, 256, 512] and graphed.capacity == 512
    assert sum(r.accepted for r in b[1].rounds) > 0


def test_batched_rows():
    cfg = tiny_config(3, vocab_size=24)
    model = random_model(cfg, 3)
    m = block_model("ready", cfg, 3)
    prompts = torch.stack([torch.tensor(make_prompt(cfg, s, 8)) for s in range(3)])
    ar_rows, _, ar_cache = Decoder(model).run(prompts, 24)
    drafter = ReadyDrafter(m, model, threshold=0.3)
    for _ in range(2):  # a drafter is reused across generations (its cache empties in place)
        rows, _, cache = Decoder(model, drafter).run(prompts, 24)
        assert rows == ar_rows
        assert_same_state(cache, ar_cache)
    rows, _, _ = Decoder(model, ReadyDrafter(m, model)).run(prompts[:1, :1], 16)  # a one-token prompt
    assert rows == Decoder(model).run(prompts[:1, :1], 16)[0]


class CheckedReady(ReadyDrafter):
    """Before every proposal, the committed state is computed independently (a flushed clone of the
    cache); every read the drafter makes must equal a read of that state."""

    def __init__(self, *a, tol, **k):
        super().__init__(*a, **k)
        self.trace, self.tol, self.pending_rounds = [], tol, 0

    def propose(self, ctx):
        ref = ctx.cache.clone().flush()
        self.pending_rounds += any(ctx.cache.layers[i].pending is not None and int(ctx.cache.layers[i].pending[3].sum())
                                   for i in self.sources)
        n = len(self.trace)
        draft = super().propose(ctx)
        assert len(self.trace) == n + len(self.model.cfg.inject_layers)
        states = [ref.layers[i].S for i in self.sources]
        for q, value_map, reads, sqn in self.trace[n:]:
            want, want_n = reader_naive.state_read(states, [None] * len(states), q, value_map, flush=False)
            assert (reads - want).abs().max() <= self.tol * want.abs().max()
            assert (sqn - want_n).abs().max() <= self.tol * want_n.abs().max()
        for i in self.sources:  # the read was the flush: the state is the committed one, nothing pending
            st = ctx.cache.layers[i]
            assert (st.S - ref.layers[i].S).abs().max() <= self.tol * ref.layers[i].S.abs().max().clamp(min=1)
            assert st.pending is None or int(st.pending[3].sum()) == 0
        return draft


@pytest.mark.parametrize("inject", [[1], [0, 1]])
def test_ready_reads_the_committed_state(inject):
    """Delayed commit: the cache's S lags one round, yet every read sees the exact committed state."""
    cfg = tiny_config(4, vocab_size=24, num_hidden_layers=3)
    model = random_model(cfg, 4)
    m = block_model("ready", cfg, 4, num_layers=2, inject_layers=inject)
    prompt = make_prompt(cfg, 4, 9)
    ar_rows, _, _ = Decoder(model).run(torch.tensor([prompt]), 32)
    drafter = CheckedReady(m, model, tol=1e-12)
    rows, res, _ = Decoder(model, drafter, delayed=True).run(torch.tensor([prompt]), 32)
    assert rows == ar_rows and drafter.pending_rounds >= len(res.rounds) - 1


def test_fused_reader_reads_the_committed_state(monkeypatch):
    """The same with the fused Triton reader (interpreter, fp32): its in-pass flush is the flush."""
    from specla.ops.reader import triton as reader_triton

    monkeypatch.setattr(reader_ops, "state_read", reader_triton.state_read)
    cfg = tiny_config(6, vocab_size=24, num_hidden_layers=2, num_heads=1, num_v_heads=2, head_dim=16, head_v_dim=16)
    model = random_model(cfg, 6, dtype=torch.float32)
    m = block_model("ready", cfg, 6, dtype=torch.float32)
    drafter = CheckedReady(m, model, tol=1e-5)
    _, res, _ = Decoder(model, drafter, delayed=True).run(torch.tensor([make_prompt(cfg, 6, 9)]), 12)
    assert drafter.pending_rounds >= len(res.rounds) - 1 >= 2


# train / draft consistency ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dspark", "ready"])
def test_training_forward_is_what_drafting_computes(kind):
    """The training forward over whole sequences (many anchors at once, committed states recomputed
    by the chunked scan) scores a block exactly as drafting does, with the drafted tokens as the
    teacher-forced previous tokens. The training forward runs with gradients (its attention in
    SDPA), drafting without (`ops.masked_attention`)."""
    cfg = tiny_config(2, vocab_size=24, num_hidden_layers=3)
    model = random_model(cfg, 2)
    m = block_model(kind, cfg, 2)
    x = torch.tensor([make_prompt(cfg, 2, 40)])
    drafter = make_drafter(kind, m, model)
    cache = model.new_cache(1)
    out = model(x[:, :-1], cache, capture=drafter.capture)
    drafter.extend(x[:, :-1], out.hidden, torch.tensor([x.shape[1] - 1]))
    with torch.no_grad():
        tokens, _ = drafter.draft(x[:, -1], cache)
        logits, _ = drafter.block_forward(x[:, -1], cache)
        prev = torch.cat([x[:, -1:], tokens[:, :-1]], 1)
        want = logits + m.seq_bias(prev)
    with torch.enable_grad():
        y = torch.cat([x, tokens], 1)
        r = x.shape[1] - 1  # the root's position
        src = m.cfg.source_layers if kind == "ready" else []
        hidden, emb, _, inputs = target_pass(model, y, m.cfg.feature_layers, src)
        anchors = torch.tensor([[3, r, 17]])  # several anchors in one forward; `r` is the drafted one
        read = None
        if src:
            states = committed_states(model, inputs, anchors, chunk=16)
            read = lambda q, w: reader_naive.state_read(states, [None] * len(states), q, w, flush=False)  # noqa: E731
        h = m.block_hidden(m.features(hidden), emb[:, anchors[0]], anchors, read)
        got = m.logits(h[:, 1], model.lm_head.weight) + m.seq_bias(y[:, r:r + 7])
    assert got.requires_grad
    assert (got.detach() - want).abs().max() < 1e-10


# checkpoints ---------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    from safetensors import safe_open

    cfg = tiny_config(1)
    model = random_model(cfg, 1)
    for kind, name in (("dspark", "dspark"), ("ready", "ready")):
        m = block_model(kind, cfg, 1, reader_rank="full") if kind == "ready" else block_model(kind, cfg, 1)
        save_block_drafter(m, tmp_path / name)
        names = safe_open(str(tmp_path / name / "model.safetensors"), "pt").keys()
        assert not [n for n in names if "embed" in n or "lm_head" in n]
        back = load_block_drafter(tmp_path / name, model)
        assert type(back) is type(m) and back.cfg == m.cfg
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), back.state_dict().values()))
    assert load_block_drafter(tmp_path / "ready", model, expect=ready_kind.MODEL_TYPE).cfg.reader_rank is None
    assert find_block_drafter(tmp_path) == tmp_path / "dspark" and find_block_drafter(tmp_path, "ready") == tmp_path / "ready"
    dsp = block_drafter(tmp_path / "dspark", model, block=5)
    assert type(dsp) is DSparkDrafter and dsp.max_nodes == 6
    rdy = block_drafter(tmp_path / "ready", model)
    assert type(rdy) is ReadyDrafter and rdy.capture == tuple(back.cfg.feature_layers)
    with pytest.raises(CheckpointError, match="dspark"):
        block_drafter(tmp_path / "ready", model, expect=dspark_kind.MODEL_TYPE)
    with pytest.raises(InputError, match="ReadyModel"):
        ReadyDrafter(load_block_drafter(tmp_path / "dspark", model), model)
    with pytest.raises(CheckpointError, match="GDN layer"):
        ReadyConfig.for_target(cfg, source_layers=[cfg.num_hidden_layers]).check(cfg)
    other = random_model(tiny_config(1, num_v_heads=cfg.num_v_heads * 2, num_heads=cfg.num_heads), 1)
    with pytest.raises(CheckpointError, match="heads"):
        load_block_drafter(tmp_path / "ready", other)


def test_demo_shape_fits_the_budget():
    from specla.data.tokenizer import load_tokenizer
    from specla.train.target import demo_config

    tcfg = demo_config(load_tokenizer(DEMO_DIR))
    rcfg = ReadyConfig.for_target(tcfg)
    assert rcfg.source_layers == [6, 11] and rcfg.inject_layers == [1] and rcfg.block_size == 7
    with torch.device("meta"):
        n = sum(p.numel() for p in ReadyModel(rcfg).parameters())
    assert n * 2 <= 4 * 10**6  # bf16, embedding and LM head shared with the target


# committed states for training ------------------------------------------------------------------

def test_committed_states_equal_decoding():
    cfg = tiny_config(5, num_hidden_layers=3, use_short_conv=True)
    model = random_model(cfg, 5)
    toks = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[0, 1, 15, 16, 17, 69], [2, 31, 32, 33, 40, 64]])
    _, _, _, inputs = target_pass(model, toks, [0], [0, 2])
    states = committed_states(model, inputs, anchors, chunk=16)
    for b in range(2):
        for a in range(anchors.shape[1]):
            r, cache = int(anchors[b, a]), model.new_cache(1)
            if r:
                model(toks[b:b + 1, :r], cache)
            for S, layer in zip(states, (0, 2)):
                assert (S[b * anchors.shape[1] + a] - cache.layers[layer].S[0]).abs().max() < 1e-10


# training --------------------------------------------------------------------------------------

def test_two_stage_training(tmp_path):
    from test_eagle import _response_data

    model = _response_data(tmp_path)
    tgt, data = tmp_path / "target", tmp_path / "data.npz"
    kw = dict(batch_size=4, seq_len=48, anchors=4, eval_every=3, eval_batches=1, log_every=1, device="cpu",
              progress=False, warmup=2)
    whole = train_block_drafter(tgt, tmp_path / "ds", data, kind="dspark", total_steps=6, lr=3e-3, **kw)
    assert whole["finished"] and len(whole["val_survival"]) == 7 and whole["val_accept_length"] >= 1
    assert len(whole["first_steps_seconds"]) == 5 and min(whole["first_steps_seconds"]) > 0  # one-time costs show
    # and which part of a step holds them: each first step's parts, within the step's own time
    assert [set(p) for p in whole["first_steps_phases"]] == [{"batch and target", "update"}] * 5
    assert all(sum(p.values()) <= s + 5e-3 for p, s in zip(whole["first_steps_phases"], whole["first_steps_seconds"]))
    first = train_block_drafter(tgt, tmp_path / "ds2", data, kind="dspark", total_steps=6, lr=3e-3, max_minutes=0.0, **kw)
    assert first["step"] == 1 and not first["finished"]
    second = train_block_drafter(tgt, tmp_path / "ds2", data, kind="dspark", total_steps=6, lr=3e-3, **kw)
    assert second["step"] == 6
    a = torch.load(tmp_path / "ds" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "ds2" / "ckpt.pt", weights_only=False)["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)  # resuming changes nothing
    dspark = tmp_path / "ds" / "export"
    assert json.loads((dspark / "training_state.json").read_text())["kind"] == "dspark"

    # stage 1: only the reader trains
    s1 = train_block_drafter(tgt, tmp_path / "r1", data, kind="ready", stage=1, init_from=dspark, total_steps=3,
                             reader_rank=4, **kw)
    assert s1["step"] == 3
    base = load_block_drafter(dspark, model)
    r1 = load_block_drafter(tmp_path / "r1" / "export", model, expect=ready_kind.MODEL_TYPE)
    assert r1.cfg.reader_rank == 4
    rsd = r1.state_dict()
    for name, t in base.state_dict().items():
        assert torch.equal(rsd[name], t), name
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in rsd.items() if n.endswith("out.weight"))
    with pytest.raises(InputError, match="stage"):
        train_block_drafter(tgt, tmp_path / "r1", data, kind="ready", stage=2, total_steps=3, **kw)
    # stage 2: everything trains; the control gets the same fine-tuning without a reader
    s2 = train_block_drafter(tgt, tmp_path / "r2", data, kind="ready", stage=2, init_from=tmp_path / "r1" / "export",
                             total_steps=2, **kw)
    r2 = load_block_drafter(tmp_path / "r2" / "export", model, expect=ready_kind.MODEL_TYPE)
    assert s2["step"] == 2 and not torch.equal(r2.state_dict()["fuse.weight"], rsd["fuse.weight"])
    ft = train_block_drafter(tgt, tmp_path / "ft", data, kind="dspark-ft", init_from=dspark, total_steps=5, **kw)
    assert ft["stage"] == 2 and type(load_block_drafter(tmp_path / "ft" / "export", model)) is DSparkModel
    for run in ("r2", "ft"):  # the trained drafters decode exactly
        drafter = block_drafter(tmp_path / run / "export", model)
        assert type(drafter) is (ReadyDrafter if run == "r2" else DSparkDrafter)
        prompt = ResponseSetPrompt(data)
        assert Decoder(model, drafter).run(prompt, 16)[0] == Decoder(model).run(prompt, 16)[0]


def ResponseSetPrompt(path):
    from specla.train.drafter import ResponseSet

    d = ResponseSet(path)
    return torch.tensor([d.sequence(0)[:int(d.prompt_len[0])].tolist()])


@pytest.mark.parametrize("kind", ["eagle", "dspark"])
def test_drafter_training_under_torchrun_on_cpu(tmp_path, kind):
    """`specla train drafter` under torchrun: two processes (gloo on CPU) share each step's batch."""
    from test_eagle import _response_data
    from test_train_target import torchrun

    _response_data(tmp_path)
    run = tmp_path / "run"
    block = ["--anchors", "4"] if kind != "eagle" else ["--unroll", "2"]
    torchrun(["train", "drafter", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.npz"),
              "--out", str(run), "--kind", kind, "--total-steps", "3", "--batch-size", "2", "--seq-len", "48", *block])
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["world"] == 2 and log[0]["batch_size"] == 4
    end = json.loads((run / "export" / "training_state.json").read_text())
    assert end["step"] == 3 and end["sequences_seen"] == 3 * 4
