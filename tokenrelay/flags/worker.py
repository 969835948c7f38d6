"""A worker's flags: the model it loads, the engine around it, its place in a fleet on Kafka.

What they become is WorkerSettings and EngineConfig, through
tokenrelay/settings.py. `serve` and `worker` load a model; `simulate` runs
the engine around a simulated one, and so takes the engine's flags alone.
"""

from __future__ import annotations

from tokenrelay.flags.parser import Parser, at_least_one, at_least_zero, fraction, number, option, parallel_size
from workers.bundled import (
    BUNDLED_DRAFT_MODEL,
    BUNDLED_MODEL,
    BUNDLED_MODEL_NAME,
    BUNDLED_VISION_MODEL_NAME,
    DTYPE_NAMES,
    MODEL_IMPLS,
)
from workers.simulated.profile import names as simulation_profiles


def model_options(parser: Parser) -> None:
    """The model a worker loads: no simulated worker has one."""
    option(
        parser,
        "--model",
        default=str(BUNDLED_MODEL),
        help="Hugging Face causal-LM or vision-language model (LLaVA, Qwen2-VL, ...) directory or hub id; "
        "default: the bundled model",
    )
    option(
        parser,
        "--vision",
        action="store_true",
        help=f"serve the bundled vision-language model ({BUNDLED_VISION_MODEL_NAME}) instead of the bundled text one",
    )
    option(parser, "--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    dtypes = ["", *DTYPE_NAMES]
    option(parser, "--dtype", default="", choices=dtypes, help="model dtype; empty: bf16 on CUDA, fp32 on CPU")
    option(
        parser,
        "--model-impl",
        default="auto",
        choices=MODEL_IMPLS,
        help="the model code: native (the engine's own, for Llama, Mistral, Qwen2 and Qwen3 from safetensors), "
        "transformers (its modeling classes, any architecture), or auto: native where it can",
    )
    option(
        parser,
        "--tensor-parallel-size",
        type=parallel_size,
        default=1,
        help="split a native model across this many devices (GPUs cuda:0..N-1, or ranks sharing the CPU), one "
        "process each: this one is rank 0 and starts the others",
    )
    option(
        parser,
        "--distributed-init",
        default="",
        help="where the ranks of --tensor-parallel-size meet, tcp://HOST:PORT on this host; empty: a free "
        "loopback port",
    )
    option(
        parser,
        "--kv-cache-memory",
        type=number(float, 0),
        default=0.0,
        help="GiB for the KV cache; 0: 1 GiB on the CPU, --gpu-memory-fraction on a GPU",
    )
    option(
        parser,
        "--gpu-memory-fraction",
        type=fraction,
        default=0.9,
        help="share of the GPU memory left after the weights, the largest step's work and the CUDA graphs "
        "that the KV cache takes, in (0, 1]",
    )
    option(
        parser,
        "--no-cuda-graphs",
        action="store_true",
        default=False,
        help="run decode steps eagerly instead of replaying CUDA graphs (GPU only)",
    )
    option(
        parser,
        "--speculative",
        choices=("", "ngram"),
        default="",
        help="propose tokens and verify them within each decode step: ngram (prompt lookup, the tokens that "
        "followed the context's last n-gram earlier); the output is the same, only its pace differs",
    )
    option(
        parser,
        "--speculative-model",
        default="",
        help=f"propose tokens with this draft model (a directory; the target's tokenizer), verified within each "
        f"decode step; the bundled model's draft: {BUNDLED_DRAFT_MODEL}",
    )
    option(
        parser,
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="tokens proposed per sequence and step, at most (from 1 to 16)",
    )
    option(
        parser,
        "--speculative-always",
        action="store_true",
        default=False,
        help="propose in every decode step, without the measured rule that stops proposing where it would lower "
        "the tokens per second (for a proposer known to pay, as vLLM and TGI always propose)",
    )
    option(parser, "--ngram-min", type=int, default=2, help="the shortest n-gram prompt lookup matches (at least 1)")
    option(parser, "--ngram-max", type=int, default=4, help="the longest n-gram prompt lookup matches (at most 16)")


def engine_options(parser: Parser) -> None:
    """The engine around the model, loaded or simulated, and the worker it serves."""
    option(
        parser,
        "--lora",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA adapter (PEFT's format) in directory PATH as model NAME (several, or repeated)",
    )
    option(
        parser,
        "--max-loras",
        type=int,
        default=0,
        help="LoRA adapters in device slots at once (each step computes over them); 0: 4 where --lora names any, "
        "else no adapters are served",
    )
    option(parser, "--max-cpu-loras", type=int, default=0, help="LoRA adapters kept in host memory; 0: --max-loras")
    option(parser, "--max-lora-rank", type=int, default=64, help="the highest rank of a LoRA adapter served")
    option(
        parser,
        "--served-model-name",
        nargs="+",
        default=None,
        help=f"names clients use for the model, aliases of each other; "
        f"default: {BUNDLED_MODEL_NAME} for the bundled model, the profile's name when simulated, else --model",
    )
    option(
        parser,
        "--max-batch-size",
        type=at_least_zero,
        default=0,
        help="sequences that run at once (maxBatchSize); 0: 64 on the CPU, 256 on a GPU",
    )
    option(parser, "--max-seq-len", type=at_least_one, default=2560, help="prompt + generated tokens (maxSeqLen)")
    option(parser, "--max-input-len", type=at_least_one, default=2048, help="prompt tokens (maxInputTokenLen)")
    option(
        parser, "--max-iter-times", type=at_least_one, default=512, help="generated tokens per request (maxIterTimes)"
    )
    option(
        parser,
        "--max-tokens-per-step",
        type=at_least_zero,
        default=0,
        help="tokens one engine step computes: a token per decoding sequence, the rest on prompt chunks; "
        "0: 1024 on the CPU, 2048 on a GPU",
    )
    option(parser, "--block-size", type=at_least_one, default=32, help="tokens per KV cache block")
    option(
        parser,
        "--priority-aging",
        type=float,
        default=10.0,
        help="seconds of waiting that make a request one priority level more urgent",
    )
    option(parser, "--worker-id", default="", help="this worker's id in heartbeats and logs; empty: host-pid")
    option(
        parser,
        "--engine-stuck-timeout",
        type=float,
        default=300.0,
        help="seconds an engine step may run before the worker takes its engine for stuck and exits (status 1), "
        "so that an orchestrator restarts it and the gateways fail its requests over; 0: never",
    )


def fleet_worker_options(parser: Parser) -> None:
    """`tokenrelay worker`'s: a worker of a loaded model (unless --simulate says otherwise)."""
    _fleet_options(parser, simulate_default="")


def simulated_fleet_options(parser: Parser) -> None:
    """`tokenrelay simulate`'s: workers of a simulated model (bundled-cpu unless --simulate says), and how many."""
    option(parser, "--workers", type=int, default=8, help="simulated workers")
    _fleet_options(parser, simulate_default="bundled-cpu")


def _fleet_options(parser: Parser, simulate_default: str) -> None:
    """A worker among others on Kafka: its request topics, its heartbeats, its model simulated or not."""
    option(
        parser,
        "--partitions",
        type=int,
        default=8,
        help="partitions of each request topic created here: at most this many workers share a priority",
    )
    option(parser, "--heartbeat-interval", type=float, default=1.0, help="seconds between worker heartbeats")
    option(
        parser,
        "--simulate",
        default=simulate_default,
        help="simulate the model with a step-time profile (a file, or one of "
        f"{', '.join(simulation_profiles())}): no weights, no torch; "
        "empty: run --model (`tokenrelay simulate`: bundled-cpu)",
    )
    option(
        parser,
        "--metrics-address",
        default="",
        help="HOST:PORT where the worker serves GET /metrics (Prometheus); empty: nowhere",
    )
