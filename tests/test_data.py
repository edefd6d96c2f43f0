"""Tests for specla.data: benchmark suites, corpus builder helpers, demo tokenizer."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specla.data import corpus as C
from specla.data.suites import SUITES, Prompt, benchmark_texts, load_gsm8k_train, load_suite
from specla.data.chat import BOS, CHAT_TEMPLATE, EOS, SPECIAL_TOKENS, render_chat
from specla.data.tokenizer import load_tokenizer

DEMO_DIR = Path(__file__).resolve().parents[1] / "specla" / "models" / "demo"

TRICKY = [
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "\ttabs\tand\t\ttabs\t",
    "\n\nnewlines\n\n\n",
    "windows\r\nline\r\nendings\r\n",
    "ünïcödé café naïve — “quotes” … ½ ∑ √",
    "emoji 😀👍🏽 and CJK 中文 日本語 한국어",
    "zero\u200bwidth \u00a0nbsp \ufeffbom",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment\n\n\tif x:\n\t\tpass\n",
    "special strings inline: <|user|> hi <|eos|>",
    "<|bos|>",
    "\x00\x01 control chars \x7f",
    "1234567890 + 98765 = 99999",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "  Hello\tthere \n"},
        {"role": "assistant", "content": " General Kenobi.\n"},
        {"role": "user", "content": "ünï 😀"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ],
]


# --------------------------------------------------------------------------- suites


def test_suite_counts():
    assert SUITES == ("mixed", "gsm8k", "humaneval")
    mixed = load_suite("mixed")
    assert len(mixed) == 480
    assert len(load_suite("gsm8k")) == 1319
    assert len(load_suite("humaneval")) == 164
    cats = [p.category for p in mixed]
    assert {c: cats.count(c) for c in set(cats)} == {
        c: 80 for c in ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
    }
    assert all(isinstance(p, Prompt) and p.turns and all(isinstance(t, str) and t for t in p.turns) for p in mixed)
    assert all(len(p.turns) == 2 for p in mixed if p.category == "mt_bench")
    assert len({p.id for p in mixed}) == 480
    he = load_suite("humaneval")
    assert he[0].id == "HumanEval/0" and he[0].turns[0].startswith("from typing import List")
    assert load_suite("gsm8k")[0].reference.endswith("#### 18")


def test_suite_order_and_limit():
    a = load_suite("mixed")
    b = load_suite("mixed", limit=10)
    assert [p.id for p in b] == [p.id for p in a[:10]]
    b[0].turns.append("mutated")  # callers cannot corrupt the cache
    assert load_suite("mixed")[0].turns == a[0].turns


def test_unknown_suite():
    with pytest.raises(ValueError) as e:
        load_suite("mtbench")
    for name in SUITES:
        assert name in str(e.value)


def test_prompt_files_are_suites(tmp_path):
    """A .txt (a prompt a line) or .jsonl (prompt / question / turns / messages) file is a suite."""
    txt = tmp_path / "mine.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    got = load_suite(str(txt))
    assert [p.turns for p in got] == [["first prompt"], ["second prompt"]]
    assert [p.id for p in got] == ["mine/1", "mine/3"] and got[0].suite == "mine"
    rows = [{"prompt": "a"}, {"question": "b"}, {"turns": ["c", "c2"]},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "d"}]}, "e"]
    js = tmp_path / "mine.jsonl"
    js.write_text("\n".join(json.dumps(r) for r in rows))
    assert [p.turns for p in load_suite(str(js), limit=4)] == [["a"], ["b"], ["c", "c2"], ["d"]]
    js.write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match=r"mine.jsonl:1: expected"):
        load_suite(str(js))
    with pytest.raises(ValueError, match="not found"):
        load_suite(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="file of prompts"):
        load_suite("mine.csv")


def test_gsm8k_train_and_benchmark_texts():
    rows = load_gsm8k_train()
    assert len(rows) == 7473 and {"question", "answer"} <= set(rows[0])
    texts = benchmark_texts()
    assert len(texts) == len(set(texts))
    s = set(texts)
    for name in SUITES:
        for p in load_suite(name):
            assert set(p.turns) <= s


# --------------------------------------------------------------------------- chat template


def test_render_chat_format():
    turns = CONVERSATIONS[2]
    text = render_chat(turns, add_generation_prompt=True)
    assert text == (
        BOS + "<|user|>\n  Hello\tthere \n\n<|assistant|>\n General Kenobi.\n" + EOS
        + "<|user|>\nünï 😀\n<|assistant|>\n"
    )
    with pytest.raises(ValueError, match="role"):
        render_chat([{"role": "tool", "content": "x"}], False)


def test_render_chat_prefix_property():
    """A generation prompt + reply + EOS is a prefix of the next rendering."""
    turns = CONVERSATIONS[3]
    for k in range(len(turns)):
        if turns[k]["role"] != "assistant":
            continue
        prompt = render_chat(turns[:k], add_generation_prompt=True)
        assert render_chat(turns[: k + 1]).startswith(prompt + turns[k]["content"] + EOS)
        assert render_chat(turns).startswith(prompt + turns[k]["content"] + EOS)


# --------------------------------------------------------------------------- shipped tokenizer


@pytest.fixture(scope="module")
def demo_tok():
    if not (DEMO_DIR / "tokenizer.json").is_file():
        pytest.fail(f"demo tokenizer missing at {DEMO_DIR}")
    return load_tokenizer(DEMO_DIR)


def test_demo_tokenizer_files(demo_tok):
    cfg = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert json.loads((DEMO_DIR / "special_tokens_map.json").read_text())["eos_token"] == "<|eos|>"
    assert demo_tok.vocab_size == 8192
    for i, t in enumerate(SPECIAL_TOKENS):
        assert demo_tok.token_to_id(t) == i
        assert demo_tok.encode(t) == [i]  # single special tokens
    assert demo_tok.bos_token_id == 0 and demo_tok.eos_token_ids == {1} and demo_tok.pad_token_id == 2


def test_demo_tokenizer_roundtrips_benchmark_prompts(demo_tok):
    n = 0
    for p in load_suite("mixed"):
        for t in p.turns:
            assert demo_tok.decode(demo_tok.encode(t)) == t, p.id
            n += 1
    assert n == 560


@pytest.mark.parametrize("s", TRICKY)
def test_demo_tokenizer_roundtrips_tricky(demo_tok, s):
    assert demo_tok.decode(demo_tok.encode(s)) == s


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_demo_tokenizer_roundtrips_any_text(demo_tok, s):
    assert demo_tok.decode(demo_tok.encode(s)) == s


def test_tokenizers_from_file(demo_tok):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    s = TRICKY[10]
    assert tok.encode(s).ids == demo_tok.encode(s)
    assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s


@pytest.mark.parametrize("turns", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(demo_tok, turns, gen):
    transformers = pytest.importorskip("transformers")
    at = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))
    expected = render_chat(turns, add_generation_prompt=gen)
    assert at.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen) == expected
    assert demo_tok.render_chat(turns, add_generation_prompt=gen) == expected
    ids = at.apply_chat_template(turns, tokenize=True, add_generation_prompt=gen)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert list(ids) == demo_tok.apply_chat_template(turns, add_generation_prompt=gen)
    assert demo_tok.decode(demo_tok.apply_chat_template(turns, add_generation_prompt=gen)) == expected


# --------------------------------------------------------------------------- generic loader


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)


def test_load_tokenizer_generic_dir(tmp_path):
    """A checkpoint dir without chat template, EOS ids from generation_config (list)."""
    (tmp_path / "tokenizer.json").write_bytes((DEMO_DIR / "tokenizer.json").read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5], "bos_token_id": 0}))
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template is None
    assert tok.eos_token_ids == {1, 5} and tok.bos_token_id == 0
    turns = [{"role": "user", "content": "Hello world"}]
    assert tok.decode(tok.apply_chat_template(turns)) == "Hello world"
    # a separate chat_template.jinja file is picked up
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = load_tokenizer(tmp_path)
    assert tok.render_chat(turns) == "[Hello world]"


# --------------------------------------------------------------------------- corpus helpers


def test_parse_sharegpt_truncated():
    raw = json.dumps([{"id": "a_0", "conversations": []}, {"id": "b_0", "conversations": []}], indent=2)
    els, truncated = C.parse_sharegpt(raw)
    assert [e["id"] for e in els] == ["a_0", "b_0"] and not truncated
    els, truncated = C.parse_sharegpt(raw[: raw.index('"b_0"') + 10])
    assert [e["id"] for e in els] == ["a_0"] and truncated


def test_benchmark_filter():
    long_prompt = "Janet has seven red apples and she gives three of them to her brother who eats two"
    short_prompt = "Where was the 2015 rugby union world cup held?"
    f = C.BenchmarkFilter([long_prompt, short_prompt, "Hi there friend"])
    assert f.num_prompts == 2
    # any 13 consecutive words of the long prompt, whatever the case / spacing / punctuation
    assert f.overlaps("blah blah SEVEN red apples and she\n gives three of them, to her brother who eats! more")
    assert not f.overlaps("seven red apples and she gives three of them to her brother")  # 11 words
    assert f.overlaps("Q: where was the 2015 Rugby Union World-Cup held? A: England.")
    assert not f.overlaps("where was the 2015 rugby union world cup")
    assert not f.overlaps("hi there friend")  # too short to be matched


def test_split_of_deterministic():
    groups = [f"g{i}" for i in range(20000)]
    a = [C.split_of("s", g, 0.01, seed=0) for g in groups]
    assert a == [C.split_of("s", g, 0.01, seed=0) for g in groups]
    assert 120 < a.count("val") < 280
    assert a != [C.split_of("s", g, 0.01, seed=1) for g in groups]


def _synthetic_sources(tmp_path: Path, planted: str):
    convs = []
    for i in range(40):
        convs.append(
            {
                "id": f"c{i}_0",
                "conversations": [
                    {"from": "human", "value": f"Question number {i}: tell me about topic {i * 7919 % 1000}."},
                    {"from": "gpt", "value": f"Answer {i}. " + "lorem ipsum dolor " * (i % 5 + 1)},
                ],
            }
        )
    convs.append(dict(convs[3], id="dup_0"))  # exact duplicate content
    convs.append(
        {"id": "bench_0", "conversations": [{"from": "human", "value": "Please solve: " + planted},
                                             {"from": "gpt", "value": "Sure."}]}
    )
    convs.append(
        {"id": "lead_0", "conversations": [{"from": "gpt", "value": "orphan reply"},
                                            {"from": "human", "value": "next question here"},
                                            {"from": "gpt", "value": "next answer"},
                                            {"from": "human", "value": "dangling"}]}
    )
    convs.append({"id": "solo_0", "conversations": [{"from": "gpt", "value": "only assistant"}]})
    raw = json.dumps(convs, indent=2)
    sg = tmp_path / "sharegpt.json"
    sg.write_text(raw[:-1] + ',\n  {"id": "trunc_0", "conversations": [{"from": "human", "value": "cut')
    docs = tmp_path / "docs"
    (docs / "library").mkdir(parents=True)
    (docs / "library" / "json.rst.txt").write_text(":mod:`json` --- JSON encoder\n===\n\nSome text.\n")
    (docs / "index.rst.txt").write_text("Index\n=====\n")
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "test").mkdir()
    (lib / "mod.py").write_text("def f():\n    return 1\n")
    (lib / "pkg" / "__init__.py").write_text("X = 2\n")
    (lib / "test" / "test_mod.py").write_text("assert True\n")
    return sg, docs, lib


def test_build_corpus_synthetic(tmp_path):
    planted = load_suite("gsm8k")[5].turns[0]
    sg, docs, lib = _synthetic_sources(tmp_path, planted)
    out = tmp_path / "corpus"
    m = C.build_corpus(out, docs_dir=docs, sources=("pydocs", "stdlib", "sharegpt"), sharegpt_path=sg,
                       stdlib_dir=lib, val_fraction=0.2, progress=False, log=lambda s: None)
    s = m["sources"]
    assert s["sharegpt"]["elements_parsed"] == 44 and s["sharegpt"]["source_truncated"] == 1
    assert s["sharegpt"]["dropped_duplicate"] == 1
    assert s["sharegpt"]["dropped_benchmark_overlap"] == 1 and m["dropped_benchmark_overlap"] == 1
    assert s["sharegpt"]["dropped_empty"] == 1  # solo_0
    assert s["sharegpt"]["documents_selected"] == 41  # 40 + lead_0
    assert s["pydocs"]["documents_selected"] == 2
    assert s["stdlib"]["documents_selected"] == 2  # test/ is skipped

    train = list(C.iter_records(out, "train"))
    val = list(C.iter_records(out, "val"))
    assert len(train) + len(val) == 45 and val
    assert [r["text"] for r in train] == list(C.iter_documents(out, "train"))
    texts = {r["id"]: r["text"] for r in train + val}
    assert "bench_0" not in texts and "dup_0" not in texts
    assert texts["mod.py"] == BOS + "def f():\n    return 1\n" + EOS
    assert texts["lead_0"] == render_chat([{"role": "user", "content": "next question here"},
                                          {"role": "assistant", "content": "next answer"}])
    assert all(t.startswith(BOS) and t.endswith(EOS) for t in texts.values())
    assert not any(planted in t for t in texts.values())

    man = json.loads((out / "manifest.json").read_text())
    assert man == m
    for name in ("train", "val"):
        f = out / f"{name}.jsonl.xz"
        assert man["splits"][name]["bytes_compressed"] == f.stat().st_size
        assert man["splits"][name]["sha256"] == C._sha256(f)
        with lzma.open(f, "rt") as fh:
            assert sum(1 for _ in fh) == man["splits"][name]["documents"]

    # deterministic: same inputs, same bytes
    out2 = tmp_path / "corpus2"
    m2 = C.build_corpus(out2, docs_dir=docs, sources=("pydocs", "stdlib", "sharegpt"), sharegpt_path=sg,
                        stdlib_dir=lib, val_fraction=0.2, progress=False, log=lambda s: None)
    assert m2["splits"]["train"]["sha256"] == m["splits"]["train"]["sha256"]


def test_build_corpus_budget_subsamples(tmp_path):
    import random

    rng = random.Random(0)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):  # incompressible-ish text, ~4 KB each
        (docs / f"d{i:02d}.rst.txt").write_text("".join(rng.choice("abcdefghij klmnop\n") for _ in range(4000)))
    m = C.build_corpus(tmp_path / "c", docs_dir=docs, sources=("pydocs",), max_compressed_mib=40_000 / 2**20,
                       val_fraction=0.0, progress=False, log=lambda s: None)
    assert m["total_compressed_bytes"] <= 40_000
    assert 0 < m["sources"]["pydocs"]["documents_selected"] < 30
    assert m["sources"]["pydocs"]["dropped_budget"] == 30 - m["sources"]["pydocs"]["documents_selected"]


def test_build_corpus_missing_docs_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="python3.11-doc"):
        C.build_corpus(tmp_path / "c", docs_dir=tmp_path / "nope", progress=False, log=lambda s: None)


def test_iter_documents_errors(tmp_path):
    with pytest.raises(ValueError):
        next(C.iter_documents(tmp_path, "test"))
    with pytest.raises(FileNotFoundError):
        next(C.iter_documents(tmp_path, "train"))
