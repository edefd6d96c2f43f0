"""Hybrid GDN + softmax-attention targets (Qwen3-Next, Qwen3.5): loading, parity, exactness.

- tiny random transformers models, saved sharded with save_pretrained (plus a tokenizer), load
  through `specla.checkpoint.load_model` with transformers' logits (fp32, < 1e-5) and its
  greedy `generate` tokens;
- float64: every speculative route (n-gram chain and tree, random topologies, the
  checkpoint's MTP module) emits AR's greedy tokens, and the committed cache after a flush
  equals AR's (GDN states, conv states and KV entries [0, length) within 1e-10), delayed and
  immediate commit;
- options specla does not run are refused by name.
"""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch
from safetensors.torch import save_file

from specla import topology
from specla.checkpoint import INDEX, load_config, load_model
from specla.decode import Decoder
from specla.drafters.ngram import NgramDrafter
from specla.errors import CheckpointError, UnsupportedConfigError
from specla.state import GDNLayerState, KVLayerState

from drafters import OracleTreeDrafter

transformers = pytest.importorskip("transformers")

VOCAB = 96
WORDS = [f"w{i}" for i in range(VOCAB - 2)]


@pytest.fixture(scope="module", autouse=True)
def hf_torch_fallbacks():
    """transformers binds fla's Triton kernels when fla is installed; use its torch paths on CPU."""
    saved = []
    for mod in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        try:
            m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        except ImportError:
            continue
        for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                  "causal_conv1d_update"):
            if hasattr(m, n):
                saved.append((m, n, getattr(m, n)))
                setattr(m, n, inspect.unwrap(getattr(m, n)))
    yield
    for m, n, f in saved:
        setattr(m, n, f)


# tiny checkpoints ------------------------------------------------------------------------

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, max_position_embeddings=512, eos_token_id=VOCAB - 1,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])

KINDS = {
    # Qwen3.5 text model: split GDN projections, dense MLPs, tied embeddings
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=48, tie_word_embeddings=True)),
    # Qwen3-Next, every layer sparse (no top-k renormalisation)
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        intermediate_size=48, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=False)),
    # Qwen3-Next with dense MLP layers among the sparse ones (mlp_only_layers)
    "qwen3_next_dense": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        intermediate_size=40, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[0, 1, 3])),
}


def randomise(model, seed: int) -> None:
    """Weights large enough that logits are far from ties (transformers' init is near zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.7 * p.shape[-1] ** -0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 3 - 2)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "linear_attn.norm" in name:  # plain gated norm
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:  # zero-centred RMSNorms: weight 1 + w
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)


def save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({"<unk>": VOCAB - 2, "<|endoftext|>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(path)


def mtp_tensors(cfg, moe: bool, seed: int) -> dict:
    """Random `mtp.*` weights with the names and shapes of Qwen3-Next / Qwen3.5 checkpoints."""
    g = torch.Generator().manual_seed(seed)
    D, hd = cfg.hidden_size, cfg.head_dim
    w = lambda *s: torch.randn(s, generator=g) * 1.5 * s[-1] ** -0.5  # noqa: E731
    nrm = lambda n: torch.rand(n, generator=g) - 0.5  # noqa: E731
    p = "mtp.layers.0."
    sd = {"mtp.fc.weight": w(D, 2 * D), "mtp.pre_fc_norm_embedding.weight": nrm(D),
          "mtp.pre_fc_norm_hidden.weight": nrm(D), "mtp.norm.weight": nrm(D),
          p + "input_layernorm.weight": nrm(D), p + "post_attention_layernorm.weight": nrm(D),
          p + "self_attn.q_proj.weight": w(2 * cfg.num_attention_heads * hd, D),
          p + "self_attn.k_proj.weight": w(cfg.num_key_value_heads * hd, D),
          p + "self_attn.v_proj.weight": w(cfg.num_key_value_heads * hd, D),
          p + "self_attn.o_proj.weight": w(D, cfg.num_attention_heads * hd),
          p + "self_attn.q_norm.weight": nrm(hd), p + "self_attn.k_norm.weight": nrm(hd)}
    if moe:
        I, S = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        sd[p + "mlp.gate.weight"] = w(cfg.num_experts, D)
        for e in range(cfg.num_experts):
            sd[f"{p}mlp.experts.{e}.gate_proj.weight"] = w(I, D)
            sd[f"{p}mlp.experts.{e}.up_proj.weight"] = w(I, D)
            sd[f"{p}mlp.experts.{e}.down_proj.weight"] = w(D, I)
        sd.update({p + "mlp.shared_expert.gate_proj.weight": w(S, D), p + "mlp.shared_expert.up_proj.weight": w(S, D),
                   p + "mlp.shared_expert.down_proj.weight": w(D, S), p + "mlp.shared_expert_gate.weight": w(1, D)})
    else:
        I = cfg.intermediate_size
        sd.update({p + "mlp.gate_proj.weight": w(I, D), p + "mlp.up_proj.weight": w(I, D),
                   p + "mlp.down_proj.weight": w(D, I)})
    return sd


def add_mtp(path, cfg, moe: bool, seed: int) -> None:
    """Append an MTP shard to a sharded checkpoint and list it in the index, as Qwen ships them."""
    sd = mtp_tensors(cfg, moe, seed)
    save_file(sd, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / INDEX).read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in sd})
    (path / INDEX).write_text(json.dumps(index))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, (kind, (cfg_cls, model_cls, extra)) in enumerate(KINDS.items()):
        torch.manual_seed(i)
        cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
        hf = getattr(transformers, model_cls)(cfg).eval()
        randomise(hf, 100 + i)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path, max_shard_size="40KB")
        assert (path / INDEX).is_file(), "the checkpoint should be sharded"
        save_tokenizer(path)
        add_mtp(path, cfg, moe=cfg_cls == "Qwen3NextConfig", seed=200 + i)
        out[kind] = (path, hf)
    return out


def prompt_ids(path, seed: int, n: int = 12) -> list[int]:
    """A prompt through the checkpoint's own tokenizer, with a repeat for the n-gram drafter."""
    from specla.data.tokenizer import load_tokenizer

    g = torch.Generator().manual_seed(seed)
    words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)]
    text = " ".join(words + words[: n // 2])
    ids = load_tokenizer(path).encode(text)
    assert ids == transformers.AutoTokenizer.from_pretrained(path).encode(text, add_special_tokens=False)
    return ids


# transformers parity ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_and_greedy_tokens_match_transformers(checkpoints, kind):
    path, hf = checkpoints[kind]
    model = load_model(path)
    cfg = model.cfg
    assert cfg.attention_layers == [1, 3] and cfg.norm_style == "zero_centered"
    if kind == "qwen3_next_moe":
        assert all(cfg.is_moe_layer(i) for i in range(4))
    if kind == "qwen3_next_dense":
        assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, False]
    ids = prompt_ids(path, 1)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(x).logits
    out = model.forward(x, model.new_cache(1, 64)).logits
    assert (out - ref).abs().max().item() < 1e-5
    # the plain sequence path split in two (prefill + cache) gives the same logits
    cache = model.new_cache(1, 64)
    a = model.forward(x[:, :7], cache).logits
    b = model.forward(x[:, 7:], cache).logits
    assert (torch.cat([a, b], 1) - ref).abs().max().item() < 1e-5

    ref_tokens = hf.generate(x, max_new_tokens=20, do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
    assert Decoder(model).generate(ids, 20).tokens == ref_tokens


def test_qwen3_5_moe_and_fused_expert_tensors(tmp_path):
    """Qwen3.5-MoE (sparse MLP in every layer); experts stored either one module per expert
    (as save_pretrained writes) or as transformers 5's fused 3-D tensors."""
    import re

    from specla.checkpoint import read_state_dict

    cfg = transformers.Qwen3_5MoeTextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24)
    torch.manual_seed(8)
    hf = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    randomise(hf, 8)
    hf.save_pretrained(tmp_path / "a", max_shard_size="40KB")
    x = torch.tensor([[5, 17, 3, 88, 41, 70, 12, 33, 60, 2]])
    with torch.no_grad():
        ref = hf(x).logits
    model = load_model(tmp_path / "a")
    assert all(model.cfg.is_moe_layer(i) for i in range(4))
    assert (model.forward(x, model.new_cache(1, 32)).logits - ref).abs().max().item() < 1e-5
    sd, fused = read_state_dict(tmp_path / "a"), {}
    for k in list(sd):
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            fused.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = sd.pop(k)
    for prefix, parts in fused.items():
        stack = {n: torch.stack([parts[n][e] for e in range(4)]) for n in parts}
        sd[prefix + ".gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], 1)
        sd[prefix + ".down_proj"] = stack["down"]
    (tmp_path / "b").mkdir()
    save_file(sd, str(tmp_path / "b" / "model.safetensors"))
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    model = load_model(tmp_path / "b")
    assert (model.forward(x, model.new_cache(1, 32)).logits - ref).abs().max().item() < 1e-5


# float64 exactness -----------------------------------------------------------------------

NEW = 64


def assert_same_cache(a, b, tol=1e-10):
    assert torch.equal(a.length, b.length)
    L = int(a.length.max())
    for sa, sb in zip(a.layers, b.layers):
        assert type(sa) is type(sb)
        if isinstance(sa, GDNLayerState):
            for st in (sa, sb):  # flushed: nothing left pending
                assert st.pending is None or int(st.pending[3].sum()) == 0
            assert (sa.S - sb.S).abs().max().item() < tol
            assert (sa.conv - sb.conv).abs().max().item() < tol
        else:
            assert isinstance(sa, KVLayerState)
            for row, n in enumerate(a.length.tolist()):
                assert (sa.k[row, :, :n] - sb.k[row, :, :n]).abs().max().item() < tol
                assert (sa.v[row, :, :n] - sb.v[row, :, :n]).abs().max().item() < tol
            assert L > 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_speculative_routes_equal_ar_float64(checkpoints, kind):
    from specla.drafters.mtp import MTPDrafter

    path, _ = checkpoints[kind]
    model = load_model(path, dtype=torch.float64)
    prompt = prompt_ids(path, 2)
    ar_rows, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), NEW)
    oracle = [prompt + ar_rows[0]]
    drafters = [
        lambda: NgramDrafter(length=6, topk=1),
        lambda: NgramDrafter(length=4, topk=3, budget=10),
        lambda: OracleTreeDrafter(oracle, VOCAB, max_nodes=12, seed=3),
        lambda: MTPDrafter.from_checkpoint(path, model, length=3),
    ]
    for make in drafters:
        for delayed in (True, False):
            drafter = make()
            rows, res, cache = Decoder(model, drafter, delayed=delayed).run(torch.tensor([prompt]), NEW)
            assert rows == ar_rows, (drafter.name, delayed)
            assert_same_cache(cache, ar_cache)
            if isinstance(drafter, OracleTreeDrafter):
                assert any(r.accepted == 0 and r.drafted > 0 for r in res.rounds)
                assert max(r.accepted for r in res.rounds) >= 3
            if isinstance(drafter, MTPDrafter):
                assert all(r.drafted == 3 for r in res.rounds)


def test_mtp_proposals_follow_the_reference_formula(checkpoints):
    """The drafter's incremental cache gives what the MTP formula gives on the whole history."""
    from specla.drafters.mtp import MTPDrafter

    path, _ = checkpoints["qwen3_next_moe"]
    model = load_model(path, dtype=torch.float64)
    drafter = MTPDrafter(path, model, length=4)
    seen = []
    propose = drafter.propose
    drafter.propose = lambda ctx: seen.append((list(ctx.history[0]), propose(ctx))) or seen[-1][1]
    prompt = prompt_ids(path, 4)
    Decoder(model, drafter).run(torch.tensor([prompt]), 40)
    mod = drafter.module
    for hist, draft in seen[::3]:
        # target hidden states (after the final norm) of every consumed token, from scratch
        out = model.forward(torch.tensor([hist[:-1]]), model.new_cache(1, 256), capture=(3,))
        h = model.norm(out.hidden[3])
        toks = torch.tensor([hist[1:]])  # entry t pairs token t+1 with hidden t
        st = mod.layers[0].mixer.new_state(1, 256, "cpu", torch.float64)
        m = mod(model.embeddings(toks), h, st, torch.zeros(1, dtype=torch.long))[:, -1]
        expect = []
        for s in range(4):
            nxt = model.lm_head(m).argmax(-1)
            expect.append(int(nxt))
            if s < 3:
                m = mod(model.embeddings(nxt)[:, None], m[:, None], st, torch.tensor([len(hist) - 1 + s]))[:, 0]
        assert draft.tokens[0, 1:].tolist() == expect


def test_attention_verify_sees_exactly_the_ancestors():
    """Each tree node's output equals running its root-to-node path as a plain sequence."""
    from specla.config import ATTENTION, GDN, ModelConfig
    from specla.model import Model

    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_heads=2,
                      num_v_heads=2, head_dim=8, head_v_dim=8, layer_types=[ATTENTION, GDN], attn_num_heads=4,
                      attn_num_kv_heads=2, attn_head_dim=8, attn_output_gate=True, partial_rotary_factor=0.5,
                      norm_style="zero_centered", max_position_embeddings=128)
    torch.manual_seed(0)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.3))
    model = model.double().eval()
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, 64)
    model.forward(torch.randint(0, 50, (1, 9), generator=g), cache)
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2, 0, 5]])
    tokens = torch.randint(0, 50, (1, 8), generator=g)
    out = model.verify(tokens, parents, cache).logits
    for path in topology.root_to_leaf_paths(parents):
        ref = model.forward(tokens[:, path], cache.clone()).logits
        assert (out[:, path] - ref).abs().max().item() < 1e-10
    assert int(cache.length) == 9


# MoE ---------------------------------------------------------------------------------------

def test_moe_reads_only_the_selected_experts():
    from specla.config import ModelConfig
    from specla.moe import SparseMoE

    cfg = ModelConfig(vocab_size=10, hidden_size=16, num_hidden_layers=1, intermediate_size=0, num_heads=1,
                      num_v_heads=1, head_dim=4, head_v_dim=4, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=12, shared_expert_intermediate_size=10, norm_topk_prob=True)
    moe = SparseMoE(cfg).double()
    torch.manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.5)
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    grouped = moe._grouped(x[0], *moe.route(x[0]))
    full = moe(x)  # 3 tokens * 2 <= 8 experts: the gather path
    shared = torch.sigmoid(moe.shared_expert_gate(x[0])) * moe.shared_expert(x[0])
    assert (full[0] - grouped - shared).abs().max() < 1e-12
    # a single token touches only its experts: poisoning every other expert changes nothing
    one = x[:, :1]
    _, idx = moe.route(one[0])
    ref = moe(one)
    with torch.no_grad():
        keep = torch.zeros(8, dtype=torch.bool)
        keep[idx[0]] = True
        moe.experts_gate_up[~keep] = float("nan")
        moe.experts_down[~keep] = float("nan")
    assert torch.equal(moe(one), ref)


# refusals ----------------------------------------------------------------------------------

def _write_config(tmp_path, d):
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


@pytest.mark.parametrize("change, words", [
    ({"use_sliding_window": True, "sliding_window": 64}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "sliding_attention"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_options_are_refused_by_name(checkpoints, tmp_path, change, words):
    path, _ = checkpoints["qwen3_next_moe"]
    d = json.loads((path / "config.json").read_text())
    d.update(change)
    with pytest.raises(UnsupportedConfigError, match=words.replace("(", r"\(")):
        load_config(_write_config(tmp_path, d))


def test_transformers_4_style_config(checkpoints, tmp_path):
    """Older configs: rope_theta / partial_rotary_factor at the top level, rope_scaling null,
    full_attention_interval instead of layer_types."""
    path, _ = checkpoints["qwen3_next_dense"]
    d = json.loads((path / "config.json").read_text())
    new = load_config(path)
    rp = d.pop("rope_parameters")
    d.pop("layer_types")
    d.update(rope_theta=rp["rope_theta"], partial_rotary_factor=rp["partial_rotary_factor"], rope_scaling=None,
             full_attention_interval=2)
    old = load_config(_write_config(tmp_path, d))
    assert old == new
    from specla.checkpoint import has_mtp

    assert has_mtp(path) and new.mtp_num_layers == 0  # transformers writes no MTP count; the weights decide


def test_multimodal_qwen3_5_config(checkpoints, tmp_path):
    """A Qwen3.5 multimodal config loads its text_config when only text weights are present;
    a checkpoint with the vision tower is refused with a clear message."""
    from safetensors.torch import load_file

    from specla.checkpoint import read_state_dict

    path, hf = checkpoints["qwen3_5"]
    text = json.loads((path / "config.json").read_text())
    d = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
         "text_config": text, "vision_config": {"model_type": "qwen3_5_vision", "depth": 2},
         "tie_word_embeddings": True}
    sd = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
          for k, v in read_state_dict(path).items()}
    mm = tmp_path / "mm"
    mm.mkdir()
    save_file(sd, str(mm / "model.safetensors"))
    _write_config(mm, d)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ref = load_model(path).forward(ids, load_model(path).new_cache(1, 32)).logits
    model = load_model(mm)
    assert (model.forward(ids, model.new_cache(1, 32)).logits - ref).abs().max() < 1e-6
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    save_file(sd, str(mm / "model.safetensors"))
    with pytest.raises(UnsupportedConfigError, match="vision tower"):
        load_model(mm)
    assert load_file(str(mm / "model.safetensors"))  # the file itself is fine


def test_mtp_with_two_layers_is_refused(checkpoints, tmp_path):
    from specla.drafters.mtp import MTPDrafter
    from specla.checkpoint import read_mtp_state_dict

    path, _ = checkpoints["qwen3_5"]
    model = load_model(path)
    sd = read_mtp_state_dict(path)
    sd.update({k.replace("layers.0", "layers.1"): v.clone() for k, v in sd.items() if k.startswith("mtp.layers.0")})
    import shutil

    dst = tmp_path / "two"
    shutil.copytree(path, dst)
    save_file(sd, str(dst / "model-mtp.safetensors"))
    index = json.loads((dst / INDEX).read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in sd})
    (dst / INDEX).write_text(json.dumps(index))
    with pytest.raises(UnsupportedConfigError, match="MTP layers"):
        MTPDrafter(dst, model)
    for name in list(index["weight_map"]):
        if name.startswith("mtp."):
            del index["weight_map"][name]
    (dst / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="multi-token-prediction"):
        MTPDrafter.from_checkpoint(dst, model)


@pytest.mark.parametrize("kind", list(KINDS))
def test_mtp_runs_ahead_on_emulated_graphs(checkpoints, kind, monkeypatch):
    """Hybrid targets on the graph path (emulated on CPU) with the checkpoint's MTP drafter,
    which drafts from the device root: the run-ahead loop emits AR's tokens and leaves AR's
    cache (attention KV included)."""
    from graph_emulation import emulate_graphs
    from specla.drafters.mtp import MTPDrafter

    emulate_graphs(monkeypatch)
    path, _ = checkpoints[kind]
    model = load_model(path, dtype=torch.float64)
    prompt = prompt_ids(path, 3)
    ar_rows, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), NEW)
    dec = Decoder(model, MTPDrafter.from_checkpoint(path, model, length=3), graphs=True)
    rows, _, cache = dec.run(torch.tensor([prompt]), NEW)
    assert dec._runs_ahead(next(iter(dec.targets.values()))) and rows == ar_rows
    assert_same_cache(cache, ar_cache)


def test_exact_mode_on_hybrid_targets_warns_where_it_is_not_bitwise(checkpoints):
    """Exact mode runs on hybrid targets (float64: AR's tokens). It warns for MoE targets and for
    trees on hybrid ones (their attention keys are not in position order), not for chains on a
    dense hybrid target (bitwise: tests/test_exact_mode.py)."""
    import warnings

    path, _ = checkpoints["qwen3_5"]
    model = load_model(path, dtype=torch.float64)
    prompt = prompt_ids(path, 2)
    ar = Decoder(model).run(torch.tensor([prompt]), 24)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain = Decoder(model, NgramDrafter(length=6, topk=1), "chain", exact_width=9)
    assert not [w for w in caught if "bit-exact for pure GDN" in str(w.message)]
    with pytest.warns(UserWarning, match="attention on draft trees"):
        tree = Decoder(model, NgramDrafter(length=4, topk=2, budget=8), "tree", exact_width=9)
    assert chain.run(torch.tensor([prompt]), 24)[0] == ar
    assert tree.run(torch.tensor([prompt]), 24)[0] == ar
    moe = load_model(checkpoints["qwen3_next_moe"][0], dtype=torch.float64)
    with pytest.warns(UserWarning, match="MoE"):
        Decoder(moe, exact_width=9)
