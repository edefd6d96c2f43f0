"""Model card for a trained target: numbers from its training log, loss curve, samples.

`specla train card --model DIR --log train_log.jsonl` writes DIR/README.md and
DIR/loss.png; every figure in the card is read from the log committed beside it.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_log(path: Path) -> dict:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    start = next(r for r in rows if r.get("event") == "start")
    runs = [r for r in rows if r.get("event") == "end_of_run"]
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    return {"start": start, "runs": runs, "train": train, "val": val}


def plot_loss(log: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] / 1e6 for r in log["train"]], [r["loss"] for r in log["train"]],
            lw=0.8, alpha=0.7, label="train (batch)")
    ax.plot([r["tokens"] / 1e6 for r in log["val"]], [r["val_loss"] for r in log["val"]],
            "o-", ms=3, label="validation")
    for r in log["runs"][:-1]:
        ax.axvline(r["tokens_seen"] / 1e6, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("demo target pretraining (dotted: run boundaries)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write_card(model_dir: Path, log_path: Path, prompts: int = 3, max_new_tokens: int = 96) -> Path:
    from specla.api import load
    from specla.data.suites import load_suite

    model_dir = Path(model_dir)
    log = read_log(log_path)
    plot_loss(log, model_dir / "loss.png")
    s, last = log["start"], log["runs"][-1]
    cfg = s["config"]
    weight_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    lm = load(model_dir, device="cpu", dtype="float32")
    samples = []
    for p in load_suite("mixed")[:: 80][:prompts]:
        out = lm.generate(p.turns[0], route="ar", max_new_tokens=max_new_tokens)
        samples.append((p.category, p.turns[0], out.text))
    final_val = log["val"][-1]["val_loss"]
    final_train = sum(r["loss"] for r in log["train"][-10:]) / len(log["train"][-10:])
    lines = [
        "# specla demo target",
        "",
        "A small pure Gated DeltaNet language model trained by specla for its demos, tests and",
        "end-to-end benchmarks. It is a toy: it writes recognisable English and Python, but it",
        "knows little and reasons poorly. Its purpose is to be a real trained target whose",
        "speculative decoding can be measured honestly.",
        "",
        "## Architecture",
        "",
        f"- {cfg['num_hidden_layers']} GDN layers, hidden {cfg['hidden_size']}, {cfg['num_heads']} key heads / "
        f"{cfg['num_v_heads']} value heads of {cfg['head_dim']}×{cfg['head_v_dim']} (fp32 state "
        f"{cfg['num_v_heads'] * cfg['head_dim'] * cfg['head_v_dim'] * 4 // 1024} KiB per layer), short conv "
        f"{cfg['conv_size']}, output gate, SwiGLU MLP {cfg['intermediate_size']}",
        f"- vocabulary {cfg['vocab_size']} (byte-level BPE, `tokenizer.json`), tied embeddings: "
        f"{s['params'] / 1e6:.2f} M parameters, {weight_bytes / 1e6:.1f} MB as bf16 safetensors "
        "(fla `GatedDeltaNetForCausalLM` format, sharded under 16 MiB)",
        "",
        "## Data",
        "",
        f"The corpus of `specla data corpus` (docs/data.md): ShareGPT conversations, GSM8K train, the "
        f"Python 3.11 documentation and standard library sources, deduplicated, every benchmark prompt "
        f"excluded; {s['train_tokens'] / 1e6:.1f} M training and {s['val_tokens'] / 1e6:.2f} M validation tokens.",
        "",
        "## Training",
        "",
        f"- device: {s['device']} × {s['world']}; batch {s['batch_size']} × {s['seq_len']} tokens; AdamW "
        f"(0.9, 0.95), peak LR {s['lr']}, warmup then cosine to 10%, bf16 autocast, GDN through the chunked UT form in PyTorch "
        "(`specla/ops/gdn/train.py`; fla's chunk backward is refused on Hopper with Triton 3.6)",
        f"- {len(log['runs'])} resumable runs; steps {last['step']} of {last['total_steps']}; "
        f"tokens seen {last['tokens_seen'] / 1e6:.1f} M "
        f"({last['tokens_seen'] / s['train_tokens']:.1f} epochs); training time {last['train_seconds'] / 60:.1f} min "
        f"(wall time {sum(r['wall_seconds'] for r in log['runs']) / 60:.1f} min with tokenisation and evaluation)",
        f"- final train loss {final_train:.3f} (mean of the last 10 logged batches), "
        f"validation loss {final_val:.3f} nats/token",
        "",
        "![loss curve](loss.png)",
        "",
        "Source of every number: `train_log.jsonl` beside this card.",
        "",
        "## Samples (greedy, chat template, eagle_mixed prompts)",
        "",
    ]
    for cat, prompt, text in samples:
        lines += [f"**{cat}** — {prompt[:200]}", "", "```", text.strip(), "```", ""]
    (model_dir / "README.md").write_text("\n".join(lines))
    return model_dir / "README.md"
