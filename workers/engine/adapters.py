"""The LoRA adapters an engine serves: read from disk into a host cache, put into the model's device slots on demand.

Two tiers, as in vLLM: `max_loras` device slots (the pools of models/lora.py,
whose size every step's LoRA products are computed over) and a host cache of
`max_cpu_loras` adapters read from disk. A request names its adapter and its
directory (the gateway checked it); on admission its adapter is read into the
host cache, or found there, and pinned until the request ends, so that
scheduling never waits on a disk. The scheduler gives a sequence a device
slot when it starts (the adapter's own, if another sequence of it holds one;
else a free slot, else one of those the router names as held by other
workers too, else the least recently used one no running sequence holds)
and takes it back when the sequence ends or is preempted. A sequence whose
adapter finds no slot waits, while others go ahead. Unpinned adapters leave
the host cache least recently used first once it is over its size.

`read(path)` reads an adapter (checked against the model) and `write(slot,
adapter)` puts its weights in a slot: the model runner's read its tensors and
write the model's pools; a simulated runner's read only its config and
header, and a write costs only time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from schemas.adapters import WEIGHTS_FILE, AdapterError, AdapterSpec, LoraSupport, check_fits, read_adapter

log = structlog.get_logger(__name__)


@dataclass
class HostAdapter:
    """An adapter read into memory: its spec and (layer, module) -> (A, B) tensors, as the checkpoint holds them."""

    name: str
    spec: AdapterSpec
    weights: Weights
    pins: int = 0  # requests admitted with it and not ended

    @property
    def path(self) -> str:
        return str(self.spec.path)


Weights = dict[tuple[int, str], tuple[Any, Any]]  # (layer, module) -> (A, B)


def load_adapter(path: str, support: LoraSupport) -> tuple[AdapterSpec, Weights]:
    """The adapter in `path`, checked against the model `support` describes, and its tensors."""
    from safetensors.torch import load_file

    spec = read_adapter(path, support.max_rank)
    check_fits(spec, support)
    try:
        tensors = load_file(spec.path / WEIGHTS_FILE)
    except Exception as error:  # a file that changed or broke since the header was read
        raise AdapterError(f"adapter at {path}: its weights cannot be read ({error})") from error
    names = spec.tensor_names
    return spec, {
        (layer, module): (tensors[names[layer, module, "A"]], tensors[names[layer, module, "B"]])
        for layer, module, matrix in names
        if matrix == "A"
    }


@dataclass
class _Slot:
    adapter: HostAdapter | None = None
    holders: int = 0  # running sequences computing under it


@dataclass
class AdapterCounts:
    """Since start: adapters put in a device slot, and taken out of one for another."""

    loads: int = 0
    evictions: int = 0
    by_name: dict[str, int] = field(default_factory=dict)  # loads per adapter


class Adapters:
    def __init__(
        self,
        slots: int,
        host_slots: int,
        read: Callable[[str], tuple[AdapterSpec, Weights]],
        write: Callable[[int, HostAdapter], None],
        support: LoraSupport | None = None,
    ) -> None:
        """`support`: what the model takes of adapters, as workers announce it; None: not known (simulated)."""
        self.support = support
        self._read, self._write = read, write
        self._slots = [_Slot() for _ in range(slots)]
        self._recent: OrderedDict[int, None] = OrderedDict.fromkeys(range(slots))  # least recently used first
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()
        self._host_slots = host_slots
        self.counts = AdapterCounts()

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def rank(self) -> int:
        """The highest rank among the adapters in device slots: a step computes with that many components."""
        return max((s.adapter.spec.rank for s in self._slots if s.adapter is not None), default=1)

    def resident(self) -> tuple[list[str], list[str]]:
        """The adapters in device slots, most recently used first, and those of them no running sequence holds
        (called from another thread than the engine's: the order is copied in one go)."""
        slots = [self._slots[i] for i in reversed(list(self._recent))]
        served = [s for s in slots if s.adapter is not None and self._host.get(s.adapter.name) is s.adapter]
        return [s.adapter.name for s in served], [s.adapter.name for s in served if s.holders == 0]

    def pin(self, name: str, path: str) -> HostAdapter:
        """Adapter `name` (from directory `path`), in the host cache until `unpin`; AdapterError if it cannot be
        served. The sequence keeps what this returns: an adapter unloaded meanwhile still serves it."""
        adapter = self._host.get(name)
        if adapter is not None and adapter.path != path:  # unloaded and loaded again from elsewhere
            self.forget(name)
            adapter = None
        if adapter is None:
            spec, weights = self._read(path)
            adapter = self._host[name] = HostAdapter(name, spec, weights)
            log.info("adapter_read", adapter=name, path=path, rank=spec.rank, targets=list(spec.targets))
        adapter.pins += 1
        self._host.move_to_end(name)
        self._trim_host()
        return adapter

    def check(self, name: str, path: str) -> None:
        """Read adapter `name` into the host cache (AdapterError if it cannot be served), unpinned."""
        self.unpin(self.pin(name, path))

    def unpin(self, adapter: HostAdapter) -> None:
        adapter.pins -= 1
        self._trim_host()

    def _trim_host(self) -> None:
        held = {id(s.adapter) for s in self._slots}
        idle = [name for name, adapter in self._host.items() if adapter.pins == 0 and id(adapter) not in held]
        while len(self._host) > self._host_slots and idle:
            del self._host[idle.pop(0)]

    def can_acquire(self, adapter: HostAdapter) -> bool:
        """Whether a sequence of `adapter` would get a device slot now."""
        return any(s.holders == 0 or s.adapter is adapter for s in self._slots)

    def acquire(self, adapter: HostAdapter, evict_first: tuple[str, ...] = ()) -> int:
        """A device slot holding `adapter`, for a sequence that starts; call can_acquire first. Should `adapter`
        have to be loaded, it goes into a free slot, else into one of `evict_first`'s, else into the least
        recently used one that no running sequence holds."""
        index = next((i for i, s in enumerate(self._slots) if s.adapter is adapter), None)
        if index is None:
            unheld = [i for i in self._recent if self._slots[i].holders == 0]  # least recently used first
            first = [i for i in unheld if self._slots[i].adapter is None or self._slots[i].adapter.name in evict_first]
            index = (first or unheld)[0]
            slot = self._slots[index]
            if slot.adapter is not None:
                self.counts.evictions += 1
                log.info("adapter_evicted", adapter=slot.adapter.name, slot=index)
            slot.adapter = adapter
            self._write(index, adapter)
            self.counts.loads += 1
            self.counts.by_name[adapter.name] = self.counts.by_name.get(adapter.name, 0) + 1
            log.info("adapter_loaded", adapter=adapter.name, slot=index)
        self._slots[index].holders += 1
        self._recent.move_to_end(index)
        return index

    def release(self, index: int) -> None:
        self._slots[index].holders -= 1

    def forget(self, name: str) -> None:
        """Adapter `name` was unloaded: out of the host cache, and its idle device slot free; sequences that
        hold it finish with it."""
        adapter = self._host.pop(name, None)
        for index, slot in enumerate(self._slots):
            if slot.adapter is not None and slot.adapter is adapter and slot.holders == 0:
                slot.adapter = None
                self._recent.move_to_end(index, last=False)
