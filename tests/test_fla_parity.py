"""A checkpoint written by fla 0.6.0 loads unchanged and gives fla's logits (fp32, CPU)."""

import pytest
import torch

from specla.checkpoint import load_model


@pytest.mark.parametrize("gva", [False, True])
@pytest.mark.parametrize("use_gate,tie", [(True, False), (False, True)])
def test_fla_checkpoint_logits(tmp_path, fla_on_cpu, gva, use_gate, tie):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    torch.manual_seed(0)
    cfg = GatedDeltaNetConfig(
        hidden_size=32, num_hidden_layers=2, num_heads=2, num_v_heads=4 if gva else None, head_dim=8,
        expand_v=2, vocab_size=64, hidden_ratio=2, use_gate=use_gate, tie_word_embeddings=tie,
        fuse_cross_entropy=False)
    ref = GatedDeltaNetForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    x = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        want = ref(x).logits
    model = load_model(tmp_path)
    got = model(x, model.new_cache()).logits
    assert (got - want).abs().max().item() < 1e-5
    # the speculative path on a chain gives the same logits as the sequence path
    from specla.topology import chain

    out = model.verify(x, chain(12), model.new_cache())
    assert (out.logits - want).abs().max().item() < 1e-5


def test_save_roundtrip_loads_in_fla(tmp_path, fla_on_cpu):
    """What specla saves (sharded) is an fla checkpoint: fla loads it and agrees."""
    from fla.models import GatedDeltaNetForCausalLM

    from specla.checkpoint import save_model
    from specla.config import ModelConfig
    from specla.shapes import random_model

    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                      num_heads=2, num_v_heads=2, head_dim=8, head_v_dim=16)
    model = random_model(cfg, dtype=torch.float32)
    save_model(model, tmp_path, max_shard_bytes=20_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    x = torch.randint(0, 300, (1, 9))
    want = model(x, model.new_cache()).logits
    back = load_model(tmp_path)
    assert torch.equal(back(x, back.new_cache()).logits, want)
    fla_model = GatedDeltaNetForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (fla_model(x).logits - want).abs().max().item() < 1e-5


def test_fla_route_matches_ar(fla_on_cpu):
    """The FLA-SD baseline (fla's model, path replay, token-replay commit) emits AR's tokens."""
    from specla.decode import Decoder
    from specla.drafters.ngram import NgramDrafter

    from conftest import random_model, tiny_config
    from drafters import OracleTreeDrafter

    cfg = tiny_config(4, use_short_conv=True, use_gate=True, gate_activation="silu", allow_neg_eigval=False)
    model = random_model(cfg, 4, dtype=torch.float32)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    ar = Decoder(model).generate(prompt, 24)
    for drafter in (NgramDrafter(length=6), OracleTreeDrafter([prompt + ar.tokens], cfg.vocab_size, seed=2)):
        got = Decoder(model, drafter, "fla", executor="fla").generate(prompt, 24)
        assert got.tokens == ar.tokens
        assert any(r.accepted > 0 for r in got.rounds)
