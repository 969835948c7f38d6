"""Load a Hugging Face causal LM and run one engine step over a packed batch.

A step's tokens (one per decoding sequence, a chunk per prompt) are packed
into a single row with their positions, so that every linear layer runs once
for the whole batch, with no padding; `attention.paged_attention` keeps each
sequence to its own cached keys and values. Logits are computed only for the
rows a token is drawn from, by the output head.
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass

import structlog
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.bundled import DTYPE_NAMES
from workers.engine.attention import IMPLEMENTATION, DecodeGroup, PagedBatch, PromptChunk, decode_kernel
from workers.engine.output_head import OutputHead
from workers.engine.scheduler import Chunk

log = structlog.get_logger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
_CPU_KV_CACHE_BYTES = 1 << 30
# Decoding sequences are grouped so that the longest of a group is at most this
# many times its shortest; fewer than _GROUP_MIN sequences stay in one group.
_GROUP_SPREAD = 1.6
_GROUP_MIN = 8  # 1 GiB when not told otherwise
_GPU_KV_CACHE_SHARE = 0.8  # of the memory left free after loading the model


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_position_embeddings: int
    eos_token_ids: frozenset[int]


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_model(path: str, device: str = "auto", dtype: str | None = None) -> LoadedModel:
    """Load from a local directory or a hub id: bf16 on CUDA, fp32 on the CPU, unless `dtype` says otherwise."""
    target = pick_device(device)
    chosen = DTYPES[dtype] if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    transformers.utils.logging.disable_progress_bar()  # our logs are JSON lines
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=chosen).to(target).eval()
    return _loaded(model, tokenizer, target, str(path))


def random_model(config: transformers.PretrainedConfig, tokenizer, device: str = "auto", dtype: str | None = None):
    """A randomly initialised model of `config`, for timing where no weights are at hand."""
    target = pick_device(device)
    chosen = DTYPES[dtype] if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    with torch.device(target):  # a copy of the config: the engine sets its attention on the model's own
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=chosen).eval()
    return _loaded(model, tokenizer, target, f"random {config.model_type}")


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of returning it to the system.

    Every step allocates and frees tensors of megabytes; by default glibc
    serves those with fresh mmaps whose pages fault in on first touch, which
    tripled the time of a decode step here. Process-wide; a no-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def _loaded(model, tokenizer, device: torch.device, source: str) -> LoadedModel:
    if device.type == "cpu":
        keep_freed_memory()
    config = model.config
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None:
        eos = tokenizer.eos_token_id
    log.info("model_loaded", source=source, device=str(device), dtype=str(model.dtype), vocab_size=config.vocab_size)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        vocab_size=config.vocab_size,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 1024 * 1024,
        eos_token_ids=frozenset([eos] if isinstance(eos, int) else (eos or [])),
    )


class ModelRunner:
    def __init__(self, loaded: LoadedModel, block_size: int, kv_cache_bytes: int | None = None) -> None:
        self._model = loaded.model
        self._device = loaded.device
        self.block_size = block_size
        config = self._model.config
        self._model.set_attn_implementation(IMPLEMENTATION)
        self.head = OutputHead(self._model.get_output_embeddings())
        kv_heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = self._model.dtype
        bytes_per_block = 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * dtype.itemsize
        self.num_blocks = max(1, (kv_cache_bytes or self._default_kv_bytes()) // bytes_per_block)
        shape = (kv_heads, self.num_blocks, block_size, head_dim)  # see attention.py for why
        self._kv = [
            (torch.zeros(shape, dtype=dtype, device=self._device), torch.zeros(shape, dtype=dtype, device=self._device))
            for _ in range(config.num_hidden_layers)
        ]
        log.info(
            "kv_cache_allocated", blocks=self.num_blocks, block_size=block_size, tokens=self.num_blocks * block_size
        )

    def _default_kv_bytes(self) -> int:
        if self._device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self._device)
            return int(free * _GPU_KV_CACHE_SHARE)
        return _CPU_KV_CACHE_BYTES

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """Compute the chunks; the last hidden state of each chunk that samples [chunks, hidden], in order.

        `self.head` turns those into logits or tokens.
        """
        size = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prompts: list[PromptChunk] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            sequence, row = chunk.sequence, len(ids)
            start = sequence.num_cached_tokens
            end = start + chunk.num_tokens
            ids.extend(sequence.tokens(start, end))
            positions.extend(range(start, end))
            table = sequence.block_table
            slots.extend(table[p // size] * size + p % size for p in range(start, end))
            used_blocks = table[: -(-end // size)]
            if chunk.num_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(used_blocks)
                decode_lengths.append(end)
            elif start == 0:
                prompts.append(PromptChunk(row, row + chunk.num_tokens, None, None))
            else:
                queries = torch.arange(start, end, device=self._device).unsqueeze(1)
                keys = torch.arange(len(used_blocks) * size, device=self._device).unsqueeze(0)
                blocks = torch.tensor(used_blocks, device=self._device)
                prompts.append(PromptChunk(row, row + chunk.num_tokens, blocks, (keys <= queries)[None, None]))
            if chunk.samples:
                sample_rows.append(row + chunk.num_tokens - 1)
        batch = PagedBatch(
            kv=self._kv,
            slots=torch.tensor(slots, device=self._device),
            decodes=self._decode_groups(decode_rows, decode_tables, decode_lengths) if decode_rows else [],
            prompts=prompts,
        )
        hidden = self._model.model(
            input_ids=torch.tensor([ids], device=self._device),
            position_ids=torch.tensor([positions], device=self._device),
            use_cache=False,
            paged=batch,
        ).last_hidden_state
        return hidden[0, sample_rows]

    def _decode_groups(self, rows: list[int], tables: list[list[int]], lengths: list[int]) -> list[DecodeGroup]:
        """The decoding sequences: one group for the CPU kernel, else groups of similar lengths,
        so that little of each gather is padding."""
        if self._device.type == "cpu" and decode_kernel() is not None:
            return [self._decode_group(rows, tables, lengths, masked=False)]
        order = sorted(range(len(rows)), key=lengths.__getitem__)
        groups = [[order[0]]]
        for index in order[1:]:
            if len(order) >= _GROUP_MIN and lengths[index] > _GROUP_SPREAD * lengths[groups[-1][0]]:
                groups.append([index])
            else:
                groups[-1].append(index)
        return [
            self._decode_group([rows[i] for i in g], [tables[i] for i in g], [lengths[i] for i in g], masked=True)
            for g in groups
        ]

    def _decode_group(self, rows: list[int], tables: list[list[int]], lengths: list[int], masked: bool) -> DecodeGroup:
        width = max(len(t) for t in tables)
        padded = torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], device=self._device)
        counts = torch.tensor(lengths, device=self._device)
        mask = None
        if masked:
            visible = torch.arange(width * self.block_size, device=self._device).unsqueeze(0)
            mask = (visible < counts.unsqueeze(1))[None, :, None, :]
        return DecodeGroup(rows=torch.tensor(rows, device=self._device), tables=padded, lengths=counts, mask=mask)
