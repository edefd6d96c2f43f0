"""ReaDy: the DSpark drafter plus a state reader over the target's committed GDN states (docs/ready.md).

Each draft position reads the recurrent states of chosen target GDN layers (`source_layers`;
default a middle and the last GDN layer) through a low-rank learned reader, added as a
residual in chosen draft layers (default: the last, after attention):

    z_p  = down(norm(x_p)) + e_p                    rank-r bottleneck; e_p a learned query per position
    q_p  = up(z_p)            -> [L, HV, K]         one query per source layer and value head
    r_p  = W_lᵀ (S_lᵀ q_p)    -> [L, HV, r]         the layer's own read-out, value map W_l [V, r]
    x_p += out([rmsnorm(r_p) ; ½ log ‖S_l‖²])       state-scale feature per head; out zero-initialised

With `reader_rank=None` ("full") the query is a direct projection and the reads keep all V
dims. S is the *committed* state: in delayed-commit mode the cache's S lags one round (the
last accepted path is pending), and the read goes through `specla.ops.reader.committed_read`
(one custom op inside the compiled block forward), which applies the pending update, writes
the advanced state back (the read is the flush — one fused kernel on CUDA) and lets the
drafter zero the pending lengths.

`ReadyModel.from_dspark` starts a ReaDy drafter from a trained DSpark one (the reader's output
projection is zero, so it starts as exactly that drafter); `reader_parameters` are what stage 1
of the two-stage adaptation trains (`specla.train.block_drafter`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from specla.config import ModelConfig
from specla.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel
from specla.errors import CheckpointError, InputError
from specla.layers import RMSNorm
from specla.model import Model
from specla.ops import reader as reader_ops

MODEL_TYPE = "specla_ready"
SITES = ("pre", "post")


def default_source_layers(target: ModelConfig) -> list[int]:
    """A middle and the last GDN layer of the target."""
    gdn = target.gdn_layers
    return sorted({gdn[len(gdn) // 2], gdn[-1]})


@dataclass
class ReadyConfig(DSparkConfig):
    source_layers: list[int] = field(default_factory=list)  # target GDN layers whose committed S is read
    num_v_heads: int = 1  # the target's GDN state shape: HV value heads of K x V
    head_k_dim: int = 1
    head_v_dim: int = 1
    reader_rank: int | None = 8  # None: full rank (no query bottleneck, no value map)
    inject_layers: list[int] = field(default_factory=list)  # draft layers that add the read (default: the last)
    inject_site: str = "post"  # "post": after the layer's attention; "pre": before it

    def __post_init__(self):
        if self.reader_rank == "full":
            self.reader_rank = None
        if not self.inject_layers:
            self.inject_layers = [self.num_layers - 1]

    @classmethod
    def from_dspark(cls, base: DSparkConfig, target: ModelConfig, **over) -> "ReadyConfig":
        kw = dict(dataclasses.asdict(base), source_layers=default_source_layers(target),
                  num_v_heads=target.num_v_heads, head_k_dim=target.head_dim, head_v_dim=target.head_v_dim)
        kw.update(over)
        return cls(**kw)

    @classmethod
    def for_target(cls, target: ModelConfig, **over) -> "ReadyConfig":
        reader = {k: over.pop(k) for k in ("source_layers", "reader_rank", "inject_layers", "inject_site")
                  if k in over}
        return cls.from_dspark(DSparkConfig.for_target(target, **over), target, **reader)

    def check(self, target: ModelConfig) -> None:
        super().check(target)
        gdn = set(target.gdn_layers)
        bad = [i for i in self.source_layers if i not in gdn]
        if bad or not self.source_layers:
            raise CheckpointError(f"the reader's source layer {bad[0] if bad else '(none)'} is not a GDN layer of the "
                                  f"target (GDN layers: {sorted(gdn)})")
        if (self.num_v_heads, self.head_k_dim, self.head_v_dim) != (target.num_v_heads, target.head_dim,
                                                                    target.head_v_dim):
            raise CheckpointError(f"the reader reads states of {self.num_v_heads} heads of {self.head_k_dim}x"
                                  f"{self.head_v_dim}; the target's are {target.num_v_heads} of "
                                  f"{target.head_dim}x{target.head_v_dim}")
        self.validate()

    def validate(self) -> None:
        if self.inject_site not in SITES:
            raise CheckpointError(f"inject_site must be one of {SITES}, got {self.inject_site!r}")
        if any(not 0 <= i < self.num_layers for i in self.inject_layers):
            raise CheckpointError(f"injection layers {self.inject_layers} outside the drafter's {self.num_layers}")
        if self.reader_rank is not None and self.reader_rank < 1:
            raise CheckpointError(f"reader rank must be positive (or None: full), got {self.reader_rank}")


class StateReader(nn.Module):
    """One injection site's reader: draft representations [N, P, D] -> residual [N, P, D]."""

    def __init__(self, cfg: ReadyConfig):
        super().__init__()
        D, P, eps = cfg.hidden_size, cfg.block_size, cfg.norm_eps
        L, HV, K, V, r = len(cfg.source_layers), cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.reader_rank
        self.shape = (L, HV, K)
        self.norm = RMSNorm(D, eps)
        if r is None:
            self.down = None
            self.up = nn.Linear(D, L * HV * K, bias=False)
            self.pos_query = nn.Parameter(torch.zeros(P, L * HV * K))
            self.value_map = None
            R = V
        else:
            self.down = nn.Linear(D, r, bias=False)
            self.pos_query = nn.Parameter(torch.randn(P, r) * r ** -0.5)
            self.up = nn.Linear(r, L * HV * K, bias=False)
            self.value_map = nn.Parameter(torch.randn(L, V, r) * V ** -0.5)
            R = r
        self.read_norm = RMSNorm(R, eps)
        self.out = nn.Linear(L * HV * (R + 1), D, bias=False)
        nn.init.zeros_(self.out.weight)  # starts as the DSpark drafter it extends

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[N, P, D] -> [N, P, L, HV, K]."""
        z = self.norm(x)
        z = self.up(z) + self.pos_query[: x.shape[1]].to(x.dtype) if self.down is None else \
            self.up(self.down(z) + self.pos_query[: x.shape[1]].to(x.dtype))
        return z.reshape(*x.shape[:2], *self.shape)

    def forward(self, x: torch.Tensor, read) -> torch.Tensor:
        reads, sqn = read(self.queries(x), self.value_map)  # [N, P, L, HV, R], [N, L, HV]
        r = self.read_norm(reads)
        scale = (0.5 * torch.log(sqn + 1e-6))[:, None, :, :, None].expand(*r.shape[:-1], 1)
        feat = torch.cat([r, scale.to(r.dtype)], -1).flatten(2)
        return self.out(feat.to(x.dtype))


class ReadyModel(DSparkModel):
    model_type = MODEL_TYPE

    def __init__(self, cfg: ReadyConfig):
        super().__init__(cfg)
        cfg.validate()
        self.readers = nn.ModuleDict({str(i): StateReader(cfg) for i in cfg.inject_layers})

    def inject(self, i, site, x, blocks, read):
        if read is None or site != self.cfg.inject_site or str(i) not in self.readers:
            return None
        B, N, D = x.shape
        return self.readers[str(i)](x.reshape(B * blocks, N // blocks, D), read).reshape(B, N, D)

    def reader_parameters(self) -> list[nn.Parameter]:
        return list(self.readers.parameters())

    @classmethod
    def from_dspark(cls, base: DSparkModel, target: ModelConfig, **over) -> "ReadyModel":
        """A ReaDy drafter whose backbone is `base`'s (weights copied) and whose reader is new."""
        cfg = ReadyConfig.from_dspark(base.cfg, target, **over)
        cfg.check(target)
        model = cls(cfg).to(device=next(base.parameters()).device, dtype=next(base.parameters()).dtype)
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("readers.") for k in missing), (missing, unexpected)
        return model


def _read_committed(states, pendings, trace, q, value_map):
    """The committed state read: pending accepted updates are applied (and written back: this
    read is their flush), then nothing is pending any more."""
    live = [i for i, p in enumerate(pendings) if p is not None]
    parts = [[pendings[i][j] for i in live] for j in range(4)]
    reads, sqn = reader_ops.committed_read(states, live, *parts, q, value_map)
    for n in parts[3]:
        n.zero_()
    if trace is not None:
        trace.append(tuple(None if t is None else t.detach().clone() for t in (q, value_map, reads, sqn)))
    return reads, sqn


class ReadyDrafter(DSparkDrafter):
    """`DSparkDrafter` whose blocks read the target's committed states (`ctx.cache`).

    trace: a list to which every read appends (queries, value map, reads, sqnorm) — for tests.
    """

    name = "ready"

    def __init__(self, model: ReadyModel, target: Model, **options):
        if not isinstance(model, ReadyModel):
            raise InputError("ReadyDrafter needs a ReadyModel (a DSpark model has no reader)")
        super().__init__(model, target, **options)
        self.sources = list(model.cfg.source_layers)
        self.trace: list | None = None

    def reader(self, cache):
        if cache is None:
            raise InputError("the ReaDy drafter reads the target's cache: pass DraftContext.cache")
        layers = [cache.layers[i] for i in self.sources]
        states = [st.S for st in layers]
        pendings = [st.pending for st in layers]

        return functools.partial(_read_committed, states, pendings, self.trace)

    def _graph_state(self, cache):
        bufs = []
        for i in self.sources:
            st = cache.layers[i]
            bufs.append(st.S.data_ptr())
            bufs.append(None if st.pending is None else tuple((t.data_ptr(), tuple(t.shape)) for t in st.pending))
        return super()._graph_state(cache) + tuple(bufs)
