"""The engine's Triton kernels compile for an H200 (sm_90) here, with no GPU, and spill no registers.

The other kernel tests run them under Triton's interpreter, which accepts what the compiler does not and
knows nothing of registers. This compiles them as `tokenrelay bench kernels` does (the whole table of shapes
and dtypes is the bench's), where register pressure is highest: every kernel in bf16 at Llama-3-8B's shape
(head_dim 128 and hidden 4096, the largest tiles), and the prefill kernel in fp16 too. Both prefills
spilled there at Triton's default 4 warps (255 registers, 44-56 bytes), until their tiles got 8. The layer
and LoRA kernels compile in fp64 too, at the bundled model's shape: the exactness tests run them so on a GPU.
Every program must fit an H100's (and H200's) 227 KB of shared memory, or its launch fails: the fp64 LoRA
shrink took 272 KB until its input step was halved.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tokenrelay.bench.kernels import KERNELS, compile_jobs, failures, table
from workers.bundled import BUNDLED_MODEL_NAME

SUBSET = [(kernel, "bf16", "llama-3-8b") for kernel in KERNELS] + [("prefill", "fp16", "llama-3-8b")]
SUBSET += [
    (kernel, "fp64", BUNDLED_MODEL_NAME)
    for kernel in ("add-rms-norm", "silu-mul", "rotary", "lora-shrink", "lora-expand", "lora-shrink-down")
]
SHARED_MEMORY = 227 * 1024  # bytes a program of sm_90 may take


def test_every_kernel_compiles_for_sm_90_without_spilling_at_llama_3_8bs_shape():
    versions, rows = compile_jobs(SUBSET, processes=2)
    assert versions["target"] == "sm_90", versions
    outcomes = [
        (r["kernel"], r["dtype"], r["shape"], r["error"], r.get("spill_stores"), r.get("spill_loads")) for r in rows
    ]
    assert outcomes == [(*job, None, 0, 0) for job in SUBSET], table(rows)
    assert all(0 < r["registers"] <= 255 and r["stack"] == 0 for r in rows), table(rows)
    assert all(r["shared"] <= SHARED_MEMORY for r in rows), table(rows)
    assert failures(rows) == []


def test_the_compile_process_refuses_to_run_under_the_interpreter():
    """Under TRITON_INTERPRET=1 (the test suite's, tests/conftest.py) triton.jit makes functions that cannot be
    compiled: the compile process stops and says so, rather than report nothing as a pass."""
    env = os.environ | {"TRITON_INTERPRET": "1", "TRITON_DUMP_PTXAS_LOG": "1", "TRITON_ALWAYS_COMPILE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "tokenrelay.bench.kernel_compile"],
        input="",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert run.stdout == ""
    assert "TRITON_INTERPRET unset" in run.stderr
