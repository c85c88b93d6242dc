"""A small GPT-like Transformer, its world-size-independent initialisation, and synthetic data.

Everything here is deterministic in (seed, name) or (seed, step) and never in the world size, so a
run on 1 rank and a run on 3 ranks start from the same full weights and see the same global batches:
that is what lets the tests compare checkpoints saved on one world size and loaded on another.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`Transformer`. ``dim`` must be divisible by ``n_heads``."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    dropout: float = 0.0  # residual dropout after attention and MLP (drawn from the global CPU generator)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    def num_params(self) -> int:
        """Parameter count, without building the model (embeddings and head are not tied)."""
        d = self.dim
        per_layer = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
        return 2 * self.vocab_size * d + self.seq_len * d + self.n_layers * per_layer + 2 * d


#: ``tiny`` keeps dim 0 of most tensors indivisible by 3 and 4 (67, 34, 13; 136 by 3), so FSDP2's
#: ``torch.chunk`` sharding meets uneven shards on 2, 3 and 4 ranks. ``1g`` is ~83.9M parameters:
#: fp32 params + AdamW ``exp_avg`` + ``exp_avg_sq`` = 12 bytes/param, about 1.0 GB of state.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=67, dim=34, n_layers=2, n_heads=2, seq_len=13),
    "small": ModelConfig(vocab_size=2053, dim=256, n_layers=4, n_heads=4, seq_len=128),
    "1g": ModelConfig(vocab_size=8191, dim=768, n_layers=10, n_heads=12, seq_len=512),
}


class Attention(nn.Module):
    """Causal multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim)
        self.wk = nn.Linear(config.dim, config.dim)
        self.wv = nn.Linear(config.dim, config.dim)
        self.wo = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        # (B, T, D) -> (B, H, T, D/H), the layout sdpa expects.
        q, k, v = (
            proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
            for proj in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    """Two-layer MLP with a 4x hidden width and GELU."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, 4 * config.dim)
        self.w2 = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-LayerNorm residual block: attention, then MLP."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.dim)
        self.feed_forward = FeedForward(config)
        # no dropout module at all at 0: a model without dropout draws nothing from the generator
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    """GPT-like decoder: token ids ``(B, T)`` int64 -> logits ``(B, T, vocab_size)``.

    The blocks live in ``layers`` (an ``nn.ModuleList``), the unit FSDP2 shards one by one.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.seq_len, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's seq_len {self.config.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


def derive_seed(seed: int, tag: str) -> int:
    """A generator seed from ``seed`` and a name; stable across processes and Python runs.

    ``zlib.crc32`` rather than ``hash()``, which is salted per process. 32 bits on purpose: the CPU
    generator (mt19937) keeps only the low 32 bits of a seed, so packing ``seed`` into the high bits
    would make every seed draw the same numbers.
    """
    return zlib.crc32(f"{seed}/{tag}".encode("utf-8"))


def _full_init(name: str, owner: nn.Module, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name`` owned by module ``owner``."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if isinstance(owner, nn.LayerNorm) and leaf == "weight":
        return torch.ones(shape)
    if isinstance(owner, (nn.Linear, nn.Embedding)) and leaf == "weight":
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, name))
        return torch.empty(shape).normal_(mean=0.0, std=0.02, generator=gen)
    raise TypeError(f"init_weights: no rule for parameter {name!r} of {type(owner).__name__}")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Set every parameter from (seed, parameter name) alone, whatever the world size.

    Each full tensor is drawn on CPU and, for a DTensor parameter, only this rank's shard of it is
    kept. ``reset_parameters()`` after ``to_empty`` would instead draw the same *local* shard on every
    rank of a CPU mesh, so the full weights would depend on the world size.
    Raises ``TypeError`` for a parameter kind it has no rule for (a model this module did not build).
    """
    from ...compat import local_shard_box

    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else model
        full = _full_init(name, owner, param.shape, seed)
        # Every rank holds the same full tensor: each keeps its own box of it, no collective needed
        # (and no distribute_tensor(src_data_rank=), which torch < 2.7 lacks).
        local, (offsets, sizes) = local_shard_box(param)
        local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise TypeError(f"init_weights: no rule for buffers {buffers}")


def build_model(config: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Transformer:
    """A plain (unsharded) model with the same full weights as :func:`build_fsdp_model` on any mesh."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def build_fsdp_model(config: ModelConfig, mesh, seed: int, mixed_precision: bool = False) -> Transformer:
    """An FSDP2-sharded model on ``mesh`` (a 1-D DeviceMesh), initialised by :func:`init_weights`.

    The canonical order: build on ``meta``, ``fully_shard`` each block then the root, ``to_empty``,
    initialise. The device is CPU on a ``cpu`` mesh, else ``cuda:LOCAL_RANK`` (the current device).
    With ``mixed_precision`` compute runs in bf16 and gradients are reduced in fp32; the sharded
    parameters (and so the optimizer state and checkpoints) stay fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Transformer(config)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def synthetic_batch(step: int, batch_size: int, config: ModelConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``(inputs, targets)``, both ``(batch_size, seq_len)`` int64 on CPU.

    A function of (seed, step) only, so every world size and every resumed run sees the same data.
    Each row is an arithmetic sequence ``start + stride * t (mod vocab)`` with a random start and a
    stride from 1..4, which a model can learn from context, so the loss visibly falls.
    Targets are the inputs shifted by one token (next-token prediction).
    """
    if step < 0 or batch_size < 1:
        raise ValueError(f"need step >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, f"batch/{step}"))
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 5, (batch_size, 1), generator=gen)
    t = torch.arange(config.seq_len + 1).unsqueeze(0)
    tokens = (start + stride * t) % config.vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def local_batch(
    step: int, rank: int, world_size: int, batch_size: int, config: ModelConfig, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of :func:`synthetic_batch` (equal, contiguous slices in rank order).

    Raises ``ValueError`` when ``batch_size`` does not divide evenly over ``world_size``: equal local
    batches make the mean of local mean losses equal the global mean loss.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if batch_size % world_size:
        raise ValueError(f"global batch size {batch_size} is not divisible by world size {world_size}")
    inputs, targets = synthetic_batch(step, batch_size, config, seed)
    rows = batch_size // world_size
    part = slice(rank * rows, (rank + 1) * rows)
    return inputs[part].contiguous(), targets[part].contiguous()
