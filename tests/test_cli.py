"""The CLI and API on a tiny model: output shape, streaming, and one-line errors for bad input."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from specla.api import DEMO_DIR, load
from specla.checkpoint import save_model
from specla.config import ModelConfig
from specla.errors import InputError, TopologyError
from specla.shapes import random_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO_DIR / f, d / f)
    vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = ModelConfig(vocab_size=len(vocab) + 16, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                      num_heads=2, num_v_heads=2, head_dim=8, head_v_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=True)
    save_model(random_model(cfg, dtype=torch.float32), d)
    return d


def specla(*args, timeout=120):
    r = subprocess.run([sys.executable, "-m", "specla.cli", *args], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def test_version():
    from specla import __version__

    code, out, _ = specla("--version")
    assert code == 0 and out.strip() == f"specla {__version__}"


def test_generate_json(model_dir):
    code, out, err = specla("generate", "--model", str(model_dir), "--prompt", "def reverse(s):",
                            "--route", "tree", "--max-new-tokens", "12", "--json", "--device", "cpu")
    assert code == 0, err
    res = json.loads(out)
    for key in ("text", "tokens", "route", "rounds", "mean_accepted_length", "tokens_per_second"):
        assert key in res
    assert res["route"] == "tree" and 0 < len(res["tokens"]) <= 12
    code, out, err = specla("generate", "--model", str(model_dir), "--prompt", "x", "--route", "ar",
                            "-n", "3", "--json", "--device", "cpu")
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_generate_streams_text_and_summary(model_dir):
    code, out, err = specla("generate", "hello", "--model", str(model_dir), "--route", "chain",
                            "-n", "8", "--device", "cpu", "--temperature", "0.7", "--seed", "3")
    assert code == 0, err
    assert "tokens/s" in err and "mean accepted length" in err


def test_api_routes_agree_and_stream(model_dir):
    lm = load(model_dir, device="cpu", dtype="float64")
    ar = lm.generate("a b a b a b", route="ar", max_new_tokens=20)
    for route in ("chain", "tree"):
        assert lm.generate("a b a b a b", route=route, max_new_tokens=20).tokens == ar.tokens
    pieces = list(lm.stream("a b a b a b", route="tree", max_new_tokens=20))
    assert "".join(pieces) == ar.text
    # the drafter a route's generations share, however its options are spelled
    served = lm.served_drafter("tree")
    assert served is lm.served_drafter("tree", tree_topk=4) is lm.served_drafter("tree", 8, 4, 16)
    assert sorted(k[0] for k in lm._drafters) == ["ar", "chain", "tree"]  # one entry a route, no twins
    # an adaptive depth read back from JSON (a list) is the tuple's drafter
    assert lm.served_drafter("tree", tree_depth=[4, 8]) is lm.served_drafter("tree", tree_depth=(4, 8))


BAD = [
    (["--prompt", "", "-n", "4"], "prompt is empty"),
    (["--prompt", "x " * 200, "-n", "4", "--raw"], "maximum context"),
    (["--prompt", "hi", "-n", "0"], "--max-new-tokens must be positive"),
    (["--prompt", "hi", "-n", "-3"], "--max-new-tokens must be positive"),
    (["--prompt", "hi", "--route", "beam"], "unknown route"),
    (["--prompt", "hi", "--dtype", "int8"], "unknown dtype"),
    (["--prompt", "hi", "--compile", "fast"], "unknown compile mode"),
    (["-n", "4"], "give the prompt once"),
    (["hi", "--prompt", "hi", "-n", "4"], "give the prompt once"),
]


@pytest.mark.parametrize("args,msg", BAD)
def test_bad_input_one_line_error(model_dir, args, msg):
    code, out, err = specla("generate", "--model", str(model_dir), "--device", "cpu", *args)
    assert code != 0
    assert msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,msg", [
    (["--tree-width", "5"], "tree width (beams kept a depth) must be between 1 and the top-k 4"),
    (["--tree-temperature", "0"], "tree temperature must be positive"),
    (["--tree-depth", "6-10"], "tree depth '6-10': expected N or SHALLOW:DEEP"),
    (["--tree-depth", "8:8"], "an adaptive depth is (shallow, deep) with 1 <= shallow < deep"),
])
def test_bad_tree_options_one_line_error(args, msg):
    """Options of the trained drafter's trees (the demo pair ships one) fail with one line."""
    code, out, err = specla("generate", "--model", str(DEMO_DIR), "--device", "cpu", "--prompt", "hi",
                            "--route", "tree", "-n", "4", *args)
    assert code != 0
    assert msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["eagle", "dspark"])
def test_bad_training_data_one_line_error(tmp_path, kind):
    """A drafter's training data that is missing, not an .npz, or another .npz: one line each,
    before the target loads or the run directory is made."""
    import numpy as np

    (tmp_path / "text.npz").write_text("not an archive")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    for name, msg in (("missing.npz", "not found"), ("text.npz", "is not an .npz file"),
                      ("other.npz", "has no tokens, offsets")):
        code, _, err = specla("train", "drafter", "--target", str(DEMO_DIR), "--data", str(tmp_path / name),
                              "--out", str(tmp_path / "run"), "--kind", kind)
        assert code != 0 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "run").exists()


def test_missing_corpus_one_line_error(tmp_path):
    """Commands that read the training corpus say how to build it, in one line."""
    for args in (["data", "responses", "--target", str(DEMO_DIR), "--out", str(tmp_path / "r.npz")],
                 ["train", "target", "--out", str(tmp_path / "run")]):
        code, _, err = specla(*args, "--corpus", str(tmp_path / "missing"))
        assert code != 0 and "specla data corpus" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["kernels", "decode", "gemv", "controlled", "agreement", "ready"])
def test_gpu_benchmarks_without_a_gpu_one_line_error(monkeypatch, command):
    """A GPU benchmark started where no CUDA GPU is says so in one line (and how to smoke-test it)."""
    from typer.testing import CliRunner

    from specla.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(app, ["bench", command])
    assert isinstance(r.exception, InputError) and "no CUDA GPU is here" in str(r.exception)


def _broken(model_dir, tmp_path, how):
    d = tmp_path / how
    shutil.copytree(model_dir, d)
    if how == "missing-weights":
        (d / "model.safetensors").unlink()
    elif how == "missing-config":
        (d / "config.json").unlink()
    elif how == "wrong-shapes":
        cfg = json.loads((d / "config.json").read_text())
        cfg["hidden_size"] = 48
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "unknown-arch":
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "missing-tokenizer":
        (d / "tokenizer.json").unlink()
    elif how == "missing-shard":
        from specla.checkpoint import load_model
        save_model(load_model(d), d, max_shard_bytes=4000)
        sorted(d.glob("model-*.safetensors"))[1].unlink()
    elif how == "unsupported-option":
        cfg = json.loads((d / "config.json").read_text())
        cfg["attnres_block_size"] = 4
        (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("how,msg", [
    ("missing-weights", "no model.safetensors"), ("missing-config", "no config.json"),
    ("wrong-shapes", "has shape"), ("unknown-arch", "unsupported architecture LlamaForCausalLM"),
    ("missing-tokenizer", "no tokenizer.json"), ("missing-shard", "missing shard"),
    ("unsupported-option", "attnres_block_size"), ("nonexistent", "does not exist")])
def test_bad_checkpoint_one_line_error(model_dir, tmp_path, how, msg):
    d = tmp_path / "nope" if how == "nonexistent" else _broken(model_dir, tmp_path, how)
    code, out, err = specla("generate", "--model", str(d), "--prompt", "hi", "-n", "2", "--device", "cpu")
    assert code == 2 and msg in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_api_rejects_bad_ids_and_topologies(model_dir):
    lm = load(model_dir, device="cpu")
    V = lm.model.cfg.vocab_size
    with pytest.raises(InputError, match="out of range"):
        lm.generate([1, 2, V + 5], route="ar", max_new_tokens=2)
    with pytest.raises(InputError, match="out of range"):
        lm.generate([-1, 2], route="ar", max_new_tokens=2)
    ids = lm.encode_prompt("hello there", chat=False)
    with pytest.raises(TopologyError, match="not topological"):
        lm.verify("hello there", [ids[-1], 5, 6], [-1, 2, 0])
    with pytest.raises(TopologyError, match="parents\\[0\\] must be -1"):
        lm.verify("hello there", [ids[-1], 5], [0, 0])
    logits = lm.verify("hello there", [ids[-1], 5, 6], [-1, 0, 0])
    assert logits.shape == (3, V)


@pytest.mark.parametrize("args,msg", [
    (["train", "drafter", "--kind", "medusa"], "--kind 'medusa': choose one of eagle, dspark, ready, dspark-ft"),
    (["data", "responses", "--shard", "2/2"], "--shard"),
    (["bench", "e2e", "--routes", "ar,beam"], "unknown route beam in --routes"),
    (["bench", "ready", "--rows", "ready,medusa"], "--rows"),
    (["bench", "rounds", "--warm-routes", "ar,medusa"], "unknown route(s) medusa"),
    (["bench", "controlled", "--lengths", "0,5"], "--lengths must be positive"),
    (["bench", "controlled", "--ps", "0.8,x"], "--lengths takes integers and --ps numbers"),
])
def test_bad_cli_options_one_line_error(model_dir, tmp_path, args, msg):
    extra = {"train": ["--target", str(model_dir), "--data", str(tmp_path / "x.npz"), "--out", str(tmp_path / "run")],
             "data": ["--target", str(model_dir), "--out", str(tmp_path / "r.npz")],
             "bench": ["--out", str(tmp_path)]}[args[0]]
    code, out, err = specla(*args, *extra)
    assert code == 2, err
    assert msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_readme_python_example_runs():
    """The README's Python example, as written (the bundled demo pair; on CPU here)."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    printed = []
    env = {"print": lambda *a, **k: printed.append(a)}
    exec(compile(code, "README.md", "exec"), env)
    lm = env["lm"]
    assert lm.model.device.type in ("cpu", "cuda") and env["out"].tokens and printed
