"""`specla train target` on CPU at a tiny shape: loss falls, a run resumes where it stopped."""

import json
import lzma

import torch

from specla.api import DEMO_DIR
from specla.checkpoint import load_model
from specla.config import ModelConfig
from specla.train.loop import RunClock, lr_at, schedule_length
from specla.train.target import train_target


def _corpus(d):
    d.mkdir()
    docs = ["<|bos|>the cat sat on the mat. the dog sat on the log.<|eos|>"] * 60 + \
           ["<|bos|>def add(a, b):\n    return a + b\n<|eos|>"] * 60
    for split, rows in (("train", docs), ("val", docs[::10])):
        with lzma.open(d / f"{split}.jsonl.xz", "wt") as f:
            for i, t in enumerate(rows):
                f.write(json.dumps({"source": "test", "id": str(i), "text": t}) + "\n")
    return d


def test_train_resume_export(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    cfg = ModelConfig(vocab_size=8192, hidden_size=16, num_hidden_layers=1, intermediate_size=32, num_heads=1,
                      num_v_heads=1, head_dim=8, head_v_dim=8, tie_word_embeddings=True)
    run = tmp_path / "run"
    kw = dict(config=cfg, total_steps=12, batch_size=4, seq_len=16, lr=1e-2, warmup=2, eval_every=6,
              eval_batches=2, log_every=1, device="cpu", progress=False)
    first = train_target(run, corpus, DEMO_DIR, max_minutes=0.0, **kw)  # stops after one step
    assert first["step"] == 1 and not first["finished"]
    second = train_target(run, corpus, DEMO_DIR, max_minutes=10.0, **kw)
    assert second["step"] == 12 and second["finished"]
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    vals = [r["val_loss"] for r in log if "val_loss" in r]
    assert losses[-1] < losses[0] and len(vals) == 2
    # a run that lost ckpt.pt continues from the export (weights and counters)
    again = train_target(tmp_path / "run2", corpus, DEMO_DIR, max_minutes=10.0, init_from=run / "export",
                         **{**kw, "total_steps": 14})
    assert again["step"] == 14 and again["tokens_seen"] == second["tokens_seen"] + 2 * 4 * 16
    model = load_model(run / "export")
    assert model.cfg.num_hidden_layers == 1 and (run / "export" / "tokenizer.json").is_file()
    x = torch.randint(0, 8192, (1, 5))
    assert torch.isfinite(model(x, model.new_cache()).logits).all()


def test_schedule():
    assert lr_at(0, 100, 1.0, 10) == 0.1
    assert abs(lr_at(10, 100, 1.0, 10) - 1.0) < 1e-9
    assert abs(lr_at(100, 100, 1.0, 10) - 0.1) < 1e-9


def test_time_schedule_ignores_a_stall_in_its_calibration():
    """The schedule's length comes from the median pace of the calibration's 10-step windows: a
    compile stall in one window (the aa91f03 DSpark run's 1.4 s against 0.4) leaves it where
    steady steps put it. The clock reads its marks after the right steps."""
    marks = [52.3 + 0.4 * i for i in range(11)]
    marks[2:] = [m + 1.0 for m in marks[2:]]  # one window took 1.4 s
    assert schedule_length(marks, 130, marks[-1], 4.0) == 130 + int((240 - marks[-1]) / 0.04)
    clock = RunClock(None, 4.0, 10.0, 10.0, torch.device("cpu"), False)
    seconds, fixed_at = 0.0, None
    for step in range(1, 200):
        seconds += 1.0 if step == 45 else 0.04  # a stall inside the calibration
        if clock.step_done(step, seconds):
            fixed_at = step
    assert fixed_at == 130 and len(clock._marks) == 11
    assert abs(clock.total_steps - (130 + (240 - (130 * 0.04 + 0.96)) / 0.04)) <= 1


def test_chunked_training_form_matches_recurrence():
    """The differentiable chunked UT form equals the token recurrence, values and gradients."""
    from specla.ops.gdn.naive import gdn_recurrent
    from specla.ops.gdn.train import gdn_train

    torch.manual_seed(0)
    B, T, H, HV, K, V = 2, 37, 2, 4, 8, 6
    f = torch.nn.functional.normalize
    q = f(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    k = f(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, dtype=torch.float64)
    g, beta = -torch.rand(B, T, HV, dtype=torch.float64), torch.rand(B, T, HV, dtype=torch.float64)
    ref = gdn_recurrent(q, k, v, g, beta, torch.zeros(B, HV, K, V, dtype=torch.float64), 0.3)
    assert (gdn_train(q, k, v, g, beta, 0.3, chunk=16) - ref).abs().max() < 1e-12
    args = tuple(t[:1, :10].clone().requires_grad_() for t in (q, k, v, g, beta))
    assert torch.autograd.gradcheck(lambda *a: gdn_train(*a, 0.3, chunk=4), args)


def torchrun(args: list[str]) -> None:
    """`specla ARGS` as two processes under torchrun (gloo on CPU); fails with the ranks' errors."""
    import subprocess
    import sys

    # --standalone: a free rendezvous port, so parallel test runs on one host cannot collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "specla.cli", *args, "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    # a rank that aborts says why early in stderr; torchrun's summary is at the end
    why = [line for line in r.stderr.splitlines() if "rror" in line or "terminate" in line or "abort" in line]
    assert r.returncode == 0, "\n".join(why[:20]) + "\n...\n" + r.stderr[-1500:]


def test_torchrun_ddp_on_cpu(tmp_path):
    """The same command under torchrun: two processes (gloo on CPU) train one model in lockstep."""
    corpus = _corpus(tmp_path / "corpus")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(dict(vocab_size=8192, hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                                   num_heads=1, num_v_heads=1, head_dim=8, head_v_dim=8, tie_word_embeddings=True)))
    run = tmp_path / "run"
    torchrun(["train", "target", "--out", str(run), "--corpus", str(corpus), "--config", str(cfg),
              "--total-steps", "4", "--batch-size", "2", "--seq-len", "16"])
    start = json.loads((run / "train_log.jsonl").read_text().splitlines()[0])
    assert start["world"] == 2 and start["batch_size"] == 4
    assert load_model(run / "export").cfg.hidden_size == 16
