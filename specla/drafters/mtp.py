"""The checkpoint's own multi-token-prediction (MTP) module as a drafter (Qwen3-Next / Qwen3.5).

Qwen3-Next and Qwen3.5 checkpoints ship `mtp.*` weights that transformers ignores: one extra
full-attention decoder layer that predicts the token after next from the target's last hidden
state and the next token's embedding. As vLLM and SGLang run it, for an entry at position t:

    x   = fc([ pre_fc_norm_embedding(embed(token_{t+1})) ; pre_fc_norm_hidden(h_t) ])
    x   = x + attn(input_layernorm(x))              # its own KV cache over the accepted history
    x   = x + mlp(post_attention_layernorm(x))      # sparse MoE (Qwen3-Next) or dense (Qwen3.5)
    m_t = norm(x);  logits = lm_head(m_t)           # the target's LM head; predicts token_{t+2}

h_t is the target's hidden state after its final norm (the LM head's input), which specla
captures as the residual after the last layer and normalises with the target's final norm.
The embedding and LM head are the target's own. A chain of `length` drafts applies the module
recursively: draft i+1 comes from (embed(draft_i), m of the previous step) at the next position.

Cache bookkeeping. Entry t pairs token t+1 with hidden t, so the hidden of the last consumed
token waits (`pending`) until the next token is known. `extend` appends the entries of the
tokens the target consumed (K/V only: nothing else of a history entry is ever read); `propose`
writes its speculative entries past the committed length, where the next `extend` overwrites
them, and never advances the length.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from specla import topology
from specla.checkpoint import has_mtp, read_mtp_state_dict
from specla.config import ModelConfig
from specla.drafters.base import Draft, DraftContext, Drafter, grown, kv_room
from specla.errors import CheckpointError
from specla.hybrid_formats import mtp_to_canonical
from specla.layers import RMSNorm
from specla.model import Block, Model
from specla.state import KVLayerState


class MTPModule(nn.Module):
    """fc over [norm(embedding); norm(hidden)], one attention decoder layer, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        zc = cfg.norm_style == "zero_centered"
        D = cfg.hidden_size
        self.cfg = cfg
        self.pre_fc_norm_embedding = RMSNorm(D, cfg.norm_eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(D, cfg.norm_eps, zc)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList([Block(cfg, 0)])
        self.norm = RMSNorm(D, cfg.norm_eps, zc)

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, emb, hidden, st: KVLayerState, cache_length: torch.Tensor) -> torch.Tensor:
        """Entries [B, T] at positions cache_length + t (written into st); returns m [B, T, D]."""
        blk = self.layers[0]
        x = self.fuse(emb, hidden)
        x = x + blk.mixer(blk.attn_norm(x), st, cache_length)
        x = x + blk.mlp(blk.mlp_norm(x))
        return self.norm(x)

    def write_history(self, emb, hidden, st: KVLayerState, cache_length: torch.Tensor) -> None:
        blk = self.layers[0]
        blk.mixer.write_kv(blk.attn_norm(self.fuse(emb, hidden)), st, cache_length)


def load_mtp_module(model_dir, target: Model) -> MTPModule:
    """Build the MTP module from the `mtp.*` weights of a Qwen3-Next / Qwen3.5 checkpoint."""
    sd, mcfg = mtp_to_canonical(read_mtp_state_dict(Path(model_dir)), target.cfg)
    with torch.device("meta"):
        module = MTPModule(mcfg)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{model_dir}: MTP weights do not match the config "
                              f"(missing: {', '.join(missing[:3]) or '-'}; unexpected: {', '.join(extra[:3]) or '-'})")
    for name, t in expected.items():
        if tuple(sd[name].shape) != tuple(t.shape):
            raise CheckpointError(f"MTP weight {name} has shape {tuple(sd[name].shape)}, expected {tuple(t.shape)}")
    module.load_state_dict({k: v.to(target.dtype) for k, v in sd.items()}, assign=True)
    return module.to(target.device).eval()


class MTPDrafter(Drafter):
    """Chains of `length` drafts from the checkpoint's MTP layer, applied recursively."""

    name = "mtp"
    device_root = True
    chain = True

    def __init__(self, model_dir, target: Model, length: int = 3, module: MTPModule | None = None,
                 initial_capacity: int = 256):
        self.target = target
        self.module = module if module is not None else load_mtp_module(model_dir, target)
        self.length = int(length)
        self.capture = (target.cfg.num_hidden_layers - 1,)
        self.initial_capacity = initial_capacity
        self.reset(1)

    @classmethod
    def from_checkpoint(cls, model_dir, target: Model, length: int = 3) -> "MTPDrafter":
        """The MTP drafter of checkpoint `model_dir`, whose target `target` is already loaded."""
        if model_dir is None or not has_mtp(model_dir):
            raise CheckpointError(f"route mtp needs a checkpoint with multi-token-prediction weights (mtp.*); "
                                  f"{model_dir} has none")
        return cls(model_dir, target, length=length)

    # cache ---------------------------------------------------------------------------------
    def reset(self, batch: int, horizon: int | None = None) -> None:
        mixer = self.module.layers[0].mixer
        self.st = mixer.new_state(batch, self.initial_capacity, self.target.device, self.target.dtype)
        self.len = torch.zeros(batch, dtype=torch.long, device=self.target.device)
        self._bound = 0  # host-side upper bound of max(self.len), so growing needs no sync per step
        self.pending: torch.Tensor | None = None  # [B, D] hidden whose next token is not yet known

    def _reserve(self, extra: int) -> None:
        self._bound, new = kv_room(self.st.k.shape[2], self._bound, extra, self.len)
        if new is not None:
            self.st = KVLayerState(grown(self.st.k, new), grown(self.st.v, new))

    # Drafter API ---------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor,
               static: bool = False) -> None:
        h = self.target.norm(hidden[self.capture[0]])  # the LM head's input, [B, n, D]
        if self.pending is None:  # the first consumed token has no hidden before it
            ent_tok, ent_hid, count = tokens[:, 1:], h[:, :-1], (length - 1).clamp(min=0)
        else:
            ent_tok, ent_hid, count = tokens, torch.cat([self.pending[:, None], h[:, :-1]], 1), length
        if ent_tok.shape[1] > 0:
            self._reserve(ent_tok.shape[1])
            emb = self.target.embeddings(ent_tok)
            self.module.write_history(emb, ent_hid.to(emb.dtype), self.st, self.len)
        self.len = self.len + count
        self._bound += ent_tok.shape[1]
        rows = torch.arange(h.shape[0], device=h.device)
        last = h[rows, (length - 1).clamp(min=0)]
        self.pending = last if self.pending is None else torch.where((length > 0)[:, None], last, self.pending)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        dev = self.target.device
        root = ctx.root if ctx.root is not None else torch.tensor([h[-1] for h in ctx.history], device=dev)
        B = root.shape[0]
        toks = [root]
        if self.pending is not None and self.length > 0:
            self._reserve(self.length)
            tok, hid = root, self.pending
            for s in range(self.length):
                m = self.module(self.target.embeddings(tok)[:, None], hid[:, None], self.st, self.len + s)[:, 0]
                tok = self.target.lm_head(m).argmax(-1)
                toks.append(tok)
                hid = m
        tokens = torch.stack(toks, 1)
        return Draft(tokens, topology.chain(tokens.shape[1], B, device=dev))
