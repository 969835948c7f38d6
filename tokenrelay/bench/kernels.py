"""`tokenrelay bench kernels`: the engine's Triton kernels compiled for an H200, on a machine without one.

The tests run the kernels under Triton's interpreter, which accepts things
the compiler does not, and says nothing of what a kernel costs on a GPU: a
thread that needs more than the 255 registers it can have spills to local
memory, slow in an inner loop. This compiles every kernel ahead of time for
sm_90 with the ptxas that Triton bundles (no GPU, no driver), with what the
engine's own launch functions pass it (workers/engine/kernel_launch.py), for
the bundled model, TinyLlama-1.1B and Llama-3-8B, in bf16, fp16 and fp32
(and fp64, the exactness tests' dtype on a GPU, if asked): store, decode
(one program per sequence, and split with the merge of its partial
results), prefill, the sampler's noise, and the decoder layer's RMSNorm
after the residual add, SiLU-and-multiply and rotary, and the LoRA shrink
and expand (the fused QKV projection's, the widest rank, and the down
projection's shrink, the longest). It prints each kernel's warps, registers
per thread, spilled bytes (stores/loads), stack frame, shared memory per
program and compile time, and exits 1 on any compile
error or any spill in bf16 or fp16, the dtypes a GPU serves in (fp32's and
fp64's are reported). The compiles run in `--jobs` processes
(kernel_compile.py), in a Triton cache of their own that is removed after them.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tokenrelay.bench.help import HelpFormatter
from workers.bundled import BUNDLED_MODEL, BUNDLED_MODEL_NAME

KERNELS = (
    "store",
    "decode",
    "decode-split",
    "merge",
    "prefill",
    "noise",
    "add-rms-norm",
    "silu-mul",
    "rotary",
    "lora-shrink",
    "lora-expand",
    "lora-shrink-down",
)
DTYPES = ("bf16", "fp16", "fp32", "fp64")
DEFAULT_DTYPES = ("bf16", "fp16", "fp32")  # fp64 on request: the exactness tests' dtype, slow to compile at 8B
SERVED_DTYPES = ("bf16", "fp16")  # a spill in these fails the check


@dataclass(frozen=True)
class ModelShape:
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # the noise kernel's rows are this long
    hidden: int  # RMSNorm's rows
    intermediate: int  # SiLU-and-multiply's output rows


def _bundled_shape() -> ModelShape:
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelShape(
        config["num_attention_heads"],
        config["num_key_value_heads"],
        head_dim,
        config["vocab_size"],
        config["hidden_size"],
        config["intermediate_size"],
    )


# The real models' shapes, Llama-3-8B's with its own vocabulary (bench engine's random one has the bundled 32000).
SHAPES = {
    BUNDLED_MODEL_NAME: _bundled_shape(),
    "tinyllama-1.1b": ModelShape(heads=32, kv_heads=4, head_dim=64, vocab=32000, hidden=2048, intermediate=5632),
    "llama-3-8b": ModelShape(heads=32, kv_heads=8, head_dim=128, vocab=128256, hidden=4096, intermediate=14336),
}


def compile_jobs(jobs: list[tuple[str, str, str]], processes: int, progress=None) -> tuple[dict, list[dict]]:
    """Compile each (kernel, dtype, shape) in `processes` processes of kernel_compile.py: (Triton's and ptxas's
    versions, each job's figures in the jobs' order). `progress(figures)` is called as each compile ends."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for index, job in enumerate(jobs):
        work.put((index, job))
    results: list[dict] = [{}] * len(jobs)
    versions: dict = {}
    with tempfile.TemporaryDirectory(prefix="tokenrelay-kernels-") as scratch:
        env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
        env |= {
            "TRITON_CACHE_DIR": str(Path(scratch) / "triton"),
            "TRITON_DUMP_PTXAS_LOG": "1",
            "TRITON_ALWAYS_COMPILE": "1",
        }
        threads = [
            threading.Thread(target=_compile_in_a_process, args=(work, results, versions, env, progress, errors))
            for errors in (Path(scratch) / f"process-{n}.log" for n in range(min(processes, len(jobs))))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return versions, results


def _compile_in_a_process(work, results: list[dict], versions: dict, env: dict, progress, errors: Path) -> None:
    """Take jobs from `work` until none is left and compile them in one kernel_compile.py process; one that dies
    fails its job, with its stderr's tail, and the next job gets a fresh one."""
    with open(errors, "w+") as stderr:
        process = None
        while True:
            try:
                index, (kernel, dtype, shape) = work.get_nowait()
            except queue.Empty:
                break
            if process is None:
                process = subprocess.Popen(
                    [sys.executable, "-m", "tokenrelay.bench.kernel_compile"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    env=env,
                )
                versions.update(json.loads(process.stdout.readline() or "{}"))
            result = _ask(process, {"kernel": kernel, "dtype": dtype, "shape": shape})
            if result is None:
                process.wait()
                stderr.seek(0)
                result = {"kernel": kernel, "dtype": dtype, "shape": shape}
                result["error"] = "the compile process died: " + stderr.read()[-3000:]
                process = None
            results[index] = result
            if progress is not None:
                progress(result)
        if process is not None:
            process.stdin.close()
            process.wait()


def _ask(process: subprocess.Popen, job: dict) -> dict | None:
    """The process's answer to the job; None if it is gone."""
    try:
        process.stdin.write(json.dumps(job) + "\n")
        process.stdin.flush()
    except BrokenPipeError:
        return None
    answer = process.stdout.readline()
    return json.loads(answer) if answer else None


def failures(rows: list[dict]) -> list[dict]:
    """The rows that fail the check: a compile error, or a spill in a served dtype."""
    return [r for r in rows if r["error"] or (r["dtype"] in SERVED_DTYPES and r["spill_stores"] + r["spill_loads"])]


def table(rows: list[dict]) -> str:
    header = f"{'kernel':<17}{'dtype':<6}{'shape':<16}{'warps':>6}{'regs':>6}{'spills st/ld B':>16}{'stack B':>9}"
    lines = [header + f"{'shared B':>10}{'compile s':>11}"]
    for r in rows:
        start = f"{r['kernel']:<17}{r['dtype']:<6}{r['shape']:<16}"
        if r["error"]:
            lines.append(start + "  error: " + r["error"].strip().splitlines()[-1][:100])
            continue
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        lines.append(
            start + f"{r['num_warps']:>6}{r['registers']:>6}{spills:>16}{r['stack']:>9}{r['shared']:>10}"
            f"{r['seconds']:>11.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokenrelay bench kernels", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS), help="default: all")
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, default=list(DEFAULT_DTYPES), help="the model's; default: bf16 fp16 fp32"
    )
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="default: all")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes; default: the cores")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = parser.parse_args(argv)
    jobs = [(kernel, dtype, shape) for shape in args.shapes for dtype in args.dtypes for kernel in args.kernels]
    processes = max(1, min(args.jobs, len(jobs)))

    def progress(result: dict) -> None:
        outcome = "error" if result["error"] else f"{result['registers']} registers"
        print(f"  {result['kernel']} {result['dtype']} {result['shape']}: {outcome}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    versions, rows = compile_jobs(jobs, processes, progress)
    seconds = time.perf_counter() - started
    failed = failures(rows)
    print(f"Triton kernels for sm_90 (H200), Triton {versions.get('triton')}, ptxas {versions.get('ptxas')}:")
    print(table(rows))
    print(
        f"{len(rows)} compiles in {seconds:.0f} s on {processes} processes: "
        f"{sum(bool(r['error']) for r in rows)} errors, {len(failed)} failing (errors, or spills in bf16/fp16)",
        flush=True,
    )
    if args.json:
        summary = {"seconds": round(seconds, 1), "processes": processes, "failing": len(failed), "kernels": rows}
        print(json.dumps(versions | summary))
    if failed:
        sys.exit(1)
