"""CPU smoke runs of `specla bench controlled` and `specla bench agreement` (tiny shape; the
timings mean nothing on CPU, the code paths and result files do)."""

from __future__ import annotations

import gzip
import json
import math
import random

import pytest
import torch

from specla.bench import agreement, controlled


def test_controlled_quick_cpu(tmp_path):
    res = controlled.run(shape="tiny", device="cpu", quick=True, out_dir=tmp_path)
    data = json.loads((tmp_path / "controlled.json").read_text())
    assert (tmp_path / "controlled.png").stat().st_size > 0
    for key in ("device", "shape", "ar_ms_per_token", "round16_ms", "grid", "per_length", "versions", "commit"):
        assert key in data, key
    assert data["shape"] == "tiny"
    paired = data["round16_paired"]
    assert paired["pairs"] == 5 and paired["ar_ms"] > 0 and paired["round_ms"] > 0
    assert math.isfinite(paired["ratio"]) and paired["ratio"] > 0
    cells = {(c["p"], c["L"]) for c in data["grid"]}
    assert cells == {(p, L) for p in controlled.PS for L in controlled.LENGTHS}
    for c in data["grid"]:
        assert math.isfinite(c["speedup"]) and c["speedup"] > 0
        assert 1 <= c["tau"] <= c["L"] + 1
        if c["p"] == 1.0:  # oracle acceptance: every draft token, every round
            assert c["tau"] == c["L"] + 1 == c["expected_tau"]
    assert [r["L"] for r in data["per_length"]] == list(controlled.LENGTHS)
    assert res["grid"] == data["grid"] and data["complete"] is True


def test_controlled_keeps_finished_lengths_when_cut_short(tmp_path, monkeypatch):
    """A run stopped during its second chain length leaves the first length's cells on disk."""
    timed = controlled.ChainRuntime.timed

    def stop_at_second_length(self, accepted, chunk):
        if self.L == 6:
            raise KeyboardInterrupt
        return timed(self, accepted, chunk)

    monkeypatch.setattr(controlled.ChainRuntime, "timed", stop_at_second_length)
    with pytest.raises(KeyboardInterrupt):
        controlled.run(shape="tiny", device="cpu", quick=True, lengths=(5, 6), out_dir=tmp_path, name="cut")
    data = json.loads((tmp_path / "cut.json").read_text())
    assert data["complete"] is False and data["lengths"] == [5, 6]
    assert {(c["p"], c["L"]) for c in data["grid"]} == {(p, 5) for p in controlled.PS}
    assert [r["L"] for r in data["per_length"]] == [5]


def test_controlled_keeps_the_round_when_cut_in_the_first_length(tmp_path, monkeypatch):
    """A run stopped while its first chain length compiles still leaves the AR step and the
    16-node round on disk (what a call's time bound cut on a cold machine)."""
    def stop(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(controlled.ChainRuntime, "__init__", stop)
    with pytest.raises(KeyboardInterrupt):
        controlled.run(shape="tiny", device="cpu", quick=True, lengths=(5,), out_dir=tmp_path, name="cold")
    data = json.loads((tmp_path / "cold.json").read_text())
    assert data["complete"] is False and data["grid"] == [] and data["per_length"] == []
    assert data["ar_ms_per_token"] > 0 and data["round16_ms"] > 0 and data["round16_paired"]["pairs"] == 5


def test_sampled_acceptance_is_truncated_geometric():
    rng = random.Random(0)
    for p, L in ((0.5, 5), (0.8, 12), (0.0, 7), (1.0, 6)):
        xs = [controlled.sample_accepted(p, L, rng) for _ in range(20000)]
        assert max(xs) <= L
        mean = sum(x + 1 for x in xs) / len(xs)
        assert abs(mean - controlled.expected_tau(p, L)) < 0.05 * controlled.expected_tau(p, L)


def test_agreement_quick_cpu(tmp_path):
    res = agreement.run(shape="tiny", device="cpu", quick=True, out_dir=tmp_path)
    data = json.loads((tmp_path / "agreement.json").read_text())
    assert data["ar_loop_equals_decoder_ar"] is True
    assert set(data["summary"]) == {"chain", "tree", "chain+exact", "tree+exact"}
    for s in data["summary"].values():
        assert s["runs"] == 2 and 0 <= s["equal"] <= 2
        assert s["mean_tau"] > 1.5  # the noisy oracle gets drafts accepted on random weights
    # (bitwise agreement on CPU needs torch's portable kernels: tests/test_exact_mode.py)
    assert data["exact_width"] == 17 and data["ar_exact_equals_ar"] in (0, 1, 2)
    assert len(data["per_run"]) == 2 and res["summary"] == data["summary"]


def test_agreement_reports_divergence(tmp_path, monkeypatch):
    """A route that leaves AR's tokens is reported with the index and AR's margin there."""
    real = agreement.ar_with_margins

    def off_by_one_at_3(target, prompt, n):
        toks, margins = real(target, prompt, n)
        toks[3] = (toks[3] + 1) % target.model.cfg.vocab_size
        return toks, margins

    monkeypatch.setattr(agreement, "ar_with_margins", off_by_one_at_3)
    res = agreement.run(shape="tiny", device="cpu", quick=True, out_dir=tmp_path)
    assert res["ar_loop_equals_decoder_ar"] is False
    for route in ("chain", "tree"):
        assert res["summary"][route]["equal"] == 0
        for row in res["per_run"]:
            assert row[route]["first_divergence"] == 3 and row[route]["margin"] is not None
    for row in res["per_run"]:  # exact mode compares with its own AR, which the patch did not touch
        assert row["ar+exact"]["first_divergence"] == 3


def test_noisy_oracle_main_line():
    parents = [-1, 0, 0, 1, 1, 2, 3]
    d = agreement.NoisyOracle(parents, vocab=50, noise=0.0)
    assert d.main == [True, True, False, True, False, False, True]
    d.set_reference(list(range(10, 30)))
    from specla.drafters.base import DraftContext

    draft = d.propose(DraftContext(history=[[10, 11, 12]], cache=None))
    toks = draft.tokens[0].tolist()
    # history ends at position 2; main nodes at depth 1, 2, 3 propose reference[3], [4], [5]
    assert toks[0] == 12 and toks[1] == 13 and toks[3] == 14 and toks[6] == 15
    assert toks[2] != 13 and toks[4] != 14  # siblings of main nodes never repeat the main token
    assert agreement.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.first_divergence([1, 2, 3], [1, 2]) == 2


@pytest.mark.parametrize("p,L", [(0.7, 5), (0.9, 12)])
def test_expected_tau(p, L):
    assert controlled.expected_tau(p, L) == pytest.approx(sum(p ** k for k in range(L + 1)))


def _record_lines(folder):
    return [json.loads(x) for f in sorted(folder.glob("e2e.records.*.jsonl*"))
            for x in (gzip.decompress(f.read_bytes()).decode() if f.suffix == ".gz" else f.read_text()).splitlines()]


def test_e2e_shards_resume_and_summary(tmp_path, capsys, monkeypatch):
    """Two shards of the demo pair on CPU, one cut short and resumed; the summary of every
    record compares routes on matched prompts, and each route's tokens are AR's."""
    from specla.bench import e2e
    from specla.data.suites import load_suite

    kw = dict(suites=("gsm8k", "humaneval"), routes=("ar", "chain", "ngram", "ar+exact", "chain+exact"), limit=3,
              max_new_tokens=6,
              device="cpu", dtype="float32", out_dir=tmp_path)
    e2e.run(**kw, shard=(0, 2), max_minutes=0.0)  # stops before its first generation
    assert (tmp_path / "e2e.records.0of2.jsonl").read_text() == ""
    e2e.run(**kw, shard=(0, 2))
    e2e.run(**kw, shard=(1, 2))
    shard1 = tmp_path / "e2e.records.1of2.jsonl"
    capsys.readouterr()
    e2e.run(**kw, shard=(1, 2))  # all recorded: summarised without loading or warming anything
    out = capsys.readouterr()
    assert "warm-up" not in out.out + out.err
    kept = [x for x in shard1.read_text().splitlines() if json.loads(x)["route"] != "chain"]
    shard1.write_text("".join(x + "\n" for x in kept))
    e2e.run(**kw, shard=(1, 2))  # resumed: only the route with work left warms up
    out = capsys.readouterr()
    assert "warm-up chain:" in out.out and "warm-up ar:" not in out.out
    # kept gzipped, as the repository keeps a finished run's
    (tmp_path / "e2e.records.1of2.jsonl.gz").write_bytes(gzip.compress(shard1.read_bytes()))
    shard1.unlink()
    capsys.readouterr()
    measured = json.loads((tmp_path / "e2e.json").read_text())
    monkeypatch.setenv("SPECLA_SUMMARY_ONLY_HOST", "1")  # the summarising process's switches are not the run's
    res = e2e.run(**kw, summary_only=True)
    printed = capsys.readouterr().out
    assert "chain+exact" in printed and "(ar+exact)" in printed  # the summary table
    data = json.loads((tmp_path / "e2e.json").read_text())
    # prefill by prompt length: each AR record in the bucket of its own prompt's length
    for suite in ("gsm8k", "humaneval"):
        recs = [json.loads(x) for p in tmp_path.glob("e2e.records.*")
                for x in (gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()).splitlines()]
        ar_recs = [r for r in recs if r["suite"] == suite and r["route"] == "ar"]
        rows = data["suites"][suite]["ar"]["prefill_by_length"]
        assert sum(r["prompts"] for r in rows) == len(ar_recs) == 3
        for r in rows:
            inside = [a for a in ar_recs if r["min_tokens"] <= a["prompt_tokens"]
                      and (r["max_tokens"] is None or a["prompt_tokens"] < r["max_tokens"])]
            assert r["prompts"] == len(inside) and r["prefill_ms"] > 0
            # time outside prefill and decode: what the generation's seconds leave over
            outside = [a["seconds"] - a["prefill_seconds"] - a["decode_seconds"] for a in inside]
            assert r["outside_ms"] == pytest.approx(1e3 * sum(outside) / len(outside)) and r["outside_ms"] > 0
    # every prompt of both shards is recorded; the measuring run's date, model, shard, switches and tiling stay
    assert data["complete"] is True
    kept = ("date", "model", "shard", "env", "verify_tiling")
    assert {k: data[k] for k in kept} == {k: measured[k] for k in kept}
    assert "SPECLA_SUMMARY_ONLY_HOST" not in data["env"]
    assert data["device"] == "cpu" and data["dtype"] == "float32" and (tmp_path / "e2e.png").stat().st_size > 0
    for suite in ("gsm8k", "humaneval"):
        assert data["suites"][suite]["ar"]["prompts"] == 3
        for route in ("ar", "chain", "ngram"):  # the keys the drafter issue asks for, every row
            assert {"speedup", "mean_accepted_length", "first_token_match", "exact_match_rate",
                    "prompts"} <= set(data["suites"][suite][route])
        for route in ("chain", "ngram", "ar+exact", "chain+exact"):
            s = res["suites"][suite][route]
            assert s["prompts"] == 3 and s["exact_match_rate"] == 1.0 and s["mean_accepted_length"] >= 1
            assert s["timed_captures"] == 0  # no CUDA graphs on CPU
            assert s["exact_reference"] == ("ar+exact" if route == "chain+exact" else "ar")
            lo, hi = s["speedup_ci95"]
            assert lo <= s["speedup"] <= hi
            lo, hi = s["decode_speedup_ci95"]  # the same, prefill excluded
            assert lo <= s["decode_speedup"] <= hi
            ids = {p.id for p in load_suite(suite, limit=3)}
            recs = _record_lines(tmp_path)
            dec = {r: sum(x["decode_seconds"] for x in recs if x["suite"] == suite and x["route"] == r
                                   and x["id"] in ids) for r in ("ar", route)}
            assert s["decode_speedup"] == pytest.approx(dec["ar"] / dec[route])
            pre = [x["prefill_seconds"] for x in recs if x["suite"] == suite and x["route"] == route and x["id"] in ids]
            assert s["prefill_ms"] == pytest.approx(1e3 * sum(pre) / 3) and s["ar_prefill_ms"] > 0
    lines = _record_lines(tmp_path)
    assert len(lines) == 2 * 3 * 5  # suites x prompts x routes, each once
    assert {r["id"] for r in lines if r["suite"] == "gsm8k"} == {p.id for p in load_suite("gsm8k", limit=3)}


def test_e2e_tree_depth_is_recorded_and_kept_on_resume(tmp_path):
    """`bench e2e --tree-depth`: each record keeps its route's options, the summary names them,
    and a run does not resume records made with other options (they would mix in one row)."""
    from specla.bench import e2e
    from specla.errors import InputError

    kw = dict(suites=("gsm8k",), routes=("ar", "tree"), limit=1, max_new_tokens=6, device="cpu", dtype="float32",
              out_dir=tmp_path)
    res = e2e.run(**kw, tree_depth=3)
    assert res["route_options"]["tree"]["tree_depth"] == 3 and res["suites"]["gsm8k"]["tree"]["prompts"] == 1
    recs = [json.loads(x) for x in (tmp_path / "e2e.records.jsonl").read_text().splitlines()]
    assert {r["options"]["tree_depth"] for r in recs if r["route"] == "tree"} == {3}
    with pytest.raises(InputError, match="--name"):
        e2e.run(**kw)  # the default depth, 8
    assert e2e.run(**kw, summary_only=True)["route_options"]["tree"]["tree_depth"] == 3
    # an adaptive depth (a tuple, a list once in JSON) resumes its own records
    kw["out_dir"] = tmp_path / "adaptive"
    assert e2e.run(**kw, tree_depth=(2, 4))["route_options"]["tree"]["tree_depth"] == [2, 4]
    assert e2e.run(**kw, tree_depth=(2, 4))["suites"]["gsm8k"]["tree"]["prompts"] == 1


def test_e2e_on_a_file_of_prompts(tmp_path):
    """`bench e2e --suites my.txt`: a user's prompt file is a suite (rows keyed by its path),
    and a bad one is refused with its line before anything loads."""
    import subprocess
    import sys

    prompts = tmp_path / "mine.txt"
    prompts.write_text("Write a haiku about recurrence.\nWhat is 12 times 7?\n")
    cmd = [sys.executable, "-m", "specla.cli", "bench", "e2e", "--routes", "ar,chain", "--max-new-tokens", "6",
           "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "out")]
    r = subprocess.run(cmd + ["--suites", str(prompts)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "out" / "e2e.json").read_text())
    row = data["suites"][str(prompts)]["chain"]
    assert row["prompts"] == 2 and row["exact_match_rate"] == 1.0 and (tmp_path / "out" / "e2e.png").stat().st_size > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    r = subprocess.run(cmd + ["--suites", str(bad)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr


def test_ready_bench_summary_has_paired_intervals(tmp_path):
    """Quick ReaDy bench on CPU (random drafters), then the summary recomputed from its log:
    every row carries 95% intervals and the paired ReaDy / DSpark ratios bracket their value."""
    from specla.bench import ready

    ready.run(device="cpu", quick=True, suites=("gsm8k",), operator=False, out_dir=tmp_path, name="r")
    res = ready.resummarise(tmp_path, "r")
    suite = res["suites"]["gsm8k"]
    assert res["resummarised"] and res["device"] == json.loads((tmp_path / "r.json").read_text())["device"]
    for row in ("dspark", "dspark_ft", "ready"):
        lo, hi = suite[row]["tps_ci95"]
        assert lo <= suite[row]["tps"] <= hi
    c = suite["paired"]["ready/dspark"]
    assert c["prompts"] == 1 and c["tau_ratio_ci95"][0] <= c["tau_ratio"] <= c["tau_ratio_ci95"][1]
    assert res["pooled"]["ready/dspark"]["tau_ratio"] == c["tau_ratio"]  # one suite: pooled = the suite
    assert (tmp_path / "r.png").stat().st_size > 0


def test_ready_paired_survival_difference():
    """The paired survival difference a − b per position pools each row's fully observable
    blocks over the prompts (as `survival` does), and its interval resamples prompts."""
    from specla.bench import ready

    P = ready.P
    full = lambda acc: (P, acc, acc + 1)  # noqa: E731  (drafted, accepted, emitted)
    cut = (3, 3, 3)  # not fully observable: ignored
    a = {0: {"rounds": [full(7), full(2), cut], "tokens": [0] * 12, "seconds": 1.0},
         1: {"rounds": [full(0)], "tokens": [0] * 1, "seconds": 1.0}}
    b = {0: {"rounds": [full(1), full(1)], "tokens": [0] * 4, "seconds": 1.0},
         1: {"rounds": [full(3), full(0)], "tokens": [0] * 5, "seconds": 1.0}}
    c = ready._paired(a, b)
    sa = ready._summary(a, a)["survival"]
    sb = ready._summary(b, b)["survival"]
    assert sa[:3] == [2 / 3, 2 / 3, 1 / 3] and sb[:2] == [3 / 4, 1 / 4]
    assert all(abs(d - (x - y)) < 1e-12 for d, x, y in zip(c["survival_diff"], sa, sb))
    assert all(lo <= d <= hi for d, (lo, hi) in zip(c["survival_diff"], c["survival_diff_ci95"]))

    # pooled over suites: the same prompts split across two suites give the same comparison,
    # and equal prompt ids in different suites stay different prompts
    done = {"s1": {"ready": {0: a[0]}, "dspark": {0: b[0]}}, "s2": {"ready": {0: a[1]}, "dspark": {0: b[1]}}}
    pooled = ready.pooled(done, ["s1", "s2"], ["dspark", "ready"])["ready/dspark"]
    assert pooled["prompts"] == 2 and pooled["survival_diff"] == c["survival_diff"]
    assert pooled["tau_ratio"] == c["tau_ratio"]
    # and each row's whole-evaluation curve is the difference's two terms
    done["s1"]["ar"], done["s2"]["ar"] = {0: a[0]}, {0: a[1]}
    rows = ready.all_suites(done, ["s1", "s2"], ["dspark", "ready"])
    assert rows["ready"]["survival"] == sa and rows["dspark"]["survival"] == sb
    assert rows["ready"]["prompts"] == 2 and rows["ready"]["speedup"] == 1.0


def test_rounds_timer_counts_nested_calls_once(monkeypatch):
    """`bench rounds` times `round` and `ar_round`; an exact-mode AR step runs as a round inside
    `ar_round`, and must be recorded once, as an AR step."""
    from specla.bench import rounds

    class Event:  # CUDA events stand-in: CPU tests have no device
        def __init__(self, **_):
            pass

        def record(self):
            pass

    monkeypatch.setattr(rounds.torch.cuda, "Event", Event)

    class Target:
        def round(self):
            return "r"

        def ar_round(self):
            return self.round()

    t, timer = Target(), rounds._Timer()
    for name in ("round", "ar_round"):
        timer.wrap(t, name)
    assert t.ar_round() == "r" and t.round() == "r"
    assert [c[0] for c in timer.calls] == ["ar_round", "round"]
    timer.unwrap()
    assert "round" not in vars(t)


def test_controlled_rounds_accept_the_forced_count():
    """A controlled round runs the real target round but accepts exactly the forced count: the
    report emits a + 1 tokens and the target's and drafter's caches advance by a + 1."""
    import torch

    from specla.shapes import random_model

    model = random_model("tiny", device="cpu", dtype=torch.float32, seed=0)
    rt = controlled.ChainRuntime(model, controlled.random_drafter(model), 5, list(range(3, 19)), 256, 64, False)
    for a in (0, 3, 5, 2):
        n0, d0 = int(rt.target.cache.length), int(rt.drafter.len)
        count, length = rt.round(a).tolist()[0][:2]
        assert (count, length) == (a + 1, a + 1)
        assert int(rt.target.cache.length) - n0 == a + 1 and int(rt.drafter.len) - d0 == a + 1
    rt.rewind()
    assert int(rt.target.cache.length) == 15


def test_warm_set_covers_every_power_of_two_context():
    """The longest and the shortest prompt of every power-of-two context size, longest first, and
    a prompt for every prefill chunk graph those leave uncaptured."""
    from specla.bench.common import warm_set

    items = [(n, f"p{n}") for n in (3, 50, 60, 100, 120, 400, 10)]
    # contexts with 8 new tokens: 11, 58, 68, 108, 128, 408, 18 -> sizes 16, 64, 128, 128, 128, 512, 32
    assert warm_set(items, 8) == ["p400", "p120", "p60", "p50", "p10", "p3"]
    assert warm_set([], 8) == []
    # one context size (256) holds a 3-token chain, a 120-token sequence (128 wide) and a
    # 50-token one (64 wide): the latter's prefill graph needs an item of its own
    assert warm_set([(3, "p3"), (50, "p50"), (120, "p120")], 128) == ["p120", "p50", "p3"]
    # a prompt prefills all but its last token: the 129-token prompt's chunk is 128 wide, so the
    # 135-token one (134 tokens, 256 wide) needs its own item (e2e_4cce904's HumanEval/0)
    assert warm_set([(129, "p129"), (135, "p135"), (380, "p380")], 128) == ["p380", "p135", "p129"]
    # the EAGLE drafter's prompt extend takes the same chunks, with a graph of its own for a
    # prompt's first chunk: the 519-token prompt's 64-wide remainder is not a first chunk, so the
    # 50-token prompt (one 64-wide chunk) needs its own item though the target's graph is warm
    items = [(520, "p520"), (640, "p640"), (3, "p3"), (120, "p120"), (50, "p50")]
    assert warm_set(items, 128) == ["p640", "p520", "p120", "p50", "p3"]


def test_prefill_spans_leave_the_root():
    from specla.decode import prefill_spans

    assert prefill_spans(1) == []
    assert prefill_spans(129) == [(0, 128)]
    assert prefill_spans(5000, 2048) == [(0, 2048), (2048, 4096), (4096, 4999)]


def test_gemv_quick_cpu(tmp_path):
    from specla.bench import gemv
    from specla.shapes import shape_config

    res = gemv.run(shape="tiny", device="cpu", quick=True, out_dir=tmp_path)
    data = json.loads((tmp_path / "gemv.json").read_text())
    assert data["rows"] == res["rows"]
    mats = gemv.matmuls(shape_config("tiny"))
    assert {r["matmul"] for r in res["rows"]} == set(mats)
    assert all(r["us"] > 0 and (r["N"], r["K"]) == mats[r["matmul"]] for r in res["rows"])
    assert all(r["max_rel_diff"] < 1e-5 for r in res["rows"])  # fp32 on CPU: the same product
    assert {"linear", "mm_kn", "split", "triton_4_512_w4"} <= {r["variant"] for r in res["rows"] if r["M"] == 1}
    assert {"linear", "skinny_32_32_128_w4", "skinny_32_64_128_w8"} == {r["variant"] for r in res["rows"]
                                                                          if r["M"] == 17}
    assert {r["variant"].startswith(("triton", "skinny")) for r in res["rows"] if r["tiling"]} == {True}
    # one choice per weight shape and kind (tiny's gate_up and LM head share one), among cuBLAS
    # as the model calls it and the kernels
    assert sorted((b["kind"], b["N"], b["K"]) for b in data["best"]) == sorted(
        {(k, *nk) for nk in mats.values() for k in ("gemv", "skinny")})
    for b in data["best"]:
        won = [r for r in res["rows"] if (r["N"], r["K"]) == (b["N"], b["K"]) and (r["M"] == 1) == (b["kind"] == "gemv")
               and (r["variant"] == "linear" or r["tiling"])]
        assert b["us"] == min(r["us"] for r in won)


def test_decode_fused_vs_plain_compares_the_two_paths():
    """bench decode's GPU check of the fused path's kernels, run here on the references (fp32:
    the same function, so the logits agree to rounding and every argmax matches)."""
    from specla import ops
    from specla.bench.decode import _fused_vs_plain
    from specla.bench.trees import beam_tree
    from specla.fused import fuse
    from specla.shapes import random_model

    model = fuse(random_model("tiny", device="cpu", dtype=torch.float32), compile=False)
    fused = model._fused
    with ops.backend("triton"):  # the fused path's Triton kernels, under the interpreter
        res = _fused_vs_plain(model, list(range(3, 12)), beam_tree(2, 3, 5))
    assert model._fused is fused
    assert set(res) == {"prefill", "ar_step", "verify16"}
    for r in res.values():
        assert r["max_rel_diff"] < 1e-4 and r["argmax_agree"] == 1.0
    from specla.bench.decode import _check_lines

    (line,) = _check_lines([{"shape": "tiny", "gemv": "cublas", "fused_vs_plain_fp32": res}])
    assert line.startswith("tiny (cublas) fused_vs_plain_fp32: prefill max rel diff") and "argmax agree 100%" in line


def test_e2e_pairs_trees_with_chains_by_prompt():
    """Tree over chain: chain's summed latency over tree's on the prompts both finished, with an
    interval from resampling prompts as pairs (a shared per-prompt cost cancels out of it)."""
    from specla.bench import e2e

    def rec(seconds, decode):
        return {"seconds": seconds, "decode_seconds": decode}

    # prompt lengths differ a lot (shared cost), the tree is 10% faster on every prompt
    chain = {str(i): rec(1.0 + 3 * i, 0.5 + i) for i in range(12)}
    tree = {i: rec(r["seconds"] / 1.1, r["decode_seconds"] / 1.1) for i, r in chain.items()}
    tree["extra"] = rec(100.0, 50.0)  # only the tree finished it: not compared
    out = e2e.paired({"tree": tree, "chain": chain}, "tree", "chain")
    assert out["prompts"] == 12 and out["base"] == "chain"
    assert out["speedup"] == pytest.approx(1.1) and out["decode_speedup"] == pytest.approx(1.1)
    for key in ("speedup_ci95", "decode_speedup_ci95"):
        lo, hi = out[key]
        assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)  # paired: no spread at all
    assert e2e.paired({"tree": tree, "chain": {}}, "tree", "chain") is None


def test_e2e_summary_counts_generations_that_captured_inside_their_timing():
    from specla.bench import e2e

    def rec(captures, tokens=(1, 2, 3)):
        return {"seconds": 1.0, "decode_seconds": 0.5, "prefill_seconds": 0.5, "mean_accepted_length": 2.0, "first_token_match": 1.0,
                "tokens": list(tokens), "captures": captures}

    records = {"ar": {"a": rec(0), "b": rec(2), "c": rec(0)}, "chain": {"a": rec(1), "b": rec(0), "c": rec(0)}}
    assert e2e._summarise(records, "chain")["timed_captures"] == 2  # chain's prompt a, AR's prompt b
    records = {r: {i: rec(0) for i in "abc"} for r in ("ar", "chain")}
    assert e2e._summarise(records, "chain")["timed_captures"] == 0


def test_e2e_times_again_a_generation_that_captured_a_graph():
    """A capture inside a timing (a graph the warm-up missed) is not kept: the generation runs
    again, its graphs now there, and that second timing is recorded, marked as retimed."""
    from specla import graphs
    from specla.bench import e2e

    class FakeLM:
        def __init__(self, captures_first):
            self.calls, self.captures_first = [], captures_first

        def generate(self, prompt, max_new_tokens, **options):
            self.calls.append((prompt, max_new_tokens, options))
            if len(self.calls) == 1:
                graphs._captured += self.captures_first
            return f"generation {len(self.calls)}"

    cpu = torch.device("cpu")
    lm = FakeLM(captures_first=2)
    g, seconds, captures, retimed = e2e._timed_generation(lm, cpu, "p", 7, {"route": "tree"})
    assert (g, captures, retimed) == ("generation 2", 0, True) and seconds >= 0
    assert lm.calls == [("p", 7, {"route": "tree"})] * 2
    lm = FakeLM(captures_first=0)
    g, _, captures, retimed = e2e._timed_generation(lm, cpu, "p", 7, {})
    assert (g, captures, retimed) == ("generation 1", 0, False) and len(lm.calls) == 1
    rec = {"seconds": 1.0, "decode_seconds": 0.5, "prefill_seconds": 0.5, "mean_accepted_length": 2.0,
           "first_token_match": 1.0, "tokens": [1], "captures": 0}
    records = {"ar": {"a": rec}, "chain": {"a": {**rec, "retimed": True}}}
    assert e2e._summarise(records, "chain")["retimed"] == 1


def test_git_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    """Results name the code they ran: HEAD, "-dirty" when tracked files were changed."""
    import shutil
    import subprocess

    from specla.bench.common import git_commit

    if shutil.which("git") is None:
        pytest.skip("no git")
    monkeypatch.delenv("SPECLA_COMMIT", raising=False)
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "f").write_text("a")
    run("add", "f")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "g").write_text("untracked files do not count")
    assert git_commit(tmp_path) == head
    (tmp_path / "f").write_text("b")
    assert git_commit(tmp_path) == head + "-dirty"
    monkeypatch.setenv("SPECLA_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"


def test_graph_timeline_summarises_busy_time_and_gaps():
    """graph_timeline.py's per-step sums: launches, kernel time, and idle time before each
    kernel but the step's first (overlapping kernels leave no gap), averaged over steps."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/diagnostics/graph_timeline.py"
    spec = importlib.util.spec_from_file_location("graph_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.kind("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT") == "gemm"
    assert mod.kind("_products_kernel") == "verify"
    assert mod.kind("_tree_prelude_kernel") == "prelude"
    assert mod.kind("triton_red_fused_add_mean_0") == "inductor"
    assert mod.kind("Memcpy DtoH (Device -> Pageable)") == "torch_other"
    # (name, start µs, duration µs): step 1 has a 2 µs gap, then an overlapping kernel; step 2 none
    steps = [[("a", 0.0, 5.0), ("_solve_kernel", 7.0, 3.0), ("a", 8.0, 4.0)],
             [("a", 100.0, 5.0), ("_solve_kernel", 105.0, 5.0)]]
    r = mod.summarise(steps)
    assert r["steps"] == 2 and r["launches"] == 2.5
    assert math.isclose(r["busy_us"], (12.0 + 10.0) / 2) and math.isclose(r["gap_us"], 2.0 / 2)
    by = {k["name"]: k for k in r["kernels"]}
    assert by["a"]["launches"] == 1.5 and math.isclose(by["a"]["busy_us"], 7.0)
    assert math.isclose(by["_solve_kernel"]["gap_us"], 1.0) and by["_solve_kernel"]["class"] == "verify"
    assert math.isclose(r["classes"]["verify"]["busy_us"], 4.0)
    assert r["span_us_median"] == 12.0  # the larger of the two spans (12 and 10): sorted()[n // 2]


def test_verify_parts_edits_still_match_the_kernel():
    """The diagnostic's variants are textual edits of parallel.py: each must still apply."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/diagnostics/verify_parts.py"
    spec = importlib.util.spec_from_file_location("verify_parts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = mod.PARALLEL_SRC.read_text()
    for name, edits in mod.PARALLEL_EDITS.items():
        assert all(src.count(old) == 1 and old != new for old, new in edits), name


def test_cost_fit_recovers_the_model_that_made_the_times():
    """Table 1 rows timed exactly as the cost model predicts give back its constants."""
    import statistics

    from specla.bench import kernels
    from specla.bench.trees import beam_tree
    from specla.ops.gdn import schedule

    truth = {"node": 0.5, "restore": 0.9, "hybrid_fixed": 5.0, "hybrid_node": 0.4}
    layers, rows = 24, []
    for topk, depth, nodes in kernels.TABLE1_SHAPES:
        costs = [schedule._costs(p, schedule.ancestor_closure(p), *schedule._heads(p, schedule.ancestor_closure(p)),
                                 truth) for p in (torch.tensor([beam_tree(topk, depth, nodes, seed=s)]) for s in (0, 1))]
        rows.append({"topk": topk, "depth": depth, "nodes": nodes, "trees": 2,
                     "serial_ms": statistics.mean(float(c[0]) for c in costs) * layers / 1e3,
                     "hybrid_ms": statistics.mean(float(c[1]) for c in costs) * layers / 1e3})
    fit = kernels.cost_fit(rows, layers)
    for key, want in truth.items():
        assert fit[key] == pytest.approx(want, rel=1e-5), key
    assert fit["rms_us"]["serial"] < 1e-5 and fit["current"] == schedule.SERIAL_COST
    # the true model sends each tree where its own cost is lower; a row's times are its trees'
    # mean, so a tree whose preference differs from its row's counts as a miss
    agree = sum(bool(schedule.prefer_serial(torch.tensor([beam_tree(r["topk"], r["depth"], r["nodes"], seed=s)]), truth))
                == (r["serial_ms"] <= r["hybrid_ms"]) for r in rows for s in (0, 1))
    assert fit["choices"]["fitted"] == agree and fit["choices"]["trees"] == 12


def test_bench_kernels_runs_every_section_on_cpu(tmp_path):
    """`bench kernels --device cpu --quick`: every section runs under the interpreter (timings
    meaningless) and the JSON holds the issue's keys, the cost fit among them."""
    from specla import topology
    from specla.bench import kernels
    from specla.ops.gdn import schedule

    res = kernels.run(str(tmp_path), device="cpu", quick=True)
    for key in ("table1", "cost_fit", "commit", "fused", "chain", "correctness"):
        assert "error" not in res[key] if isinstance(res[key], dict) else res[key], key
    assert {"topk", "depth", "nodes", "r2l_ms", "serial_ms", "parallel_ms", "hybrid_ms", "paths_ms"} <= set(res["table1"][0])
    quick_tree = torch.tensor([kernels.beam_tree(4, 4, 8, seed=0)])  # the quick run's one tree
    assert res["table1"][0]["serial_restores"] == float(schedule.serial_restores(quick_tree)[0])
    chains = topology.heavy_light_chains(quick_tree[0])
    assert res["table1"][0]["hybrid_chains"] == len(chains)
    # the longest wait in visits: a chain starts once its first node's parent is visited
    done, pb = {}, quick_tree[0].tolist()
    for ch in chains:
        t = done[pb[ch[0]]] if ch[0] else 0
        for i, x in enumerate(ch):
            done[x] = t + i + 1
    assert res["table1"][0]["hybrid_path_visits"] == max(done.values())
    # every verifier the bench times also equals the reference at the bench's shape
    assert {"verify_serial", "verify_hybrid", "verify_parallel", "verify_paths_bv16_w4"} <= set(res["correctness"])
    assert all(e["rel"] < 1e-5 for e in res["correctness"]["verify_paths_bv16_w4"].values())
    assert {"length", "replay_ms", "factor_ms"} <= set(res["commit"][0])
    assert {"accepted", "separate_ms", "fused_ms", "verify_only_ms"} <= set(res["fused"][0])
    assert {"T", "ms", "floor_ms"} <= set(res["chain"][0])
    assert set(res["cost_fit"]["current"]) == {"node", "restore", "hybrid_fixed", "hybrid_node"}
    assert json.loads((tmp_path / "kernels_cpu_smoke.json").read_text())["goals"] == res["goals"]


def test_prefill_crossover_is_where_sequence_stays_faster():
    from specla.bench.prefill import crossover

    def rows(chain, seq):
        return ([{"mode": "chain", "used": "chain", "tokens": t, "ms": ms} for t, ms in chain]
                + [{"mode": "sequence", "used": "sequence", "tokens": t, "ms": ms} for t, ms in seq])

    lengths = (16, 32, 64, 128)
    assert crossover(rows(zip(lengths, (1, 2, 4, 8)), zip(lengths, (3, 3, 3, 3)))) == 64
    # faster at 16 but not at 32: only from 64 on does it stay faster
    assert crossover(rows(zip(lengths, (4, 2, 4, 8)), zip(lengths, (3, 3, 3, 3)))) == 64
    assert crossover(rows(zip(lengths, (1, 1, 1, 1)), zip(lengths, (3, 3, 3, 3)))) is None
    r = rows(zip(lengths, (1, 2, 4, 8)), zip(lengths, (3, 3, 3, 3)))
    r[-1]["used"] = "plain"  # a sequence that ran plain does not count
    assert crossover(r) == 64 and crossover(r[:4] + r[4:7]) == 64


def test_bench_prefill_on_emulated_graphs(tmp_path, monkeypatch):
    """`bench prefill` on CPU with emulated graphs and small chunk widths: every mode at every
    length runs as asked (the demo target has no MoE layer) and the JSON, table and PNG come out;
    the CLI refuses a non-CUDA device in one line."""
    import subprocess
    import sys

    from specla import engine
    from specla.bench import prefill

    from graph_emulation import emulate_graphs

    emulate_graphs(monkeypatch)
    monkeypatch.setattr(engine, "SEQUENCE_WIDTHS", (4, 8))
    monkeypatch.setattr(engine, "PREFILL_WIDTH", 4)
    monkeypatch.setattr(engine, "SEQUENCE_FROM", 8)
    res = prefill.run(lengths=(3, 9, 20), reps=1, device="cpu", dtype="float32", out_dir=tmp_path)
    data = json.loads((tmp_path / "prefill.json").read_text())
    assert data["rows"] == res["rows"] and len(data["rows"]) == 9 and data["device"] and data["commit"]
    assert all(r["used"] == r["mode"] and r["ms"] > 0 for r in data["rows"])
    assert data["switch_tokens"] == 8 and data["sequence_widths"] == [4, 8] and data["chain_width"] == 4
    assert (tmp_path / "prefill.png").stat().st_size > 0
    r = subprocess.run([sys.executable, "-m", "specla.cli", "bench", "prefill", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--device cuda" in r.stderr and "Traceback" not in r.stderr


def test_path_verify_diagnostic_tree_is_what_it_says():
    """path_verify.py's tree: 17 nodes, 8 leaves, its longest path the 9-node chain's length."""
    import importlib.util
    from pathlib import Path

    from specla.ops.gdn import schedule

    path = Path(__file__).resolve().parents[1] / "benchmarks/diagnostics/path_verify.py"
    spec = importlib.util.spec_from_file_location("path_verify", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert all(p < j for j, p in enumerate(mod.TREE)) and len(mod.TREE) == 17
    _, length, leaves = schedule.path_tables(torch.tensor([mod.TREE]))
    assert int(leaves[0]) == 8 and int(length.max()) == len(mod.CHAIN9) == 9


def test_tree_policy_replay_is_the_decode_loop():
    """tree_policy.py's premise: replaying the route's own selection over teacher-forced rollouts
    gives the tree route's rounds exactly (demo pair, fp32, CPU; depth 8 and 12 from one pool)."""
    import importlib.util
    from pathlib import Path

    import specla.api as api
    from specla.drafters import tree
    from specla.drafters.eagle import EagleDrafter, find_drafter, load_drafter

    path = Path(__file__).resolve().parents[1] / "benchmarks/diagnostics/tree_policy.py"
    spec = importlib.util.spec_from_file_location("tree_policy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lm = api.load(device="cpu", dtype="float32")
    drafter = EagleDrafter(load_drafter(find_drafter(lm.model_dir), lm.model), lm.model, topk=4,
                           depth=12, width=4, temperature=mod.T_ROLL)
    prompt = "Natalia sold clips to 48 of her friends in April. How many did she sell in May?"
    pools = mod.pools_of(lm, drafter, lm.encode_prompt(prompt), 40)
    depth = tree.pool_depths(pools[0][0].shape[0], 4, 4, "cpu")[0]
    for d in (8, 12):
        g = lm.generate(prompt, route="tree", tree_depth=d, max_new_tokens=40)
        tokens, rounds = mod.replay(pools, lambda pool: mod.by_score(pool[2], pool[1], depth, 16, d))
        assert (tokens, rounds) == (len(g.tokens), g.rounds) and rounds < tokens


def test_tree_shapes_reads_shapes_from_names():
    """tree_shapes.py's shape names say their options; the demo pair decodes with each, and an
    unknown name stops the run before anything loads."""
    import importlib.util
    from pathlib import Path

    import specla.api as api

    path = Path(__file__).resolve().parents[1] / "benchmarks/diagnostics/tree_shapes.py"
    spec = importlib.util.spec_from_file_location("tree_shapes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.shape_options("chain10") == dict(route="chain", chain_length=10)
    assert mod.shape_options("tree-k8-w2-d12-n15-t0.7") == dict(route="tree", tree_topk=8, tree_depth=12,
                                                                tree_budget=15, tree_width=2, tree_temperature=0.7)
    assert mod.shape_options("tree-k4-d6to10-n16") == dict(route="tree", tree_topk=4, tree_depth=(6, 10),
                                                           tree_budget=16)
    with pytest.raises(SystemExit, match="unknown shape 'tree-k4-d8'"):
        mod.shape_options("tree-k4-d8")
    lm = api.load(device="cpu", dtype="float32")
    ar = lm.generate("Two plus two is", route="ar", max_new_tokens=12).tokens
    for name in [*mod.DEFAULT.split(","), "tree-k4-d2to5-n16"]:
        assert lm.generate("Two plus two is", max_new_tokens=12, **mod.shape_options(name)).tokens == ar, name


def test_pdl_check_drafts_follow_the_greedy_tokens(tmp_path):
    """pdl_check's rounds accept the AR continuation they are fed (so its GPU run compares
    rounds with multi-factor pending updates), and on the CPU both settings agree."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/diagnostics/pdl_check.py"
    spec = importlib.util.spec_from_file_location("pdl_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.first_child_path([-1, 0, 1, 1, 0, 2, 2]) == [0, 1, 2, 5]
    out = tmp_path / "pdl.json"
    assert mod.main(["--device", "cpu", "--shape", "tiny", "--steps", "30", "--rounds", "3", "--out", str(out)]) == 0
    rows = {r["route"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ar"]["tokens_per_call"] == 1
    assert rows["chain12"]["tokens_per_call"] > 2 and rows["tree16"]["tokens_per_call"] > 2


def test_round_runner_keeps_paths_as_the_loop_does():
    """A round bench sizes its target as the decode loop would for a drafter of its topology's
    depth (`Drafter.max_path`): a 16-node depth-4 beam tree's pending buffers hold 5 rows, not 17."""
    from specla.bench.decode import round_runner
    from specla.bench.trees import beam_tree
    from specla.shapes import random_model
    from specla.state import GDNLayerState

    model = random_model("tiny", device="cpu", dtype=torch.float32, seed=0)
    draw, run, target = round_runner(model, list(range(3, 19)), beam_tree(4, 4, 16), 2)
    draw()
    count, length = run()[0][:2]
    assert 1 <= length <= 5 and count == length
    assert target.path_nodes == 5
    pending = [st.pending for st in target.cache.layers if isinstance(st, GDNLayerState)]
    assert pending and all(p is not None and p[0].shape[1] == 5 for p in pending)


def test_results_record_the_switches_they_ran_under(monkeypatch, tmp_path):
    """A result file names the SPECLA_* A/B switches set for its run (not SPECLA_COMMIT, which
    is the commit field's source), so two runs of one commit can be told apart."""
    import json

    from specla.bench.common import write_results

    monkeypatch.setenv("SPECLA_CHUNK_TOKENS", "128")
    monkeypatch.setenv("SPECLA_COMMIT", "abc1234")
    monkeypatch.delenv("SPECLA_PDL", raising=False)
    data = json.loads(write_results("switches", {"x": 1}, tmp_path).read_text())
    assert data["env"].get("SPECLA_CHUNK_TOKENS") == "128"
    assert "SPECLA_COMMIT" not in data["env"] and "SPECLA_PDL" not in data["env"]
