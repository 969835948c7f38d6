"""The engine's settings, with the defaults that differ between a CPU and a GPU."""

from __future__ import annotations

from dataclasses import dataclass, replace

_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int | None = None  # sequences that run at once (MindIE's maxBatchSize); None: 64 CPU, 256 GPU
    max_seq_len: int = 2560  # prompt + generated tokens (maxSeqLen)
    max_input_len: int = 2048  # prompt tokens (maxInputTokenLen)
    max_iter_times: int = 512  # generated tokens per request (maxIterTimes)
    max_tokens_per_step: int | None = None  # decode tokens plus prompt chunks, per step; None: 1024 CPU, 2048 GPU
    block_size: int = 32  # tokens per KV cache block (gathers of smaller blocks are much slower on CPUs)
    kv_cache_bytes: int | None = None  # None: 1 GiB on the CPU; on a GPU, gpu_memory_fraction of the free memory
    gpu_memory_fraction: float = 0.9  # of the GPU memory free after the weights, the step's work and the graphs
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (GPU only)
    attention: str = "auto"  # the attention kernels: auto (by device), triton, cpu or torch (attention.py)
    aging_s: float = 10.0  # waiting this long makes a request one priority level more urgent
    max_loras: int = 0  # LoRA adapters in device slots at once, each step's products computed over them; 0: none served
    max_cpu_loras: int | None = None  # adapters kept read in host memory; None: max_loras
    max_lora_rank: int = 64  # the highest adapter rank served (the slots' size)
    speculative: str = ""  # how tokens are proposed for verification in one step (speculation.py): "", "ngram", "draft"
    speculative_model: str | None = None  # "draft": the draft model's directory (draft.py)
    num_speculative_tokens: int = 4  # proposed per sequence and step, at most
    speculative_always: bool = False  # propose in every step, without the measured rule (speculation_rule.py)
    ngram_min: int = 2  # prompt lookup matches the context's last n tokens, n from ngram_max down to ngram_min
    ngram_max: int = 4

    def for_draft(self, kv_cache_bytes: int) -> EngineConfig:
        """A draft model's runner's settings (draft.py): these, with a cache of `kv_cache_bytes` and no adapters."""
        return replace(self, kv_cache_bytes=kv_cache_bytes, max_loras=0, speculative="")

    def for_device(self, device_type: str) -> EngineConfig:
        """These settings with every default of the device type ("cpu", "cuda") filled in."""
        gpu = device_type == "cuda"
        return replace(
            self,
            max_batch_size=self.max_batch_size or (256 if gpu else 64),
            max_tokens_per_step=self.max_tokens_per_step or (2048 if gpu else 1024),
            kv_cache_bytes=self.kv_cache_bytes or (None if gpu else _CPU_KV_CACHE_BYTES),
        )
