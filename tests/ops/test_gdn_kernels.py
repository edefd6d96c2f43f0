"""Triton GDN kernels equal their torch references (interpreter on CPU, tiny shapes)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .kernel_cases import KINDS, close, inputs, parents_of
from specla import ops, topology
from specla.ops import counters
from specla.bench.trees import beam_tree
from specla.ops.gdn import closure, commit, hybrid, naive, parallel, paths, schedule, serial

HYP = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
VERIFIERS = {"serial": serial.gdn_tree_verify, "hybrid": hybrid.gdn_tree_verify,
             "parallel": parallel.gdn_tree_verify, "paths": paths.gdn_tree_verify}


def pending_of(B, P, H, HV, K, V, seed):
    g = torch.Generator().manual_seed(seed + 1)
    pk = torch.nn.functional.normalize(torch.randn(B, P, H, K, generator=g), dim=-1)
    pg = -torch.rand(B, P, HV, generator=g) * 0.5
    pu = torch.randn(B, P, HV, V, generator=g)
    plen = torch.randint(0, P + 1, (B,), generator=g)
    return pk, pg, pu, plen


shapes = st.fixed_dictionaries({
    "B": st.sampled_from([1, 2]),
    "n": st.integers(1, 11),
    "kinds": st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)),
    "heads": st.sampled_from([(1, 1), (1, 2), (2, 4)]),  # (H, HV): GVA when HV > H
    "K": st.sampled_from([16, 32]),
    "V": st.sampled_from([16, 32]),
    "P": st.sampled_from([0, 1, 3]),  # pending path width (0: none)
    "bf16": st.booleans(),
    "seed": st.integers(0, 2**16),
})


@pytest.mark.parametrize("name", list(VERIFIERS))
@HYP
@given(c=shapes)
def test_verifier_matches_reference(name, c, poison):
    B, n, (H, HV), K, V = c["B"], c["n"], c["heads"], c["K"], c["V"]
    par = torch.tensor([parents_of(c["kinds"][b], n, c["seed"] + b) for b in range(B)])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, c["seed"], torch.bfloat16 if c["bf16"] else torch.float32)
    pend = pending_of(B, c["P"], H, HV, K, V, c["seed"]) if c["P"] else None
    S_ref, S_out = S.clone(), S.clone()
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, K ** -0.5, pend)
    o, u = VERIFIERS[name](q, k, v, g, beta, S_out, par, K ** -0.5, pend)
    close(o, ro, f"{name} o")
    close(u, ru, f"{name} u")
    close(S_out, S_ref, f"{name} state")  # untouched, or advanced by the pending path


@pytest.mark.parametrize("block_v,num_warps", [(8, 1), (16, 2), (32, 4)])
def test_serial_tilings(block_v, num_warps, poison):
    par = torch.tensor([beam_tree(3, 4, 9, seed=1)])
    q, k, v, g, beta, S = inputs(1, 10, 1, 2, 16, 32, 3)
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S.clone(), par, 0.25)
    for fn in (serial.gdn_tree_verify, hybrid.gdn_tree_verify):
        o, u = fn(q, k, v, g, beta, S.clone(), par, 0.25, block_v=block_v, num_warps=num_warps)
        close(o, ro, "o")
        close(u, ru, "u")


def test_serial_chain_mode_and_sequence(poison):
    n = 7
    par = topology.chain(n, batch=2)
    q, k, v, g, beta, S = inputs(2, n, 1, 2, 16, 16, 5)
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S.clone(), par, 0.25)
    o, u = serial.gdn_tree_verify(q, k, v, g, beta, S.clone(), par, 0.25, chain=True)
    close(o, ro, "o")
    close(u, ru, "u")
    S_ref, S_out = S.clone(), S.clone()
    ro = naive.gdn_recurrent(q, k, v, g, beta, S_ref, 0.25)
    o = serial.gdn_chain_sequence(q, k, v, g, beta, S_out, 0.25)
    close(o, ro, "sequence o")
    close(S_out, S_ref, "sequence state")


def test_strided_value_input(poison):
    """v as the model makes it: a split view of a wider projection (token stride != HV*V)."""
    B, n, H, HV, K, V = 1, 6, 1, 2, 16, 16
    q, k, _, g, beta, S = inputs(B, n, H, HV, K, V, 7)
    wide = torch.randn(B, n, 3 * HV * V)
    v = wide[:, :, HV * V: 2 * HV * V].reshape(B, n, HV, V)
    par = torch.tensor([[-1, 0, 1, 0, 3, 3]])
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S.clone(), par, 0.25)
    for name, fn in VERIFIERS.items():
        o, u = fn(q, k, v, g, beta, S.clone(), par, 0.25)
        close(o, ro, name)
        close(u, ru, name)


@HYP
@given(B=st.sampled_from([1, 2]), n=st.integers(1, 9), heads=st.sampled_from([(1, 1), (1, 2), (2, 4)]),
       V=st.sampled_from([16, 32]), P=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_commit_matches_reference(B, n, heads, V, P, seed, poison):
    H, HV = heads
    K = 16
    g0 = torch.Generator().manual_seed(seed)
    _, k, _, g, _, S = inputs(B, n, H, HV, K, V, seed)
    u = torch.randn(B, n, HV, V, generator=g0)
    path = torch.randint(0, n, (B, P), generator=g0)
    # lengths below the path width, including 0
    length = torch.tensor([0, P][:B]) if seed % 3 == 0 else torch.randint(0, P + 1, (B,), generator=g0)
    S_ref, S_out = S.clone(), S.clone()
    naive.gdn_commit(S_ref, k, g, u, path, length)
    commit.gdn_commit(S_out, k, g, u, path, length)
    close(S_out, S_ref, "commit")


def test_fused_equals_commit_then_verify(poison):
    """Delayed update: verify(pending) == commit, then verify from the committed state."""
    B, n, H, HV, K, V = 2, 8, 1, 2, 16, 16
    par = torch.tensor([parents_of("random", n, 1), parents_of("deep", n, 2)])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, 11)
    pk, pg, pu, _ = pending_of(B, 4, H, HV, K, V, 11)
    plen = torch.tensor([4, 0])
    S_sep = S.clone()
    commit.gdn_commit(S_sep, pk, pg, pu, torch.arange(4).expand(B, 4), plen)
    so, su = hybrid.gdn_tree_verify(q, k, v, g, beta, S_sep, par, 0.25)
    for name, fn in VERIFIERS.items():
        S_fused = S.clone()
        fo, fu = fn(q, k, v, g, beta, S_fused, par, 0.25, (pk, pg, pu, plen))
        close(fo, so, name)
        close(fu, su, name)
        close(S_fused, S_sep, name)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16))
def test_hybrid_schedule_covers_each_node_once_in_dependency_order(n, kind, seed):
    p = parents_of(kind, n, seed)
    par = torch.tensor([p, parents_of("random", n, seed + 1)])
    sched = schedule.hld_schedule(par)
    for b in range(2):
        pb = par[b].tolist()
        kids = topology.children(par[b])
        chains = [sched.nodes[b, c, :L].tolist() for c, L in enumerate(sched.length[b].tolist()) if L > 0]
        assert sum(sched.length[b].tolist()) == n
        assert sorted(x for ch in chains for x in ch) == list(range(n))  # every node exactly once
        owner = {x: c for c, ch in enumerate(chains) for x in ch}
        for c, ch in enumerate(chains):
            # a chain's inner nodes form a path; each leaf follows its parent or a leaf sibling,
            # so the tile resident before every node but the first is its parent's
            resident = None
            for i, x in enumerate(ch):
                if i:
                    assert pb[x] == resident
                    assert kids[x] or sched.light[b, x] == schedule.LEAF
                resident = x if kids[x] or x == 0 else pb[x]
            head_parent = pb[ch[0]]
            if c == 0:
                assert ch[0] == 0
            else:  # an inner node whose boundary state comes from an earlier chain, which marks it
                assert kids[ch[0]] and head_parent >= 0 and owner[head_parent] < c
                assert sched.light[b, head_parent] == schedule.STORE
        boundaries = {pb[ch[0]] for ch in chains[1:]}
        assert sched.light[b].tolist() == [schedule.STORE if i in boundaries else
                                           schedule.LEAF if i and not kids[i] else 0 for i in range(n)]
        assert chains == sorted(topology.heavy_light_chains(par[b]))
        # heavy-light over the inner nodes: a path from the root crosses O(log n) chains
        for x in range(n):
            hops, y = 0, x
            while y > 0:
                hops += owner[pb[y]] != owner[y]
                y = pb[y]
            assert hops <= max(1, n).bit_length()


@settings(max_examples=20, deadline=None, derandomize=True)
@given(n=st.integers(1, 30), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16))
def test_ancestor_closure(n, kind, seed):
    par = torch.tensor([parents_of(kind, n, seed)])
    W = n + 3
    m = schedule.ancestor_closure(par, W)
    assert torch.equal(m[:, :n, :n] > 0, topology.ancestor_mask(par))
    assert not m[:, n:].any() and not m[:, :, n:].any()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), pad=st.integers(0, 24), kinds=st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)),
       seed=st.integers(0, 2**16))
def test_closure_kernel_matches_reference(n, pad, kinds, seed):
    """The Triton closure equals the matmul reference bit for bit, padding included (deep
    chains need every squaring step; widths past 32 take the largest tile)."""
    W = min(64, n + pad)
    par = torch.tensor([parents_of(kinds[0], n, seed), parents_of(kinds[1], n, seed + 1)])
    assert torch.equal(closure.ancestor_closure(par, W), schedule.ancestor_closure(par, W))
    assert torch.equal(closure.ancestor_closure(par.int()), schedule.ancestor_closure(par))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), kinds=st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)),
       seed=st.integers(0, 2**16), cut=st.tuples(st.integers(1, 40), st.integers(1, 40)), padded=st.booleans())
def test_path_tables(n, kinds, seed, cut, padded):
    """Row j of a row's tables is its j-th real leaf's root-to-leaf path (checked against the
    parents, walked on the host), rows past the leaves have length 0; the Triton kernel lists the
    same paths."""
    par = torch.tensor([parents_of(kinds[0], n, seed), parents_of(kinds[1], n, seed + 1)])
    valid = torch.tensor([min(cut[0], n), min(cut[1], n)]) if padded else None
    for impl in (schedule.path_tables, closure.path_tables):
        table, length, leaves = impl(par, valid)
        for b in range(2):
            real = n if valid is None else int(valid[b])
            pb = par[b].tolist()[:real]
            kids = {p for p in pb if p >= 0}
            want_leaves = [c for c in range(real) if c not in kids]
            assert int(leaves[b]) == len(want_leaves)
            assert length[b, len(want_leaves):].tolist() == [0] * (n - len(want_leaves))
            for j, c in enumerate(want_leaves):
                path = [c]
                while pb[path[-1]] >= 0:
                    path.append(pb[path[-1]])
                assert table[b, j, :int(length[b, j])].tolist() == path[::-1]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16), real=st.integers(1, 40))
def test_serial_walk(n, kind, seed, real):
    """The serial pass's walk: a depth-first preorder (every subtree a contiguous run starting
    at its root) taking each node's leaves before its other children; each visited node's
    parent beside it; leaves marked (verified in place), and the nodes marked STORE exactly
    those the walk comes back to, (children with children - 1) times a node; `boundary` the
    nodes a walk advancing at every node comes back to; `pad_draft`'s padding (a chain under
    the last real node) visited after every real node."""
    real = min(real, n)
    padded = parents_of(kind, real, seed) + list(range(real - 1, n - 1))
    par = torch.tensor([parents_of(kind, n, seed), parents_of("random", n, seed + 1), padded])
    walk = schedule.serial_order(par)
    for b in range(3):
        pb, ob = par[b].tolist(), walk.order[b].tolist()
        assert sorted(ob) == list(range(n)) and ob[0] == 0
        pos = {node: t for t, node in enumerate(ob)}
        assert walk.parent[b].tolist() == [pb[i] for i in ob]
        kids = {i: [j for j in range(n) if pb[j] == i] for i in range(n)}

        def subtree(i):
            return [i] + [d for c in kids[i] for d in subtree(c)]

        for i in range(n):
            assert sorted(pos[d] for d in subtree(i)) == list(range(pos[i], pos[i] + len(subtree(i))))
            leaves = [pos[c] for c in kids[i] if not kids[c]]
            inner = [pos[c] for c in kids[i] if kids[c]]
            assert not leaves or not inner or max(leaves) < min(inner)
        resident, restored = None, []
        for t, node in enumerate(ob):
            if t and pb[node] != resident:
                restored.append(pb[node])
            resident = node if kids[node] else pb[node]
        assert len(restored) == sum(max(0, sum(1 for c in kids[i] if kids[c]) - 1) for i in range(n))
        assert float(schedule.serial_restores(par[b:b + 1])[0]) == len(restored)  # the cost model's count
        assert walk.kind[b].tolist() == [schedule.LEAF if not kids[i] else schedule.STORE * (i in restored)
                                         for i in range(n)]
    assert sorted(walk.order[2, real:].tolist()) == list(range(real, n))


def test_plan_cache_follows_in_place_writes():
    par = torch.tensor([[-1, 0, 1, 2]])
    plan = schedule.plan_for(par)
    assert plan.is_chain(par) and schedule.plan_for(par) is plan
    par[0, 3] = 1
    assert schedule.plan_for(par) is not plan and schedule.plan_for(par).is_chain(par) is False


def test_dispatch_picks_the_verifier(monkeypatch):
    """Chains: serial chain mode. Trees: the path-parallel verifier while its programs fit
    (PATHS_MAX_PROGRAMS), else the parallel verifier, except in exact mode, where the cost
    model (eagerly) or the size (inside a capture) picks serial or hybrid."""
    calls = []
    for mod, name in ((serial, "serial"), (hybrid, "hybrid"), (parallel, "parallel"), (paths, "paths")):
        real = mod.gdn_tree_verify
        monkeypatch.setattr(mod, "gdn_tree_verify",
                            lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    q, k, v, g, beta, S = inputs(1, 5, 1, 2, 16, 16, 2)
    tree = torch.tensor([[-1, 0, 0, 1, 2]])

    def run(par, want, exact=False, chain=False, label=""):
        par = par.clone()  # a fresh plan cache (the cost model's answer is cached on the tensor)
        n = par.shape[1]
        args = (q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n])
        ro, ru = naive.gdn_tree_verify(*args, S.clone(), par, 0.25)
        with ops.backend("triton"), ops.exact_arithmetic(exact):
            o, u = ops.gdn_tree_verify(*args, S.clone(), par, 0.25, chain=chain)
        assert calls[-1] == want, label
        close(o, ro, label or want)
        close(u, ru, label or want)

    cheap_chains = dict(schedule.SERIAL_COST, hybrid_fixed=-1e3)  # the cost model then always picks chains
    run(topology.chain(5), "serial")
    run(torch.tensor([[-1]]), "serial")
    run(tree, "paths")  # 2 value heads x 1 V-tile x 5 nodes: 10 programs
    monkeypatch.setattr(ops, "PATHS_MAX_PROGRAMS", 9)
    run(tree, "parallel")
    run(tree, "serial", exact=True)
    monkeypatch.setattr(schedule, "SERIAL_COST", cheap_chains)
    run(tree, "hybrid", exact=True)
    for setting in ("serial", "hybrid", "parallel", "paths"):
        monkeypatch.setattr(ops, "TREE_VERIFIER", setting)
        run(tree, setting, label=f"forced {setting}")
        run(tree, "hybrid", exact=True, label=f"forced {setting}, exact")  # exact mode wins
    monkeypatch.setattr(ops, "TREE_VERIFIER", "auto")
    # inside a graph capture the plan answers None: exact mode goes by size (small: serial tree
    # mode), and a caller's chain promise reaches the chain kernel
    monkeypatch.setattr(schedule.Plan, "is_chain", lambda self, parents: None)
    monkeypatch.setattr(schedule.Plan, "prefer_serial", lambda self, parents: None)
    for max_nodes, want in ((24, "serial"), (4, "hybrid")):
        monkeypatch.setattr(ops, "CAPTURED_SERIAL_MAX_NODES", max_nodes)
        run(tree, want, exact=True, label=f"captured, exact, max {max_nodes}")
    run(tree, "parallel", label="captured")
    run(topology.chain(5), "serial", chain=True, label="chain promise")
    monkeypatch.setattr(ops, "CAPTURED_SERIAL_MAX_NODES", 24)
    monkeypatch.setattr(ops, "PARALLEL_MAX_NODES", 4)
    run(tree, "serial", label="captured, over the parallel verifier's size")
    # float64 states stay on the torch reference
    calls.clear()
    with ops.backend("triton"):
        ops.gdn_tree_verify(q.double(), k.double(), v.double(), g.double(), beta.double(), S.double(), tree, 0.25)
    assert calls == []


def test_gdn_sequence_short_on_serial_kernel(poison):
    q, k, v, g, beta, S = inputs(2, 9, 1, 2, 16, 16, 4)
    S_ref, S_out = S.clone(), S.clone()
    ro = naive.gdn_recurrent(q, k, v, g, beta, S_ref, 0.25)
    with ops.backend("triton"):
        o = ops.gdn_sequence(q, k, v, g, beta, S_out, 0.25)
    close(o, ro, "o")
    close(S_out, S_ref, "state")


def test_gdn_sequence_long_on_fla_chunk(fla_chunk_cpu, monkeypatch):
    """fla's chunk kernel (prefill) rounds differently from the recurrence: looser bound."""
    monkeypatch.setattr(ops, "CHUNK_MIN_TOKENS", 64)  # the interpreter is slow; one chunk and a bit
    T = ops.CHUNK_MIN_TOKENS + 6
    q, k, v, g, beta, S = inputs(1, T, 1, 2, 16, 16, 6)
    S_ref, S_out = S.clone(), S.clone()
    ro = naive.gdn_recurrent(q, k, v, g, beta, S_ref, 0.25)
    with ops.backend("triton"):
        o = ops.gdn_sequence(q, k, v, g, beta, S_out, 0.25)
    assert o.dtype == torch.float32
    assert (o - ro).abs().max() < 1e-4 and (S_out - S_ref).abs().max() < 1e-4


@pytest.mark.parametrize("K", [16, 128])
def test_graph_prefill_chunk_takes_fla_from_chunk_tokens(monkeypatch, K):
    """A graph-replayed prefill chunk (`chunked=True`) goes to fla's chunk kernel from
    ops.chunk_tokens(K) tokens (128 for heads of up to 64 dims, else 64), where an eager
    sequence waits for CHUNK_MIN_TOKENS (host time); SPECLA_CHUNK_TOKENS overrides."""
    calls = []

    def spy(q, k, v, g, beta, scale, initial_state, **kw):
        calls.append(v.shape[1])
        return torch.zeros_like(v), initial_state

    monkeypatch.setattr(ops, "_fla_chunk", lambda: spy)
    T = ops.chunk_tokens(K)
    assert T == (128 if K <= 64 else 64) < ops.CHUNK_MIN_TOKENS
    q, k, v, g, beta, S = inputs(1, T, 1, 2, K, 16, 8)
    with ops.backend("triton"):
        ops.gdn_sequence(q, k, v, g, beta, S.clone(), 0.25, chunked=True)
        assert calls == [T]
        ops.gdn_sequence(q[:, :T - 1], k[:, :T - 1], v[:, :T - 1], g[:, :T - 1], beta[:, :T - 1], S.clone(), 0.25,
                         chunked=True)
        assert calls == [T]  # shorter: the serial kernel
    monkeypatch.setattr(ops, "CHUNK_TOKENS", 32)
    assert ops.chunk_tokens(K) == 32


def test_fla_chunk_ignores_masked_padding(fla_chunk_cpu, monkeypatch):
    """A graph prefill's last chunk (`GatedDeltaNet.forward` with `valid`): padding tokens with
    g = 0 and β = 0 leave fla's chunk kernel with the state of the real tokens alone, and the
    real tokens' outputs unchanged."""
    monkeypatch.setattr(ops, "CHUNK_MIN_TOKENS", 64)
    T, n = ops.CHUNK_MIN_TOKENS + 6, 45  # two chunks of the kernel, the real tokens end in the first
    q, k, v, g, beta, S = inputs(1, T, 1, 2, 16, 16, 7)
    real = (torch.arange(T) < n)[None, :, None]
    S_pad, S_cut = S.clone(), S.clone()
    with ops.backend("triton"):
        o_pad = ops.gdn_sequence(q, k, v, g * real, beta * real, S_pad, 0.25)
        monkeypatch.setattr(ops, "CHUNK_MIN_TOKENS", n)  # the real tokens alone, on the same kernel
        o_cut = ops.gdn_sequence(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], S_cut, 0.25)
    assert (o_pad[:, :n] - o_cut).abs().max() < 1e-5 and (S_pad - S_cut).abs().max() < 1e-5


def test_model_rounds_on_triton_match_torch():
    """A tiny model: verify (tree, then chain) with delayed commits, Triton vs torch dispatch."""
    from specla.shapes import random_model

    model = random_model("tiny", dtype=torch.float32, seed=3)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=g)
    rounds = [(torch.tensor([[-1, 0, 0, 1, 2, 2]]), torch.tensor([[0, 1, 3]]), torch.tensor([3])),
              (topology.chain(4), torch.tensor([[0, 1, 2, 3]]), torch.tensor([2]))]
    results = {}
    for backend in ("torch", "triton"):
        with ops.backend(backend):
            cache = model.new_cache(1)
            model.forward(prompt, cache)
            logits = []
            for par, path, length in rounds:
                toks = torch.randint(0, model.cfg.vocab_size, par.shape, generator=torch.Generator().manual_seed(1))
                out = model.verify(toks, par, cache)
                logits.append(out.logits)
                cache.commit(out.records, path, length, delayed=True)
            cache.flush()
            results[backend] = (torch.cat(logits, 1), [s.S for s in cache.layers], [s.conv for s in cache.layers])
    close(results["triton"][0], results["torch"][0], "logits")
    for a, b in zip(results["triton"][1], results["torch"][1]):
        close(a, b, "state")
    for a, b in zip(results["triton"][2], results["torch"][2]):
        close(a, b, "conv state")


@pytest.mark.parametrize("block_v", [8, 16])
def test_commit_ignores_garbage_past_length(block_v, poison):
    """Factor rows and path entries past `length` are read but must not leak in (NaN, out of
    range ids): the loads no longer wait for the length. block_v 8: rank-1 path; 16: tl.dot."""
    B, n, H, HV, K, V = 2, 6, 1, 2, 16, 16
    g0 = torch.Generator().manual_seed(3)
    _, k, _, g, _, S = inputs(B, n, H, HV, K, V, 3)
    u = torch.randn(B, n, HV, V, generator=g0)
    path = torch.tensor([[0, 2, 3, -1, 99], [1, 4, 5, 0, -7]])
    length = torch.tensor([3, 2])
    k[0, 5], u[1, 0] = float("nan"), float("nan")  # node 5 / node 0 are never accepted in these rows
    S_ref, S_out = S.clone(), S.clone()
    naive.gdn_commit(S_ref, k.nan_to_num(), g, u.nan_to_num(), path.clamp(0, n - 1), length)
    commit.gdn_commit(S_out, k, g, u, path, length, block_v=block_v)
    close(S_out, S_ref, "commit")
    # the fused pending form reads its rows 0.. directly: garbage past the length as well
    pk, pg, pu = k[:, :4].nan_to_num(), g[:, :4].clone(), u[:, 1:5].nan_to_num()
    pk[0, 3], pu[1, 2] = float("nan"), float("nan")
    plen = torch.tensor([3, 2])
    par = topology.chain(3, batch=B)
    q3, k3, v3, g3, b3, _ = inputs(B, 3, H, HV, K, V, 4)
    S_ref, S_out = S.clone(), S.clone()
    ro, ru = naive.gdn_tree_verify(q3, k3, v3, g3, b3, S_ref, par, 0.25,
                                   (pk.nan_to_num(), pg, pu.nan_to_num(), plen))
    o, u2 = serial.gdn_tree_verify(q3, k3, v3, g3, b3, S_out, par, 0.25, (pk, pg, pu, plen),
                                   chain=True, block_v=block_v)
    close(o, ro, "o")
    close(u2, ru, "u")
    close(S_out, S_ref, "state")


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(B=st.sampled_from([1, 2]), n=st.integers(1, 5), heads=st.sampled_from([(1, 1), (1, 2), (2, 4)]),
       KV=st.sampled_from([(16, 16), (16, 32), (24, 40)]), bv=st.sampled_from([8, 16]), P=st.sampled_from([0, 1, 3]),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_chain_mode_matches_reference(B, n, heads, KV, bv, P, bf16, seed, poison):
    """The chain mode dispatch runs for chains, incl. uneven K/V (masked tiles) and pending."""
    (H, HV), (K, V) = heads, KV
    par = topology.chain(n, batch=B)
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, seed, torch.bfloat16 if bf16 else torch.float32)
    pend = pending_of(B, P, H, HV, K, V, seed) if P else None
    S_ref, S_out = S.clone(), S.clone()
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, K ** -0.5, pend)
    o, u = serial.gdn_tree_verify(q, k, v, g, beta, S_out, par, K ** -0.5, pend, chain=True,
                                  block_v=bv, num_warps=2)
    close(o, ro, "o")
    close(u, ru, "u")
    close(S_out, S_ref, "state")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16))
def test_fallback_schedule_is_hld_or_one_serial_pass(n, kind, seed):
    par = torch.tensor([parents_of(kind, n, seed), parents_of("random", n, seed + 1)])
    hld, fb = schedule.hld_schedule(par), schedule.hld_schedule(par, fallback=True)
    want = schedule.prefer_serial(par)
    assert torch.equal(fb.serial_rows, want)
    for b in range(2):
        if want[b]:
            assert fb.length[b, 0] == n and not fb.length[b, 1:].any()
            walk = schedule.serial_order(par[b:b + 1])
            assert fb.nodes[b, 0].tolist() == walk.order[0].tolist()
            assert fb.light[b].tolist() == walk.kind[0].tolist()
        else:
            for f in ("nodes", "length", "light"):
                assert torch.equal(getattr(fb, f)[b], getattr(hld, f)[b])
    assert int(fb.count) == max(1 if want[b] else int((hld.length[b] > 0).sum()) for b in range(2))


def test_cost_model_choices():
    """With the constants fitted to the H200's Table 1 (658292c), each Table 1 tree goes where it
    measured faster there: the 16-node trees and the deep binary 32-node ones serial, the
    (4, 4, 32) and (4, 24, 32) ones to chains (whose critical path is a third of the nodes).
    Chains with a fork and stars (every leaf verified off the resident root tile) go serial;
    many parallel branches of two nodes go to chains."""
    for topk, depth, nodes in ((2, 12, 16), (4, 4, 16), (4, 12, 16), (2, 24, 32), (4, 4, 32), (4, 24, 32)):
        for seed in (0, 1):
            serial = bool(schedule.prefer_serial(torch.tensor([beam_tree(topk, depth, nodes, seed=seed)])))
            assert serial == (topk == 2 or nodes == 16), (topk, depth, nodes, seed)
    assert bool(schedule.prefer_serial(torch.tensor([list(range(-1, 39)) + [5]])))
    assert bool(schedule.prefer_serial(torch.tensor([[-1] + [0] * 47])))
    assert not bool(schedule.prefer_serial(torch.tensor([[-1] + [0] * 20 + list(range(1, 21))])))


@pytest.mark.parametrize("kind", ["star", "beam", "deep", "bushy"])
def test_hybrid_auto_schedule_matches_reference(kind, poison):
    """schedule="auto" on rows that go serial and rows that keep their chains, with pending."""
    B, n, H, HV, K, V = 2, 12, 1, 2, 16, 16
    par = torch.tensor([parents_of(kind, n, 5), parents_of("star", n, 6)])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, 8)
    pend = pending_of(B, 3, H, HV, K, V, 8)
    cheap = dict(SERIAL_COST=dict(schedule.SERIAL_COST, hybrid_fixed=-1e3 if kind == "bushy" else 0.0))
    S_ref = S.clone()
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, 0.25, pend)
    for cost in (schedule.SERIAL_COST, cheap["SERIAL_COST"]):
        old = schedule.SERIAL_COST
        schedule.SERIAL_COST = cost
        try:
            S_out = S.clone()
            o, u = hybrid.gdn_tree_verify(q, k, v, g, beta, S_out, par.clone(), 0.25, pend, schedule="auto",
                                          block_v=8, num_warps=1)
        finally:
            schedule.SERIAL_COST = old
        close(o, ro, "o")
        close(u, ru, "u")
        close(S_out, S_ref, "state")


def test_verify_tiling_from_environment(monkeypatch):
    """SPECLA_VERIFY_TILING picks the one tiling every GDN kernel call uses; a bad value says
    what it expects."""
    from specla import ops

    monkeypatch.setenv("SPECLA_VERIFY_TILING", "8,1")
    assert ops._tiling_from_env() == {"block_v": 8, "num_warps": 1}
    monkeypatch.setenv("SPECLA_VERIFY_TILING", "8")
    with pytest.raises(ValueError, match="BV,WARPS"):
        ops._tiling_from_env()


@pytest.mark.parametrize("kernel", ["serial", "parallel", "paths"])
@pytest.mark.parametrize("chain", [True, False])
def test_kernels_stop_at_valid(chain, kernel, poison):
    """Padding past valid[b] (a fixed-width verify): real nodes equal the reference, padding
    nodes come back as zeros on both, and a pending update is still applied in full."""
    B, n, H, HV, K, V = 2, 9, 1, 2, 16, 16
    par = topology.chain(n).expand(B, -1).contiguous() if chain else \
        torch.tensor([parents_of("beam", 6, 3) + [5, 6, 7], parents_of("deep", 5, 4) + [4, 5, 6, 7]])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, 21)
    pend = pending_of(B, 3, H, HV, K, V, 21)
    valid = torch.tensor([6, 5]) if not chain else torch.tensor([1, 7])
    S_ref, S_out = S.clone(), S.clone()
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, 0.25, pend, valid)
    if kernel == "serial":
        o, u = serial.gdn_tree_verify(q, k, v, g, beta, S_out, par, 0.25, pend, valid, chain=chain,
                                      block_v=8, num_warps=1)
    else:
        o, u = VERIFIERS[kernel](q, k, v, g, beta, S_out, par, 0.25, pend, valid)
    full, _ = naive.gdn_tree_verify(q, k, v, g, beta, S.clone(), par, 0.25, pend)
    for b in range(B):
        m = int(valid[b])
        close(o[b, :m], full[b, :m], "real nodes, o")
        assert not o[b, m:].any() and not u[b, m:].any() and not ro[b, m:].any() and not ru[b, m:].any()
    close(o, ro, "o")
    close(u, ru, "u")
    close(S_out, S_ref, "state")


@pytest.mark.parametrize("kind", ["beam", "bushy", "star", "random"])
def test_paths_compute_the_serial_pass_bits(kind, poison):
    """The path-parallel verifier gives each node the serial pass's arithmetic (the bits an AR
    step gets there: a node shared by many paths is computed by each, identically), writes a
    pending update back once, and leaves its counters zeroed for the next launch."""
    B, n, H, HV, K, V = 2, 12, 1, 2, 16, 32
    par = torch.tensor([parents_of(kind, n, 5 + b) for b in range(B)])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, 9)
    pend = pending_of(B, 2, H, HV, K, V, 9)
    pend = pend[:3] + (torch.tensor([2, 1]),)  # both rows flush: the write-back is exercised
    S_serial, S_paths = S.clone(), S.clone()
    so, su = serial.gdn_tree_verify(q, k, v, g, beta, S_serial, par, 0.25, pend, block_v=16)
    po, pu = paths.gdn_tree_verify(q, k, v, g, beta, S_paths, par, 0.25, pend, block_v=16)
    assert torch.equal(po, so) and torch.equal(pu, su) and torch.equal(S_paths, S_serial)
    assert not torch.equal(S_paths, S)
    assert not counters.zeroed(S.device, 1).any()


@pytest.mark.parametrize("tiling", [(16, 32, 16, 4, 4), (16, 16, 16, 2, 2)])
@pytest.mark.parametrize("kind,n", [("beam", 17), ("deep", 33), ("chain", 20), ("star", 16)])
def test_parallel_over_k_stretches_and_deep_trees(kind, n, tiling, poison):
    """The parallel verifier's K split (several stretches of one or two blocks, a ragged last
    one), uneven V tiles, GVA, a pending update flushed block by block, and trees deep enough
    for many Jacobi steps."""
    B, H, HV, K, V = 2, 1, 2, 48, 40
    par = torch.tensor([parents_of(kind, n, 5 + b) for b in range(B)])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, 9, torch.bfloat16)
    pend = pending_of(B, 3, H, HV, K, V, 9)
    S_ref, S_out = S.clone(), S.clone()
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, K ** -0.5, pend)
    o, u = parallel.gdn_tree_verify(q, k, v, g, beta, S_out, par, K ** -0.5, pend, tiling=tiling)
    close(o, ro, "o")
    close(u, ru, "u")
    close(S_out, S_ref, "state")


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(n=st.integers(1, 40), kinds=st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)),
       heads=st.sampled_from([(1, 1), (1, 2)]), K=st.sampled_from([16, 48]), V=st.sampled_from([16, 40]),
       tiling=st.tuples(st.sampled_from([16, 32]), st.sampled_from([16, 32, 64]), st.sampled_from([16, 64]),
                        st.sampled_from([1, 2, 4]), st.sampled_from([1, 4])),
       P=st.sampled_from([0, 2]), cut=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_parallel_tilings_on_random_trees(n, kinds, heads, K, V, tiling, P, cut, seed, poison):
    """The two launches at random tilings (V-tiles of 16 or 32, K blocks of 16 or 64, K stretches
    of one to four blocks, a ragged last one where K = 48), random topologies of 1 to 40 nodes (16-, 32- and
    64-row blocks), padding past a random valid count and an optional pending update."""
    (H, HV), B = heads, 2
    par = torch.tensor([parents_of(kinds[b], n, seed + b) for b in range(B)])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, seed)
    pend = pending_of(B, P, H, HV, K, V, seed) if P else None
    valid = torch.tensor([n, min(cut, n)])
    S_ref, S_out = S.clone(), S.clone()
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, K ** -0.5, pend, valid)
    o, u = parallel.gdn_tree_verify(q, k, v, g, beta, S_out, par, K ** -0.5, pend, valid, tiling=tiling)
    close(o, ro, "o")
    close(u, ru, "u")
    close(S_out, S_ref, "state")


def test_parallel_widest_block_and_padding(poison):
    """33 and 64 nodes take the 64-row block: padding past valid[b] comes back as zeros, and
    the pending update is still flushed."""
    H, HV, K, V = 1, 2, 32, 16
    for n in (33, parallel.MAX_NODES):
        assert parallel.padded_nodes(n) == 64
        par = torch.tensor([parents_of("beam", n, 2), parents_of("random", n, 3)])
        q, k, v, g, beta, S = inputs(2, n, H, HV, K, V, 13)
        pend = pending_of(2, 3, H, HV, K, V, 13)
        valid = torch.tensor([n, 20])
        S_ref, S_out = S.clone(), S.clone()
        ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, K ** -0.5, pend, valid)
        o, u = parallel.gdn_tree_verify(q, k, v, g, beta, S_out, par, K ** -0.5, pend, valid)
        close(o, ro, "o")
        close(u, ru, "u")
        close(S_out, S_ref, "state")
        assert not o[1, 20:].any() and not u[1, 20:].any()


@pytest.mark.parametrize("early", [0, 2, 1 << 30])
def test_paths_pdl_form_computes_the_same_bits(monkeypatch, early, poison):
    """The path verifier's PDL form (`ops.pdl`; the interpreter runs it with the wait as a no-op,
    one program after another): the first `paths.EARLY` table rows advance their tile before
    the wait, the rest after it if they walk; the bits, the write-back and the zeroed counters
    are the serial pass's, whether every row, some or none goes first (trees of 5-8 leaves)."""
    from specla.ops import pdl

    B, n, H, HV, K, V = 2, 12, 1, 2, 16, 32
    par = torch.tensor([parents_of("star", n, 5), parents_of("bushy", n, 6)])
    q, k, v, g, beta, S = inputs(B, n, H, HV, K, V, 9)
    pend = pending_of(B, 2, H, HV, K, V, 9)
    pend = pend[:3] + (torch.tensor([2, 1]),)
    S_serial, S_paths = S.clone(), S.clone()
    so, su = serial.gdn_tree_verify(q, k, v, g, beta, S_serial, par, 0.25, pend, block_v=16)
    noop = lambda *a, **kw: None  # noqa: E731
    monkeypatch.setattr(pdl, "gdc_wait", noop)
    monkeypatch.setattr(pdl, "gdc_launch_dependents", noop)
    monkeypatch.setattr(pdl, "launch_options", lambda device, allowed=True: {"PDL": allowed})
    monkeypatch.setattr(paths, "EARLY", early)
    po, pu = paths.gdn_tree_verify(q, k, v, g, beta, S_paths, par, 0.25, pend, block_v=16)
    leaves = [n - len(set(p[1:].tolist())) for p in par]
    assert min(leaves) > 2  # rows past EARLY = 2 walk
    assert torch.equal(po, so) and torch.equal(pu, su) and torch.equal(S_paths, S_serial)
    assert not torch.equal(S_paths, S)
    assert not counters.zeroed(S.device, 1).any()
