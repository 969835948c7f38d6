"""A rank of a tensor-parallel worker other than 0: the process ranks.py's `start` spawns.

It dies with rank 0 (PR_SET_PDEATHSIG) and ignores SIGTERM and SIGINT,
which rank 0 acts on; joins the group, loads its share of the model, and
does what rank 0 says (ranks.follow) until it says to exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys

import structlog
import torch
import torch.distributed as dist

from telemetry.logs import configure
from workers.engine.model_loader import load_shard
from workers.engine.parallel import TensorParallel
from workers.engine.ranks import collective_device, cpu_threads, follow, join, rank_device, rendezvous

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    _die_with(spec["parent"])
    configure(process=f"tokenrelay-rank-{spec['rank']}")
    structlog.contextvars.bind_contextvars(rank=spec["rank"])
    rank, size, device = spec["rank"], spec["size"], torch.device(spec["device"])
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(size))
    join(rank, size, device, rendezvous(spec["init"], size))
    parallel = TensorParallel(rank, size, collective_device(device))
    loaded = load_shard(spec["path"], rank_device(device, rank), spec["dtype"], parallel)
    log.info("tensor_parallel_rank_ready", rank=rank, size=size, device=str(rank_device(device, rank)))
    follow(loaded)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
