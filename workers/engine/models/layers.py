"""The blocks the native decoder families are built of: linear, rotary, attention, MLP, decoder layer, causal LM.

A step's rows are packed ([rows, hidden], no batch dimension, no padding;
see model_runner.py), and each block works on them as they are: one fused
QKV projection and one fused gate-up projection per layer, RMSNorm fused
with the residual add, rotary applied to all rows at once from a table of
angles, attention through the step's PagedBatch (attention.attend). A family
(llama.py, qwen2.py, qwen3.py) only says which of the options its config
turns on: biases, q/k norm, a tied head.

Parameters are allocated empty on their device in their dtype and filled
from the checkpoint (weights.py) through `checkpoint_tensors`, which names
each checkpoint tensor's place in them (a `Slot`): the fused projections'
parts are views of one weight, so a checkpoint's q, k and v land side by
side with no copy of the model in between.

Under tensor parallelism (parallel.py) each rank builds the same model with
its share of every layer: QKV and gate-up are column-parallel (each rank its
query and KV heads, its intermediate rows), o_proj and down_proj are
row-parallel (each rank its input columns, then one all-reduce), the
embedding and the head are vocabulary-parallel; a Slot then names the part
of the checkpoint tensor the rank reads, and nothing else of it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workers.engine.attention import PagedBatch, attend
from workers.engine.lora_rows import LoraRows
from workers.engine.models.lora import LoraPool
from workers.engine.models.ops import add_rms_norm, apply_rotary, rms_norm, silu_and_mul
from workers.engine.parallel import SINGLE, Span, TensorParallel

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class Shape:
    """What a family's config says of its layers."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    tied: bool  # the output head is the input embedding
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary (Qwen3)

    @classmethod
    def of(cls, config, **options) -> Shape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            eps=config.rms_norm_eps,
            tied=bool(config.tie_word_embeddings),
            **options,
        )


def _parameter(*size: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(size, device=device, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor, or the part of it this rank owns, is loaded: `target` (a view of our
    parameters) takes the checkpoint tensor of `shape` from `start` along `dim`, for target.shape[dim]."""

    target: torch.Tensor
    shape: tuple[int, ...]
    dim: int = 0
    start: int = 0

    @classmethod
    def whole(cls, target: torch.Tensor) -> Slot:
        return cls(target, tuple(target.shape))


class Linear(nn.Module):
    """y = x W^T + b, where W may be several checkpoint projections stacked along its rows (`parts`).

    Column-parallel where `parts` are shares of their rows; row-parallel where `inputs` is a share of the
    input columns: each rank's product is partial, summed by one all-reduce, and the bias added after it."""

    def __init__(
        self,
        inputs: int | Span,
        parts: dict[str, int | Span],
        bias: bool,
        device,
        dtype,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.inputs = inputs if isinstance(inputs, Span) else Span(inputs)
        # checkpoint name (relative to the layer) -> the span of its rows this rank holds
        self.parts = {name: rows if isinstance(rows, Span) else Span(rows) for name, rows in parts.items()}
        self._parallel = parallel if not self.inputs.whole else SINGLE  # row-parallel: reduce
        outputs = sum(rows.size for rows in self.parts.values())
        self.weight = _parameter(outputs, self.inputs.size, device=device, dtype=dtype)
        self.bias = _parameter(outputs, device=device, dtype=dtype) if bias else None
        self.lora: LoraPool | None = None  # enable_lora's

    def forward(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        """`lora`: the step's rows by adapter slot, where the model serves adapters (models/lora.py)."""
        if self._parallel.size == 1:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self._parallel.all_reduce(F.linear(x, self.weight))
            y = y if self.bias is None else y + self.bias
        if lora is not None and self.lora is not None:
            self.lora.add(y, x, lora)
        return y

    def enable_lora(self, slots: int, rank: int) -> None:
        """A pool of `slots` adapters of rank up to `rank` for each of this projection's parts."""
        parts, first = {}, 0
        for name, rows in self.parts.items():
            parts[name], first = (first, rows.size), first + rows.size
        self.lora = LoraPool(slots, rank, self.inputs.size, parts, self.weight.device, self.weight.dtype)

    def checkpoint_tensors(self, prefix: str) -> dict[str, Slot]:
        tensors, start = {}, 0
        for name, rows in self.parts.items():
            name = f"{prefix}.{name}" if prefix else name
            weight = self.weight.narrow(0, start, rows.size)
            if self.inputs.whole:
                tensors[f"{name}.weight"] = Slot(weight, (rows.total, self.inputs.total), 0, rows.start)
            else:
                tensors[f"{name}.weight"] = Slot(weight, (rows.total, self.inputs.total), 1, self.inputs.start)
            if self.bias is not None:
                tensors[f"{name}.bias"] = Slot(self.bias.narrow(0, start, rows.size), (rows.total,), 0, rows.start)
            start += rows.size
        return tensors


class Rotary:
    """cos and sin of every position's angles, float32 [positions, head_dim / 2], as transformers computes them.

    `dynamic` (NTK) keeps the original frequencies up to the original length,
    as transformers does; past it each position gets the frequencies
    transformers uses when it decodes at that position (its own prompt rows
    there use the prompt's length instead).
    """

    def __init__(self, config, head_dim: int, device: torch.device) -> None:
        parameters = config.rope_parameters
        self.rope_type = parameters.get("rope_type", "default")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r}: the native models compute {', '.join(ROPE_TYPES)}; "
                "--model-impl transformers serves the others"
            )
        self._config, self._dim, self._device = config, head_dim, device
        if self.rope_type == "default":
            self._inv_freq = 1.0 / (
                parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
            )
            self._scaling = 1.0
        else:
            self._inv_freq, self._scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config, device)
        self._inv_freq = self._inv_freq.to(device, torch.float)
        self.cos = self.sin = torch.empty(0, head_dim // 2, device=device)
        self.reserve(config.max_position_embeddings)

    def reserve(self, positions: int) -> None:
        """Tables for positions [0, positions) at least (grown before a step can reach them, never within one)."""
        if positions <= self.cos.shape[0]:
            return
        angles = torch.arange(positions, device=self._device).float()[:, None] * self._inv_freq
        original = self._config.max_position_embeddings
        if self.rope_type == "dynamic" and positions > original:
            past = torch.arange(original, positions, device=self._device)
            angles[original:] = past.float()[:, None] * self._grown(positions)
        self.cos = angles.cos() * self._scaling
        self.sin = angles.sin() * self._scaling

    def _grown(self, positions: int) -> torch.Tensor:
        """Dynamic NTK's frequencies at each position past the original length, [positions past, dim / 2]."""
        parameters, dim, original = self._config.rope_parameters, self._dim, self._config.max_position_embeddings
        lengths = torch.arange(original + 1, positions + 1, device=self._device, dtype=torch.float64)
        factor = parameters["factor"]
        base = parameters["rope_theta"] * ((factor * lengths / original) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=self._device).float() / dim
        return 1.0 / (base.float()[:, None] ** exponents)


class Attention(nn.Module):
    def __init__(self, shape: Shape, layer: int, rotary: Rotary, device, dtype, parallel: TensorParallel) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary
        dim = shape.head_dim
        heads, kv_heads = parallel.split(shape.heads, "attention heads"), parallel.kv_heads(shape.kv_heads)
        self.heads, self.kv_heads, self.head_dim = heads.size, kv_heads.size, dim
        self.scaling = dim**-0.5
        q = Span(shape.heads * dim, heads.start * dim, heads.size * dim)
        kv = Span(shape.kv_heads * dim, kv_heads.start * dim, kv_heads.size * dim)
        self.qkv_proj = Linear(shape.hidden, {"q_proj": q, "k_proj": kv, "v_proj": kv}, shape.qkv_bias, device, dtype)
        self.o_proj = Linear(q, {"o_proj": shape.hidden}, shape.o_bias, device, dtype, parallel)
        self.eps = shape.eps
        self.q_norm = _parameter(shape.head_dim, device=device, dtype=dtype) if shape.qk_norm else None
        self.k_norm = _parameter(shape.head_dim, device=device, dtype=dtype) if shape.qk_norm else None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, paged: PagedBatch, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every row's keys and values go to the cache; only the `kept` rows' output is projected (all: None)."""
        rows, dim = x.shape[0], self.head_dim
        lora = paged.lora
        q, k, v = self.qkv_proj(x, lora).split([self.heads * dim, self.kv_heads * dim, self.kv_heads * dim], dim=-1)
        q, k, v = q.view(rows, self.heads, dim), k.view(rows, self.kv_heads, dim), v.view(rows, self.kv_heads, dim)
        if self.q_norm is not None:
            q = rms_norm(q.reshape(-1, dim), self.q_norm, self.eps).view(rows, self.heads, dim)
            k = rms_norm(k.reshape(-1, dim), self.k_norm, self.eps).view(rows, self.kv_heads, dim)
        q, k = apply_rotary(q, k, positions, self.rotary.cos, self.rotary.sin)
        out = attend(paged, self.layer, q, k, v, self.scaling).view(rows, self.heads * dim)
        if kept is None:
            return self.o_proj(out, lora)
        return self.o_proj(out[kept], lora.select(kept) if lora is not None else None)

    def checkpoint_tensors(self, prefix: str) -> dict[str, Slot]:
        tensors = self.qkv_proj.checkpoint_tensors(prefix) | self.o_proj.checkpoint_tensors(prefix)
        if self.q_norm is not None:
            tensors[f"{prefix}.q_norm.weight"] = Slot.whole(self.q_norm)
            tensors[f"{prefix}.k_norm.weight"] = Slot.whole(self.k_norm)
        return tensors


class MLP(nn.Module):
    def __init__(self, shape: Shape, device, dtype, parallel: TensorParallel) -> None:
        super().__init__()
        rows = parallel.split(shape.intermediate, "MLP intermediate size")
        self.gate_up_proj = Linear(shape.hidden, {"gate_proj": rows, "up_proj": rows}, shape.mlp_bias, device, dtype)
        self.down_proj = Linear(rows, {"down_proj": shape.hidden}, shape.mlp_bias, device, dtype, parallel)

    def forward(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, lora)), lora)

    def checkpoint_tensors(self, prefix: str) -> dict[str, Slot]:
        return self.gate_up_proj.checkpoint_tensors(prefix) | self.down_proj.checkpoint_tensors(prefix)


class DecoderLayer(nn.Module):
    def __init__(self, shape: Shape, layer: int, rotary: Rotary, device, dtype, parallel: TensorParallel) -> None:
        super().__init__()
        self.eps = shape.eps
        self.input_layernorm = _parameter(shape.hidden, device=device, dtype=dtype)
        self.self_attn = Attention(shape, layer, rotary, device, dtype, parallel)
        self.post_attention_layernorm = _parameter(shape.hidden, device=device, dtype=dtype)
        self.mlp = MLP(shape, device, dtype, parallel)

    def forward(self, x, residual, positions, paged, kept=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the next norm adds them. With
        `kept`, row indices, the output and residual of those rows only: after the attention no row depends
        on another, so a last layer computes its projections and MLP for the rows whose states are wanted."""
        h, residual = add_rms_norm(x, residual, self.input_layernorm, self.eps)
        attended = self.self_attn(h, positions, paged, kept)
        h, residual = add_rms_norm(
            attended, residual if kept is None else residual[kept], self.post_attention_layernorm, self.eps
        )
        lora = paged.lora if kept is None or paged.lora is None else paged.lora.select(kept)
        return self.mlp(h, lora), residual

    def checkpoint_tensors(self, prefix: str) -> dict[str, Slot]:
        return {
            f"{prefix}.input_layernorm.weight": Slot.whole(self.input_layernorm),
            f"{prefix}.post_attention_layernorm.weight": Slot.whole(self.post_attention_layernorm),
            **self.self_attn.checkpoint_tensors(f"{prefix}.self_attn"),
            **self.mlp.checkpoint_tensors(f"{prefix}.mlp"),
        }


class VocabEmbedding(nn.Module):
    """The input embedding. Vocabulary-parallel, each rank looks up the ids among its rows (zero for the
    others), and an all-reduce sums the ranks' lookups."""

    def __init__(self, rows: Span, hidden: int, device, dtype, parallel: TensorParallel) -> None:
        super().__init__()
        self.rows, self._parallel = rows, parallel
        self.weight = _parameter(rows.size, hidden, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows.whole:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        found = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        return self._parallel.all_reduce(found)


class CausalLM(nn.Module):
    """A decoder-only model on packed rows; a family subclasses it and says its Shape's options (`options`).
    With `parallel`, this rank's share of it (the module docstring says which)."""

    implementation = "native"

    def __init__(self, config, device: torch.device, dtype: torch.dtype, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel
        self.shape = shape = Shape.of(config, **self.options(config))
        self.rotary = Rotary(config, shape.head_dim, device)
        self.vocabulary = parallel.vocabulary(shape.vocab)  # the embedding's and the head's rows on this rank
        self.embed_tokens = VocabEmbedding(self.vocabulary, shape.hidden, device, dtype, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, i, self.rotary, device, dtype, parallel) for i in range(shape.layers)
        )
        self.norm = _parameter(shape.hidden, device=device, dtype=dtype)
        self.lm_head = Linear(shape.hidden, {"lm_head": self.vocabulary}, False, device, dtype)
        if shape.tied:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def options(cls, config) -> dict:
        """The Shape options (biases, q/k norm) this family's config turns on."""
        return {}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_attention_heads(self) -> int:
        return self.shape.heads

    def get_input_embeddings(self) -> VocabEmbedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> Linear:
        return self.lm_head

    def projections(self, layer: DecoderLayer) -> tuple[Linear, ...]:
        """The layer's projections an adapter may target."""
        return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def enable_lora(self, slots: int, rank: int) -> None:
        """Pools of `slots` adapters of rank up to `rank` in every projection (models/lora.py)."""
        if self.parallel.size > 1:
            raise ValueError("LoRA adapters are not served on a model split across ranks (--tensor-parallel-size)")
        for layer in self.layers:
            for projection in self.projections(layer):
                projection.enable_lora(slots, rank)

    def lora_modules(self) -> dict[str, tuple[int, int]]:
        """Each projection an adapter may target: (inputs, outputs)."""
        shape = self.shape
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        return {
            "q_proj": (shape.hidden, q),
            "k_proj": (shape.hidden, kv),
            "v_proj": (shape.hidden, kv),
            "o_proj": (q, shape.hidden),
            "gate_proj": (shape.hidden, shape.intermediate),
            "up_proj": (shape.hidden, shape.intermediate),
            "down_proj": (shape.intermediate, shape.hidden),
        }

    def write_lora(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], scaling: float):
        """Put an adapter's (layer, module) -> (A, B) into `slot` of every projection (zeros where it has none)."""
        for index, layer in enumerate(self.layers):
            for projection in self.projections(layer):
                parts = {name: weights[index, name] for name in projection.parts if (index, name) in weights}
                projection.lora.write(slot, parts, scaling)

    def reserve(self, positions: int) -> None:
        """Make ready for positions [0, positions): the engine's longest sequence."""
        self.rotary.reserve(positions)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def hidden_states(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        paged: PagedBatch,
        embeddings: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last hidden states of a step's packed rows, [rows, hidden], or of the `rows` asked for, in their
        order (a prompt chunk wants its last row's alone); `embeddings` in place of the ids'."""
        x, residual = (self.embed(ids) if embeddings is None else embeddings), None
        *first, last = self.layers
        for layer in first:
            x, residual = layer(x, residual, positions, paged)
        x, residual = last(x, residual, positions, paged, rows)
        return add_rms_norm(x, residual, self.norm, self.shape.eps)[0]

    def checkpoint_tensors(self) -> dict[str, Slot]:
        """Each tensor a checkpoint holds, by its name there: the view of our parameters it (or this rank's part
        of it) is loaded into."""
        rows, hidden = self.vocabulary, self.shape.hidden
        tensors = {
            "model.embed_tokens.weight": Slot(self.embed_tokens.weight, (rows.total, hidden), 0, rows.start),
            "model.norm.weight": Slot.whole(self.norm),
        }
        for index, layer in enumerate(self.layers):
            tensors |= layer.checkpoint_tensors(f"model.layers.{index}")
        if not self.shape.tied:
            tensors |= self.lm_head.checkpoint_tensors("")
        return tensors

    def ignores(self, name: str) -> bool:
        """Checkpoint tensors that are none of ours and need not be: a tied model's copy of its head, and the
        rotary frequencies older checkpoints saved."""
        return (self.shape.tied and name == "lm_head.weight") or name.endswith(".rotary_emb.inv_freq")
