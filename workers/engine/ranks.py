"""A tensor-parallel worker's other ranks: the processes rank 0 starts, and what each of them runs.

Rank 0 is the worker (its bus, scheduler, block manager and sampler). When
its model loads with a tensor-parallel size N (`start`), it spawns ranks
1..N-1 on this host, one process per device (`python -m workers.engine.ranks`),
and all meet at a TCP rendezvous (`--distributed-init`; by default a free
loopback port) in one torch.distributed group: NCCL on GPUs, gloo on the CPU.
Each rank loads its own share of the weights (models/weights.py) and then
does what rank 0 broadcasts (`follow`): build a model runner, run a step,
compute its share of the logits, drop the runner, exit. They hold no bus
connection and log as rank 0 does, their lines naming their rank.

Failure: rank 0 watches its ranks; one that dies ends the worker (a line
naming the rank, exit status 1), and the fleet fails its requests over as it
does a dead worker's. The other ranks die with rank 0 (PR_SET_PDEATHSIG) and
ignore SIGTERM and SIGINT, which rank 0 acts on: a drain there finishes the
worker's requests, and its exit tells every rank to exit.

Across hosts, tensor parallelism's two all-reduces per layer would cross the
network every layer; that takes pipeline parallelism (layers split between
hosts, activations sent once per stage) and a launcher per host, which this
does not do.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from workers.engine.parallel import OP_CLOSE, OP_EXIT, OP_LOGITS, OP_RUNNER, OP_STEP, TensorParallel

log = structlog.get_logger(__name__)

_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)  # ranks load their weights between the rendezvous and the first step
_EXIT_WAIT_S = 10.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the one asked for; the CPU for every rank on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclass
class Ranks:
    """Rank 0's view of ranks 1..N-1: their processes, watched."""

    parallel: TensorParallel
    processes: list[subprocess.Popen]
    threads: int  # the CPU threads torch had in this process before
    _closing: bool = field(default=False, init=False)

    def watch(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), name=f"rank-{rank}", daemon=True).start()
        atexit.register(self.close)

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        status = process.wait()
        if self._closing:
            return
        log.error("tensor_parallel_rank_died", rank=rank, exit_status=status, pid=process.pid)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)  # the others die with this process; the fleet fails its requests over

    def close(self) -> None:
        """Tell the ranks to exit (killing those that do not within seconds), and leave the group."""
        if self._closing:
            return
        self._closing = True
        # Sent from a thread: an engine stuck within a step would hold the group, and then the ranks are killed.
        sender = threading.Thread(target=self.parallel.send, args=(OP_EXIT,), daemon=True)
        sender.start()
        sender.join(_EXIT_WAIT_S)
        for process in self.processes:
            try:
                process.wait(_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if not sender.is_alive():
            dist.destroy_process_group()
        if self.parallel.device.type == "cpu":
            torch.set_num_threads(self.threads)
        atexit.unregister(self.close)


def cpu_threads(size: int) -> int:
    """Each rank's torch threads where `size` ranks share the CPU's cores."""
    return max(1, (os.cpu_count() or 1) // size)


def start(size: int, init: str | None, path: str, device: torch.device, dtype: str | None) -> Ranks:
    """On rank 0: spawn ranks 1..size-1 to load `path` and follow this process, and join their group."""
    host, port = address(init) if init else ("127.0.0.1", 0)  # 0: a free port the system picks, none to probe
    store = dist.TCPStore(host, port, size, is_master=True, timeout=_RENDEZVOUS_TIMEOUT, wait_for_workers=False)
    init = f"tcp://{host}:{store.port}"
    threads = torch.get_num_threads()
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(cpu_threads(size))
    processes = []
    for rank in range(1, size):
        spec = {
            "rank": rank,
            "size": size,
            "init": init,
            "path": path,
            "device": str(device),
            "dtype": dtype,
            "parent": os.getpid(),
        }
        processes.append(subprocess.Popen([sys.executable, "-m", "workers.engine.rank_process", json.dumps(spec)]))
    log.info("tensor_parallel_ranks_started", size=size, init=init, pids=[p.pid for p in processes])
    try:
        join(0, size, device, store)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    ranks = Ranks(TensorParallel(0, size, collective_device(device)), processes, threads)
    ranks.watch()
    return ranks


def address(init: str) -> tuple[str, int]:
    """The host and port of a rendezvous, tcp://HOST:PORT."""
    parts = urllib.parse.urlsplit(init)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"--distributed-init {init!r}: tcp://HOST:PORT is the form (a host's address and a port)")
    return parts.hostname, port


def rendezvous(init: str, size: int) -> dist.Store:
    """On ranks 1..N-1: the store rank 0 holds at `init` (start)."""
    return dist.TCPStore(*address(init), size, is_master=False, timeout=_RENDEZVOUS_TIMEOUT)


def join(rank: int, size: int, device: torch.device, store: dist.Store) -> None:
    """Join the group whose rendezvous is `store` (rank 0's; on this host)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank_device(device, rank))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_RENDEZVOUS_TIMEOUT)


def collective_device(device: torch.device) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else torch.device("cpu")


def follow(loaded) -> None:
    """On ranks 1..N-1: do what rank 0 says until it says to exit."""
    parallel, runner = loaded.parallel, None
    while True:
        op, *values = parallel.receive()
        if op == OP_STEP:
            runner.follow_step(values)
        elif op == OP_LOGITS:
            runner.follow_logits(values[0])
        elif op == OP_RUNNER:
            runner = None  # the previous one's cache goes first
            runner = loaded.runner(parallel.receive_object())
            runner.bind_thread()
        elif op == OP_CLOSE:
            runner = None
        elif op == OP_EXIT:
            return
        else:
            raise RuntimeError(f"rank {parallel.rank}: rank 0 sent op {op}, which is none of ours")
