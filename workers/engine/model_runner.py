"""Run one engine step over a packed batch, on the CPU or a GPU.

A step's tokens (one per decoding sequence, a chunk per prompt) are packed
into a single row with their positions, decoding sequences first, so that
every linear layer runs once for the whole batch, with no padding;
`attention.attend` keeps each sequence to its own cached keys and values.
The model is the engine's own (models/) or transformers' (LoadedModel.decoder).
What the device needs of a step goes up in one copy. On a GPU, a step that
only decodes replays a CUDA graph (cuda_graphs.py), and the KV
cache gets a share of the memory left once the weights, the largest step's
work and the graphs have theirs, a draft model's too (draft.py). Logits are
computed only for the rows a token is drawn from, by the output head, and
for the prompt rows of requests that ask for their prompt's
log-probabilities; an embed request's rows are pooled instead (pooling.py),
from any step, graphed or not. For a vision-language model, the step's
images are encoded first (vision.py) and their features take the place of
their placeholder tokens' embeddings.

A tensor-parallel model (parallel.py) has a runner on every rank, each with
the cache of its own KV heads. They are built together (every rank runs the
constructor, its collectives in the same order: the cache's size, the
graphs); then rank 0's runner is the engine's, and before each step it
broadcasts what every rank needs of it, the step packed into one tensor of
int64 (`_pack`), to the others, which run it as it does (`follow_step`,
driven by ranks.py). Its sampler's logits come from every rank's share of
the head (output_head.GatheredHead).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog
import torch

from schemas.adapters import LoraSupport
from schemas.messages import SamplingParams
from workers.engine.adapters import Adapters, HostAdapter, load_adapter
from workers.engine.attention import KERNELS, PagedBatch, PromptChunk, kernels_for
from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import Capture, DecodeGraphs, cuda_graph_capture
from workers.engine.grammar import allowed_tokens
from workers.engine.lora_rows import LoraRows
from workers.engine.output_head import GatheredHead, OutputHead
from workers.engine.parallel import OP_CLOSE, OP_LOGITS, OP_RUNNER, OP_STEP, SINGLE, TensorParallel
from workers.engine.pooled_rows import PooledRows
from workers.engine.sampler import Draw, DrawBatch, choose, sample, score
from workers.engine.scheduler import Chunk
from workers.engine.step_output import Scored, StepOutput
from workers.engine.transfer import to_device

log = structlog.get_logger(__name__)
_GIB = 2**30


class RunnerModel(Protocol):
    """What a runner needs of a loaded model: model_loader's LoadedModel, which builds its runners with this
    module (so this one names it by what it does, not by import)."""

    model: torch.nn.Module
    parallel: TensorParallel
    device: torch.device
    vocab_size: int
    eos_token_ids: frozenset[int]

    def decoder(self): ...

    def vision(self): ...


@dataclass(frozen=True)
class StepLayout:
    """A step as the device sees it: packed rows, decoding sequences first, then prompt chunks."""

    ids: list[int]
    positions: list[int]
    slots: list[int]  # each token's cache slot
    tables: list[list[int]]  # per decoding row, then per prompt chunk: the blocks it reads
    lengths: list[int]  # per decoding row, then per prompt chunk: the tokens it attends to (this step's included)
    decodes: int  # rows decoding one token each, [0, decodes): a sequence's last token, and its proposed ones
    query_starts: list[int]  # chunk c is rows [query_starts[c], query_starts[c + 1]); [] without chunks
    sample_rows: list[int]  # the row each drawn token comes from, in the chunks' order
    first_rows: list[int] = field(default_factory=list)  # each chunk's first row, in the chunks' order
    mrope: list[list[int]] | None = None  # 3-D rotary models, in steps with prompt tokens: 3 rows of positions
    image_rows: list[int] = field(default_factory=list)  # rows whose embedding is an image's feature
    image_features: list[torch.Tensor] = field(default_factory=list)  # theirs, in row order
    lora_slots: list[int] = field(default_factory=list)  # each row's adapter slot (-1: none); [] if no row has one


_SCORED_ROWS = 256  # prompt rows scored at once: their float32 logits are rows x vocabulary


def layout_step(chunks: list[Chunk], block_size: int) -> StepLayout:
    order = [i for i, c in enumerate(chunks) if c.num_tokens == 1] + [
        i for i, c in enumerate(chunks) if c.num_tokens > 1
    ]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    lengths: list[int] = []
    query_starts: list[int] = []
    first_rows = [0] * len(chunks)
    mrope: list[tuple[int, list[list[int]]]] = []  # (first row, 3 rows of positions) of chunks with prompt tokens
    image_rows: list[int] = []
    image_features: list[torch.Tensor] = []
    adapted = any(c.sequence.lora_slot >= 0 for c in chunks)
    lora_slots: list[int] = []
    for index in order:
        chunk = chunks[index]
        sequence, row = chunk.sequence, len(ids)
        start = sequence.num_cached_tokens
        end = start + chunk.rows  # proposed tokens (speculation.py) follow the sequence's own
        ids.extend(sequence.tokens(start, start + chunk.num_tokens))
        ids.extend(chunk.proposed)
        images, prompt_length = sequence.images, len(sequence.prompt_ids)
        delta = images.rope_delta if images is not None else 0
        positions.extend(range(start + delta, end + delta))
        if images is not None and start < prompt_length:
            if images.mrope is not None:
                mrope.append((row, images.positions(start, end, prompt_length)))
            for prompt_index, feature_row, count in images.feature_rows(start, end):
                image_rows.extend(range(row + prompt_index - start, row + prompt_index - start + count))
                image_features.append(images.features[feature_row : feature_row + count])
        table = sequence.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        if chunk.num_tokens > 1:  # a prompt chunk: its rows attend causally, as one query
            tables.append(table[: -(-end // block_size)])
            lengths.append(end)
            query_starts.append(row)
        else:  # decoding: a row per token, each attending to the cache up to itself (its proposals' too)
            for length in range(start + 1, end + 1):
                tables.append(table[: -(-length // block_size)])
                lengths.append(length)
        if adapted:
            lora_slots.extend([sequence.lora_slot] * chunk.rows)
        first_rows[index] = row
    decodes = len(lengths) - len(query_starts)  # rows decoding, each with its own table and length
    if query_starts:
        query_starts.append(len(ids))
    # A drawing chunk's last token's row, and each proposed token's: the target's token is drawn after each.
    sample_rows = [
        row
        for i, c in enumerate(chunks)
        if c.samples
        for row in range(first_rows[i] + c.num_tokens - 1, first_rows[i] + c.rows)
    ]
    three_rows = None
    if mrope:  # the other rows' three positions are equal
        three_rows = [list(positions) for _ in range(3)]
        for row, rows in mrope:
            for axis in range(3):
                three_rows[axis][row : row + len(rows[axis])] = rows[axis]
    return StepLayout(
        ids,
        positions,
        slots,
        tables,
        lengths,
        decodes,
        query_starts,
        sample_rows,
        first_rows,
        three_rows,
        image_rows,
        image_features,
        lora_slots,
    )


@dataclass(frozen=True)
class PromptScoring:
    """The rows of a step whose next token is a prompt token, for requests that ask for prompt log-probabilities."""

    rows: list[int]
    targets: list[int]  # the prompt token each row predicts
    tops: list[int]  # alternatives each row lists
    spans: list[tuple[str, int]]  # (request id, its rows), in row order

    @classmethod
    def of(cls, chunks: list[Chunk], step: StepLayout) -> PromptScoring:
        rows: list[int] = []
        targets: list[int] = []
        tops: list[int] = []
        spans: list[tuple[str, int]] = []
        for chunk, first_row in zip(chunks, step.first_rows, strict=True):
            sequence = chunk.sequence
            top = sequence.request.sampling.prompt_logprobs
            start = sequence.num_cached_tokens
            end = min(start + chunk.num_tokens, len(sequence.prompt_ids) - 1)  # the last predicts no prompt token
            if top is None or end <= start:
                continue
            rows.extend(range(first_row, first_row + end - start))
            targets.extend(sequence.prompt_ids[start + 1 : end + 1])
            tops.extend([top] * (end - start))
            spans.append((sequence.request_id, end - start))
        return cls(rows, targets, tops, spans)


@dataclass(frozen=True)
class PackedStep:
    """A step as every rank needs it: one int64 tensor, and the header that says how it divides.

    Each part starts 16 bytes aligned (padded to an even length), whatever the sizes before it: Triton
    compiles a kernel once per alignment of each pointer it is given (triton_attention.py), so a part whose
    alignment followed the parity of the sizes before it would compile a new variant of each kernel that
    reads it, within the step that first met it.
    """

    # replay (0/1), decodes, block tables' width, then the size of each part of `flat`: ids, positions, slots,
    # lengths, sample_rows, query_starts, the prefill kernel's tiles, block tables, image_rows, lora_slots, then
    # mrope's
    header: list[int]
    flat: torch.Tensor  # on the device
    host: torch.Tensor | None  # the same on the CPU, where the prompt chunks' masks are built from it

    @property
    def replay(self) -> bool:
        return bool(self.header[0])

    @property
    def decodes(self) -> int:
        return self.header[1]

    @property
    def width(self) -> int:
        return self.header[2]

    @property
    def sizes(self) -> list[int]:
        return self.header[3:]

    def parts(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """`flat` or `host` cut into its parts, without their padding."""
        padded = packed.split([_aligned(size) for size in self.sizes])
        return [part[:size] for part, size in zip(padded, self.sizes, strict=True)]


def _aligned(size: int) -> int:
    """The int64 elements a part of `size` takes in a PackedStep: a multiple of 16 bytes."""
    return size + size % 2


_TEXT_STEP_HEADER = 13  # replay, decodes, width and ten sizes


@dataclass(frozen=True)
class KVGeometry:
    """What a model keeps per cached token: keys and values of every layer."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    heads: int  # query heads

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVGeometry:
        """Of this rank's heads: a tensor-parallel rank caches only its KV heads'."""
        config = model.config.get_text_config()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        parallel = getattr(model, "parallel", SINGLE)
        if parallel.size > 1:
            heads, kv_heads = parallel.split(heads, "attention heads").size, parallel.kv_heads(kv_heads).size
        return cls(config.num_hidden_layers, kv_heads, head_dim, model.dtype.itemsize, heads)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize


def current_cuda_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` made the calling thread's current CUDA device, where it names one. Triton launches a kernel on
    the current device and its current stream, not on its tensors' device, and a CUDA graph is captured on the
    current device too: work for cuda:1 launched while cuda:0 is current reads device 1's memory from device 0.
    An unnumbered "cuda" is the current device already; the CPU has none."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class DeviceMemory:
    """What a model runner takes of its GPU beyond its weights, as the sizing of KV caches counts it."""

    bytes_per_token: int  # of its KV cache
    step: int  # its largest eager step's peak: freed after the step, and reused by the next, another runner's too
    graphs: int  # its decode graphs' pool, held (0: none)


def gpu_kv_cache_tokens(free: int, fraction: float, target: DeviceMemory, draft: DeviceMemory | None = None) -> int:
    """Tokens a KV cache holds on a GPU with `free` bytes left by the weights (a draft model's too): `fraction` of
    what the steps leave, which a draft model's cache (draft.py), of as many tokens, shares. The models step one
    after the other, so the larger step's memory serves both; each holds its graphs. (vLLM divides the memory
    it profiles in the same way between a target's cache and its draft's, which have as many blocks.)"""
    runners = [target] if draft is None else [target, draft]
    working = max(runner.step for runner in runners) + sum(runner.graphs for runner in runners)
    return int(fraction * (free - working)) // sum(runner.bytes_per_token for runner in runners)


class ModelRunner:
    def __init__(
        self,
        loaded: RunnerModel,
        config: EngineConfig,
        capture: Capture | None = None,
        draft: RunnerModel | None = None,
    ) -> None:
        """`config` with its device defaults filled in; `capture`: how decode graphs are captured
        (default: CUDA graphs on a GPU, none on the CPU); `draft`: a draft model (draft.py) whose runner will
        share the device, with a cache of as many tokens: a cache sized by the GPU's free memory leaves it room."""
        self._model = loaded.model
        self._parallel = parallel = loaded.parallel
        if parallel.leader and parallel.size > 1:  # the other ranks build theirs from the same config
            parallel.send(OP_RUNNER)
            parallel.send_object(config)
        self._decoder = loaded.decoder()
        self._vision = loaded.vision()
        self._device = loaded.device
        self._eos = loaded.eos_token_ids
        self._config = config
        self.block_size = config.block_size
        self.kernels = kernels_for(self._device) if config.attention == "auto" else config.attention
        if self.kernels not in KERNELS:
            raise ValueError(f"attention {config.attention!r} is none of auto, {', '.join(KERNELS)}")
        _check_sliding_window(self._model.config.get_text_config(), config.max_seq_len)
        self._decoder.reserve(config.max_seq_len)
        self.adapters = _serve_adapters(self._model, config) if config.max_loras else None
        self._shard_head = self.head = OutputHead(self._model.get_output_embeddings())
        if parallel.size > 1:
            projection, vocab = self._model.get_output_embeddings(), loaded.vocab_size
            self._shard_head = GatheredHead(projection, parallel, vocab)  # called by every rank at once
            self.head = GatheredHead(projection, parallel, vocab, self._announce_logits if parallel.leader else None)
        self._geometry = KVGeometry.of(self._model)
        gpu = self._device.type == "cuda"
        self._processors = (
            torch.cuda.get_device_properties(self._device).multi_processor_count if gpu else os.cpu_count()
        )
        graphs = config.cuda_graphs and self.kernels == "triton" and (gpu or capture is not None)
        bytes_per_block = self._geometry.bytes_per_token * self.block_size
        with current_cuda_device(self._device):  # this thread's kernels: the profile, the graphs' warm-up and capture
            kv_bytes = config.kv_cache_bytes or self._gpu_kv_cache_bytes(graphs, draft)
            self.num_blocks = parallel.agree_min(max(1, kv_bytes // bytes_per_block))
            self._cache = self._allocate(self.num_blocks)
            log.info(
                "kv_cache_allocated",
                blocks=self.num_blocks,
                block_size=self.block_size,
                tokens=self.num_blocks * self.block_size,
                gib=round(self.num_blocks * bytes_per_block / _GIB, 2),
                attention=self.kernels,
            )
            self._graphs: DecodeGraphs | None = None
            if graphs:
                self._graphs = self._capture(capture or cuda_graph_capture())
                if not parallel.agree_min(int(self._graphs is not None)):  # every rank replays, or none does
                    self._graphs = None
        self._between_layers: Callable[[], None] | None = None
        self._thread: int | None = None  # the engine thread's, once bound
        if self._device.type == "cpu" and parallel.size == 1:  # the other ranks could not step within a step
            self._hook_layers()

    def yield_between_layers(self, callback: Callable[[], None]) -> None:
        """Call `callback` between the layers of every step, where a step runs layer by layer: on the CPU.
        (On a GPU the layers' kernels are queued ahead and decode steps replay graphs: no step pauses there.)"""
        self._between_layers = callback

    def _hook_layers(self) -> None:
        # The hooks hold the runner weakly and go with it: a model may outlive its runner (tests share one).
        runner = weakref.ref(self)

        def before_layer(layer: torch.nn.Module, args: tuple) -> None:
            alive = runner()
            if alive is not None:
                alive._before_layer()

        handles = [layer.register_forward_pre_hook(before_layer) for layer in self._decoder.layers]
        weakref.finalize(self, lambda: [handle.remove() for handle in handles])

    def _before_layer(self) -> None:
        callback = self._between_layers
        if callback is None or threading.get_ident() != self._thread:  # another runner's step, on its thread
            return
        self._between_layers = None  # not again within the steps it runs
        try:
            callback()
        finally:
            self._between_layers = callback

    def _allocate(self, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self._geometry.kv_heads, blocks, self.block_size, self._geometry.head_dim)  # see attention.py for why
        return [(self._zeros(shape), self._zeros(shape)) for _ in range(self._geometry.layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed cache tensor. On the CPU from an anonymous private memory map, which the kernel zeroes a
        page at a time as it is first touched: torch.zeros writes the whole cache at start-up (1 GiB: about
        half a second of the first answer) and holds it all resident before a token is stored."""
        dtype = self._model.dtype
        if self._device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self._device)
        count = math.prod(shape)
        pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE)
        return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # it keeps `pages` mapped

    @property
    def graphed(self) -> bool:
        """Whether decode steps replay CUDA graphs."""
        return self._graphs is not None

    @property
    def max_blocks_per_sequence(self) -> int:
        return -(-self._config.max_seq_len // self.block_size)

    def decode_splits(self, sequences: int, max_blocks: int) -> int:
        from workers.engine.triton_attention import decode_splits

        return decode_splits(sequences, self._geometry.kv_heads, max_blocks, self._processors)

    def bind_thread(self) -> None:
        """Called first on the thread that steps the model."""
        self._thread = threading.get_ident()
        if self._device.type == "cuda":
            # Per thread: the kernels launch on the current device. set_device takes an index: "cuda" alone is 0's.
            torch.cuda.set_device(self._device.index or 0)

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], drawing: list[Chunk]) -> StepOutput:
        """One engine step: compute the chunks, then draw the next token of each chunk in `drawing`, and after
        each of its proposed tokens (speculation.py)."""
        # The draws' parameters go to the device before the forward pass, so that nothing waits for it
        # until the tokens are read.
        vocab = self.head.vocab_size
        draws = DrawBatch.of([d for c in drawing for d in _draws(c, self._eos, vocab)], vocab, self._device)
        self._encode_images(chunks)
        step = layout_step(chunks, self.block_size)
        prompt = PromptScoring.of(chunks, step)
        pooled = PooledRows.of(chunks, step.first_rows)
        hidden = self.forward(replace(step, sample_rows=step.sample_rows + prompt.rows + pooled.rows))
        drawn = len(draws.draws)
        scored = drawn + len(prompt.rows)  # the rows drawn from, then those scored, then those pooled
        tokens, logprobs = sample(self.head, hidden[:drawn], draws)
        prompt_scores = self._score_prompt(hidden[drawn:scored], prompt)
        return StepOutput(tokens, logprobs, prompt_scores, pooled.pool(hidden[scored:]))

    def _encode_images(self, chunks: list[Chunk]) -> None:
        """Encode the images of the sequences whose placeholders this step reaches first, in one batch."""
        pending = []
        for chunk in chunks:
            images, start = chunk.sequence.images, chunk.sequence.num_cached_tokens
            if images is not None and images.features is None and images.feature_rows(start, start + chunk.num_tokens):
                pending.append(images)
        if pending:
            self._vision.encode(pending)

    def _score_prompt(self, hidden: torch.Tensor, prompt: PromptScoring) -> dict[str, list[Scored]]:
        if not prompt.rows:
            return {}
        targets = to_device(torch.tensor(prompt.targets), self._device)
        scores: list[Scored] = []
        for start in range(0, len(prompt.rows), _SCORED_ROWS):
            rows = slice(start, start + _SCORED_ROWS)
            scores += score(self.head.logits(hidden[rows]), targets[rows], prompt.tops[rows])
        by_request: dict[str, list[Scored]] = {}
        for request_id, count in prompt.spans:
            by_request[request_id], scores = scores[:count], scores[count:]
        return by_request

    @torch.inference_mode()
    def forward(self, step: StepLayout, graphs: bool = True) -> torch.Tensor:
        """The last hidden states of `step.sample_rows`; `graphs=False` runs a decode step eagerly."""
        decode_only = step.decodes == len(step.lengths)
        replay = graphs and self._graphs is not None and decode_only and step.decodes <= self._graphs.max_batch_size
        packed = self._pack(step, replay)
        if self._parallel.size > 1:
            self._parallel.send(OP_STEP, *packed.header)
            self._parallel.broadcast(packed.flat)
        images = torch.cat(step.image_features) if step.image_features else None
        return self._run(packed, self._cache, images)

    @torch.inference_mode()
    def follow_step(self, header: list[int]) -> None:
        """On a rank other than 0: the step rank 0 has just sent (`forward` there), whose header is followed by
        zeros (a tensor-parallel model has text only: ten parts, no 3-D positions)."""
        header = header[:_TEXT_STEP_HEADER]
        sizes = header[3:]
        flat = self._parallel.broadcast(torch.empty(sum(map(_aligned, sizes)), dtype=torch.long, device=self._device))
        host = flat if self._device.type == "cpu" else flat.cpu() if self.kernels != "triton" else None
        self._run(PackedStep(header, flat, host), self._cache)

    @torch.inference_mode()
    def follow_logits(self, rows: int) -> None:
        """On a rank other than 0: its share of the logits rank 0's sampler has just asked for."""
        hidden = torch.empty(rows, self._model.shape.hidden, dtype=self._model.dtype, device=self._device)
        self.head.logits(self._parallel.broadcast(hidden))

    def _announce_logits(self, hidden: torch.Tensor) -> None:
        self._parallel.send(OP_LOGITS, hidden.shape[0])
        self._parallel.broadcast(hidden.contiguous())

    def close(self) -> None:
        """The engine is done with this runner: on rank 0 of a tensor-parallel model, the others drop theirs."""
        if self._parallel.leader and self._parallel.size > 1:
            self._parallel.send(OP_CLOSE)

    def _pack(self, step: StepLayout, replay: bool) -> PackedStep:
        width = max(len(t) for t in step.tables)
        tables = [block for t in step.tables for block in (*t, *[0] * (width - len(t)))]
        prefill_work: list[int] = []  # the Triton prefill kernel's tiles
        if step.query_starts and self.kernels == "triton":
            from workers.engine.triton_attention import prefill_rows, prefill_tiles

            rows = prefill_rows(self._model.dtype, self._geometry.heads, self._geometry.kv_heads)
            prefill_work = prefill_tiles(step.query_starts, rows)
        parts = [step.ids, step.positions, step.slots, step.lengths, step.sample_rows, step.query_starts]
        parts += [prefill_work, tables, step.image_rows, step.lora_slots, *(step.mrope or ())]
        values: list[int] = []
        for part in parts:
            values += part
            values += [0] * (_aligned(len(part)) - len(part))
        host = torch.tensor(values, dtype=torch.long)
        header = [int(replay), step.decodes, width, *map(len, parts)]
        return PackedStep(header, to_device(host, self._device), host)

    def _run(self, packed: PackedStep, kv, images: torch.Tensor | None = None) -> torch.Tensor:
        """The step's hidden states of its sample rows; `images`: the features of its image rows."""
        sizes, decodes, width = packed.sizes, packed.decodes, packed.width
        (
            ids,
            positions,
            slots,
            lengths,
            sample_rows,
            query_starts,
            tiles,
            flat_tables,
            image_rows,
            lora_slots,
            *mrope,
        ) = packed.parts(packed.flat)
        block_tables = flat_tables.view(-1, width)
        if packed.replay:  # a decode step: every row is sampled
            return self._graphs.run(ids, positions, slots, block_tables, lengths, lora_slots)[sample_rows]
        prompts = ()
        if self.kernels != "triton" and sizes[5]:  # prompt chunks (query_starts), and kernels that take them
            host = packed.parts(packed.host)
            prompts = self._prompt_chunks(host[5].tolist(), host[3].tolist(), host[7].tolist(), decodes, width)
        batch = PagedBatch(
            kv=kv,
            kernels=self.kernels,
            slots=slots,
            decodes=decodes,
            block_tables=block_tables,
            lengths=lengths,
            splits=self.decode_splits(decodes, width) if self.kernels == "triton" else 1,
            query_starts=query_starts if tiles.numel() else None,
            tiles=tiles if tiles.numel() else None,
            prompts=prompts,
            lora=LoraRows(lora_slots, self.adapters.rank, self.adapters.slots) if lora_slots.numel() else None,
        )
        rows_of_images = (image_rows, images) if images is not None else None
        return self._forward(
            ids, torch.stack(mrope)[:, None] if mrope else positions, batch, rows_of_images, sample_rows
        )

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PagedBatch,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions`: [rows], or [3, 1, rows] for 3-D rotary positions; `images`: (rows, their features);
        `rows`: the rows whose hidden states are returned (all: None)."""
        embeddings = None
        if images is not None:
            embeddings = self._decoder.embed(ids)
            embeddings[images[0]] = images[1].to(embeddings.dtype)
        return self._decoder.hidden_states(ids, positions, batch, embeddings, rows)

    def _prompt_chunks(
        self, query_starts: list[int], lengths: list[int], tables: list[int], decodes: int, width: int
    ) -> tuple[PromptChunk, ...]:
        """For the "cpu" and "torch" kernels: each prompt chunk with what its rows see of its blocks
        (`tables`: the step's block tables, flat, `width` per sequence)."""
        chunks = []
        for index, (first_row, end_row) in enumerate(itertools.pairwise(query_starts)):
            end = lengths[decodes + index]
            start = end - (end_row - first_row)  # the chunk's first position
            if start == 0:
                chunks.append(PromptChunk(first_row, end_row, None, None))
                continue
            row = (decodes + index) * width
            blocks = tables[row : row + -(-end // self.block_size)]
            queries = torch.arange(start, end, device=self._device).unsqueeze(1)
            keys = torch.arange(len(blocks) * self.block_size, device=self._device).unsqueeze(0)
            blocks_tensor = torch.tensor(blocks, device=self._device)
            chunks.append(PromptChunk(first_row, end_row, blocks_tensor, (keys <= queries)[None, None]))
        return tuple(chunks)

    # -- GPU start-up: memory and graphs

    def _gpu_kv_cache_bytes(self, graphs: bool, draft: RunnerModel | None) -> int:
        """gpu_memory_fraction of the memory free after the weights, the largest eager step and the graphs, less
        the share of a draft's cache (gpu_kv_cache_tokens). The draft's weights are loaded already."""
        config = self._config
        own = self._device_memory(graphs)
        draft_memory = self._draft_memory(draft, graphs) if draft is not None else None
        free, total = torch.cuda.mem_get_info(self._device)
        tokens = gpu_kv_cache_tokens(free, config.gpu_memory_fraction, own, draft_memory)
        log.info(
            "gpu_memory_planned",
            total_gib=round(total / _GIB, 2),
            free_after_weights_gib=round(free / _GIB, 2),
            step_work_gib=round((own.step + own.graphs) / _GIB, 2),
            kv_cache_gib=round(tokens * own.bytes_per_token / _GIB, 2),
            fraction=config.gpu_memory_fraction,
        )
        if draft_memory is not None:
            log.info(
                "draft_memory_planned",
                step_work_gib=round((draft_memory.step + draft_memory.graphs) / _GIB, 2),
                kv_cache_gib=round(tokens * draft_memory.bytes_per_token / _GIB, 2),
            )
        if tokens <= 0:
            raise ValueError(f"no GPU memory is left for the KV cache ({free / _GIB:.2f} GiB free after the weights)")
        return tokens * own.bytes_per_token

    def _device_memory(self, graphs: bool) -> DeviceMemory:
        """This runner's, measured; `graphs`: whether it captures decode graphs, whose pool holds about what an
        eager decode step of the largest batch takes."""
        config = self._config
        step = self._step_memory(config.max_tokens_per_step, prompt=True)
        held = self._step_memory(config.max_batch_size, prompt=False) if graphs else 0
        return DeviceMemory(self._geometry.bytes_per_token, step, held)

    def _draft_memory(self, draft: RunnerModel, graphs: bool) -> DeviceMemory:
        """The draft's, as its runner (draft.py), with this one's settings on this device, will take it: measured by
        a runner of it over a cache of one block, which captures no graphs."""
        block = KVGeometry.of(draft.model).bytes_per_token * self.block_size
        measured = ModelRunner(draft, replace(self._config.for_draft(block), cuda_graphs=False))
        return measured._device_memory(graphs)

    @torch.inference_mode()
    def _step_memory(self, tokens: int, prompt: bool) -> int:
        """Peak memory of an eager step of `tokens` tokens (one prompt, or as many decoding sequences) and of
        sampling the largest batch, over a cache of its own."""
        size, rows = self.block_size, self._config.max_batch_size
        blocks = -(-tokens // size) if prompt else tokens  # decoding sequences: a block each
        kv = self._allocate(blocks)
        if prompt:
            tables, lengths, slots = [list(range(blocks))], [tokens], list(range(tokens))
            step = StepLayout([0] * tokens, slots, slots, tables, lengths, 0, [0, tokens], [tokens - 1] * rows)
        else:
            tables, slots = [[i] for i in range(tokens)], [i * size for i in range(tokens)]
            step = StepLayout([0] * tokens, [0] * tokens, slots, tables, [1] * tokens, tokens, [], [tokens - 1] * rows)
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        before = torch.cuda.memory_allocated(self._device)
        hidden = self._run(self._pack(step, replay=False), kv)
        logits = self._shard_head.logits(hidden)  # every rank at once
        if self._parallel.leader:
            params = SamplingParams(seed=0, do_sample=True, top_p=0.9, typical_p=0.9, repetition_penalty=1.1)
            choose(logits, DrawBatch.of([Draw(params, [0], 0)] * rows, self.head.vocab_size, self._device))
        torch.cuda.synchronize(self._device)
        peak = torch.cuda.max_memory_allocated(self._device) - before
        del kv, hidden, logits
        torch.cuda.empty_cache()
        return peak

    def _graph_lora(self) -> Callable[[torch.Tensor], LoraRows] | None:
        """How a decode graph groups its rows by adapter slot: over the pools' whole rank (a graph's is fixed)."""
        if self.adapters is None:
            return None
        rank, slots = self._config.max_lora_rank, self.adapters.slots
        return lambda lora_slots: LoraRows(lora_slots, rank, slots)

    def _capture(self, capture: Capture) -> DecodeGraphs | None:
        gpu = self._device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self._device)[0] if gpu else 0
        started = time.perf_counter()
        max_blocks = self.max_blocks_per_sequence
        try:
            with torch.inference_mode():
                graphs = DecodeGraphs(
                    self._forward,
                    self._cache,
                    self._config.max_batch_size,
                    max_blocks,
                    lambda n: self.decode_splits(n, max_blocks),
                    capture,
                    self._graph_lora(),
                )
        except Exception as error:  # the engine still runs, eagerly: slower, and said so
            log.exception("cuda_graphs_failed", error=str(error)[:500])
            return None
        held = free_before - torch.cuda.mem_get_info(self._device)[0] if gpu else 0
        log.info(
            "cuda_graphs_captured",
            batch_sizes=graphs.sizes,
            seconds=round(time.perf_counter() - started, 2),
            memory_mib=round(held / 2**20, 1),
        )
        return graphs


def _serve_adapters(model: torch.nn.Module, config: EngineConfig) -> Adapters:
    """Device slots in every projection of `model` for config.max_loras adapters, and the adapters served in them."""
    if not hasattr(model, "enable_lora"):
        raise ValueError(
            "LoRA adapters (--max-loras) are served on the native models only, not --model-impl transformers"
        )
    model.enable_lora(config.max_loras, config.max_lora_rank)
    support = LoraSupport(max_rank=config.max_lora_rank, layers=model.shape.layers, modules=model.lora_modules())

    def write(slot: int, adapter: HostAdapter) -> None:
        model.write_lora(slot, adapter.weights, adapter.spec.scaling)

    def read(path: str):
        return load_adapter(path, support)

    return Adapters(config.max_loras, config.max_cpu_loras or config.max_loras, read, write, support)


def _check_sliding_window(config, max_seq_len: int) -> None:
    """The paged attention attends to a sequence's whole past: a model trained to see only a window of it
    (Mistral 7B v0.1) is served up to that window."""
    window = getattr(config, "sliding_window", None)
    if window is not None and window < max_seq_len:
        raise ValueError(
            f"the model attends within a sliding window of {window} tokens, which the engine's attention does not "
            f"have: max_seq_len {max_seq_len} must be at most {window}"
        )


def _draws(chunk: Chunk, eos: frozenset[int], vocab_size: int) -> list[Draw]:
    """The draw after the chunk's last token, and after each token proposed, as if those before it were taken."""
    sequence = chunk.sequence
    params = sequence.request.sampling
    proposed = list(chunk.proposed)
    # The token history is only read for penalties; do not copy it otherwise.
    history = sequence.token_ids if params.repetition_penalty != 1.0 else None
    generated = sequence.generated if params.presence_penalty or params.frequency_penalty else None
    masks = _grammar_masks(sequence.matcher, proposed, vocab_size) if sequence.matcher is not None else None
    draws = []
    for taken in range(len(proposed) + 1):
        index = sequence.next_index + taken
        banned = [*(() if params.ignore_eos else eos), *params.stop_token_ids] if index < params.min_tokens else ()
        draws.append(
            Draw(
                params,
                () if history is None else history + proposed[:taken],
                index,
                () if generated is None else generated + proposed[:taken],
                banned,
                None if masks is None else masks[taken],
            )
        )
    return draws


def _grammar_masks(matcher, proposed: list[int], vocab_size: int) -> list[torch.Tensor]:
    """The tokens the grammar allows next, then after each proposed token (which it allows: speculation.py).
    The proposals go into a copy of the matcher: the sequence's own takes the tokens accepted, and no more
    (a matcher stopped by an EOS proposal cannot be rolled back)."""
    masks = [allowed_tokens(matcher, vocab_size)]
    if proposed:
        scratch = matcher.deep_copy()
        for token in proposed:
            scratch.consume_token(token)
            masks.append(allowed_tokens(scratch, vocab_size))
    return masks
