"""No Triton kernel compiles within the bench's timed run: its warm-up launches every variant the run needs.

Triton compiles a kernel once per key: each pointer's 16-byte alignment, each
integer's being 1 or a multiple of 16 (unless the kernel says not to), the
constexprs and the warps. A key first met in a step compiles there, 0.2-0.4 s
on a GPU; the interpreter the CPU tests run compiles nothing, so this
computes each launch's key with Triton's own specialisation of its arguments.
The engine serves `tokenrelay bench engine`'s workload (256 requests) with a
GPU's settings and an H100's processors (they size the decode split), its
decode graphs captured and replayed eagerly; the bench's warm-up is the
engine's start and a pass of the workload's first 2 requests. The launches
only record their keys, and attention outputs zeros (interpreted, this
workload's kernels would take hours): a workload of fixed lengths that
ignores EOS takes the tokens drawn from them as any others. The model has the
bundled one's attention (heads, KV heads, head size) in one thin layer: that
sets the kernels' constants, not which steps vary them.
"""

from __future__ import annotations

import inspect
import os
import queue
import time
from collections import Counter

import torch
from transformers import AutoConfig, AutoTokenizer
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction

from tests.test_cuda_graphs import replay_eagerly
from tokenrelay.bench.engine_runs import engine_pass, workload
from workers.bundled import BUNDLED_MODEL
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.kernel_launch import KernelLaunch
from workers.engine.model_loader import random_model

H100_PROCESSORS = 132


def arguments(launch: KernelLaunch) -> dict[str, object]:
    """The launch's arguments by their names in the kernel, its constexprs left out."""
    return dict(zip(inspect.signature(launch.kernel.fn).parameters, launch.args, strict=False))


def variant(launch: KernelLaunch) -> tuple:
    """The key Triton's launcher looks the launch's compiled kernel up by."""
    kernel = launch.kernel
    settings = kernel.kwargs if isinstance(kernel, InterpretedFunction) else vars(kernel)
    not_specialised = set(settings.get("do_not_specialize") or ())
    not_aligned = set(settings.get("do_not_specialize_on_alignment") or ())
    specialised = []
    for index, (name, value) in enumerate(arguments(launch).items()):
        specialise, align = not {index, name} & not_specialised, not {index, name} & not_aligned
        specialised.append((name, native_specialize_impl(BaseBackend, value, False, specialise, align)))
    constexprs = tuple((name, repr(value)) for name, value in launch.constexprs.items())
    return kernel.fn.__name__, tuple(specialised), constexprs, launch.num_warps


class Variants:
    """Stands in for every launch: records its key, with the phase that first asked for it, and writes zeros
    for the attention it would compute (`out`), so that no step reads uninitialised memory (a NaN token)."""

    def __init__(self) -> None:
        self.phase = "start"
        self.first: dict[tuple, str] = {}

    def launch(self, launch: KernelLaunch) -> None:
        self.first.setdefault(variant(launch), self.phase)
        out = arguments(launch).get("out")
        if out is not None:
            out.zero_()

    def first_in(self, phase: str) -> list[tuple]:
        return [key for key, first in self.first.items() if first == phase]


def test_the_bench_warm_up_launches_every_kernel_variant_its_timed_run_does(monkeypatch):
    shape = AutoConfig.from_pretrained(BUNDLED_MODEL)
    shape.num_hidden_layers, shape.hidden_size, shape.intermediate_size = 1, 64, 64  # head_dim stays 32
    torch.manual_seed(0)
    model = random_model(shape, AutoTokenizer.from_pretrained(BUNDLED_MODEL), "cpu", "float32")
    variants = Variants()
    monkeypatch.setattr(KernelLaunch, "__call__", lambda launch: variants.launch(launch))
    # As the bench sets it, with a GPU's defaults (256 sequences, 2048 tokens a step); a cache that holds them all.
    config = EngineConfig(max_seq_len=2560, max_iter_times=256, kv_cache_bytes=256 << 20, attention="triton")
    events: queue.SimpleQueue = queue.SimpleQueue()
    with monkeypatch.context() as processors:
        processors.setattr(os, "cpu_count", lambda: H100_PROCESSORS)  # the runner's count of processors on a CPU
        engine = Engine(
            model, config.for_device("cuda"), lambda batch: events.put((time.perf_counter(), batch)), replay_eagerly
        )
    engine.start()
    try:
        requests = workload(256, (32, 512), (16, 256), model.vocab_size, seed=0)
        variants.phase = "warm-up"
        engine_pass(engine, events, requests[:2])
        variants.phase = "timed run"
        engine_pass(engine, events, requests)
    finally:
        engine.stop()
    assert engine.stats()["preemptions"] == 0  # every request ran as on a GPU, whose cache holds them all
    assert {key[0] for key in variants.first} >= {"_store_kernel", "_decode_kernel", "_merge_kernel", "_prefill_kernel"}
    late = variants.first_in("timed run")
    assert not late, f"first launched in the timed run: {Counter(key[0] for key in late)}"
