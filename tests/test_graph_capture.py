"""Every graphed decode step can be captured: the decode graphs' region run on a fake CUDA device, on the CPU.

A CUDA graph records device work only. An op that reads a device tensor back
to the host (.item(), .tolist(), a boolean mask, nonzero, or bincount, which
reads its input's range to size its output) raises inside `torch.cuda.graph`,
and the engine then serves every step eagerly, syncing within each. Under
torch's FakeTensorMode the same ops raise DataDependentOutputException or
DynamicOutputShapeException, with no GPU at all. So here the engine builds
its model runner on a fake "cuda" device, as on a GPU (random weights of the
bundled model's config, made by `random_model`), captures every bucket's
decode graph through a capture that runs the forward pass under fake tensors,
then replays decode steps, as the engine lays them out, with speculative rows
(a sequence's last token and the tokens proposed after it) and, where the
model serves LoRA adapters, rows of two adapters and of the base model.

The Triton kernels only write into tensors they are given: under fake tensors
a launch (KernelLaunch, their one way in) runs nothing, and checks that the
tensors it was given are the device's. The capture also refuses any op on a
host tensor: on a GPU that is a copy between host and device, which a graph
cannot capture, or replays from a host buffer that has changed since.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog.testing
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, AutoTokenizer

from tests.test_scheduler import _sequence
from workers.bundled import BUNDLED_MODEL
from workers.engine.config import EngineConfig
from workers.engine.kernel_launch import KernelLaunch
from workers.engine.model_loader import random_model
from workers.engine.model_runner import layout_step
from workers.engine.scheduler import Chunk

H100_PROCESSORS = 132


def _host_tensors(values) -> list[torch.Tensor]:
    """The tensors among `values` (nested) that are not on the device; 0-dim ones are scalar arguments."""
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.device.type != "cuda" and t.dim()]


class DeviceOnly(TorchDispatchMode):
    """Refuses any op with a host tensor among its inputs or outputs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        host = _host_tensors((args, kwargs, out))
        assert not host, f"{func} takes or makes host tensors in a graphed step: {[t.shape for t in host]}"
        return out


def launch_nothing(launch: KernelLaunch) -> None:
    """A kernel launch on fake tensors: nothing to compute, but every tensor it is given must be the device's."""
    host = _host_tensors(launch.args)
    assert not host, f"{launch.kernel} is given host tensors: {[t.shape for t in host]}"


class FakeCapture:
    """A decode graph's capture, on fake tensors: `run` once on device tensors only; a replay runs it again."""

    def __init__(self) -> None:
        self.replayed: list[int] = []  # the buckets replayed, in order

    def __call__(self, run):
        with DeviceOnly():
            output = run()

        def replay() -> None:
            with DeviceOnly():
                output.copy_(run())
            self.replayed.append(output.shape[0])

        return replay, output


@pytest.fixture
def fake_cuda(monkeypatch):
    """A fake "cuda" device: tensors made under FakeTensorMode (no data: any read of their values raises),
    kernel launches that run nothing, an H100's processors (they size the decode kernel's splits) and memory
    (the capture logs what it took), and no pinning (a fake tensor has no memory to pin)."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=H100_PROCESSORS)
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(KernelLaunch, "__call__", launch_nothing)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: tensor)  # fake tensors are never pinned
    with FakeTensorMode():
        yield


def _decoding(length: int, slot: int, first_block: int):
    """A sequence of `length` tokens, all cached but its last, computing under adapter slot `slot`, in the three
    blocks from `first_block` (room for 96 positions, its proposed tokens' included)."""
    sequence = _sequence(list(range(10, 10 + length)), name=str(first_block))
    sequence.block_table = list(range(first_block, first_block + 3))
    sequence.num_cached_tokens = length - 1
    sequence.lora_slot = slot
    return sequence


@pytest.mark.parametrize(
    ("model_impl", "max_loras"),
    [("native", 0), ("native", 2), ("transformers", 0)],
    ids=["native", "lora", "transformers"],
)
def test_decode_graphs_are_captured_and_no_step_reads_the_device_back(fake_cuda, model_impl, max_loras):
    config = AutoConfig.from_pretrained(BUNDLED_MODEL)
    loaded = random_model(config, AutoTokenizer.from_pretrained(BUNDLED_MODEL), "cuda", "bfloat16", None, model_impl)
    engine_config = EngineConfig(max_batch_size=16, max_seq_len=256, kv_cache_bytes=4 << 20, max_loras=max_loras)
    capture = FakeCapture()
    with structlog.testing.capture_logs() as logs:
        runner = loaded.runner(engine_config.for_device("cuda"), capture)
    failed = [entry for entry in logs if entry["event"] == "cuda_graphs_failed"]
    assert runner.graphed, f"the decode graphs were not captured: {failed}"

    slots = (0, 1, -1) if max_loras else (-1, -1, -1)  # two adapters and the base model in every step
    sequences = [_decoding(*sequence) for sequence in zip((40, 7, 70), slots, (0, 3, 6), strict=True)]
    prompt = _sequence(list(range(10, 30)), name="prompt")  # 20 tokens, none cached
    prompt.block_table, prompt.lora_slot = [9], slots[0]
    speculative = [Chunk(sequences[0], 1, (5, 6, 7)), Chunk(sequences[1], 1, (8, 9, 10, 11)), Chunk(sequences[2], 1)]
    steps = {
        "decode": [Chunk(sequence, 1) for sequence in sequences],  # 3 rows: bucket 4
        "speculative": speculative,  # 11 rows, each proposed token's after its sequence's last: bucket 16
        "mixed": [*speculative, Chunk(prompt, 20)],  # eager; the last layer computes the sampled rows alone
    }
    for name, chunks in steps.items():
        step = layout_step(chunks, runner.block_size)
        hidden = runner.forward(step)
        assert hidden.shape == (len(step.sample_rows), config.hidden_size) and hidden.is_cuda, name
    assert capture.replayed == [4, 16]
