"""A step-time model: how long an engine step of some shape takes on some model and device.

A step reads every weight once, computes every token it feeds, and reads
the cached keys and values of every sequence in it, so its time is close to
linear in those: a fixed part, a part per prompt token computed, a part per
decoding sequence, and a part per token of context attended to. Profiles
are JSON files; `tokenrelay bench profile` measures one from a real model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_prefill_token_s: float
    per_decode_sequence_s: float
    per_context_token_s: float

    def seconds(self, prefill_tokens: int, decode_sequences: int, context_tokens: int) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_sequence_s * decode_sequences
            + self.per_context_token_s * context_tokens
        )


@dataclass(frozen=True)
class Profile:
    name: str
    source: str  # how it was obtained: "measured: <command> on <machine>", or "estimate: <reasoning>"
    max_batch_size: int
    max_tokens_per_step: int
    kv_cache_tokens: int  # what its KV cache holds
    step: StepCost
    # Putting a LoRA adapter into a device slot. Estimate: a rank-16 adapter of every projection of an 8B
    # model is about 40 MB, copied from host memory at about 10 GB/s.
    adapter_load_s: float = 0.004

    @classmethod
    def load(cls, name_or_path: str) -> Profile:
        """A shipped profile by name (see `names()`), or a JSON file."""
        path = PROFILES / f"{name_or_path}.json"
        if not path.exists():
            path = Path(name_or_path)
        if not path.exists():
            raise ValueError(f"no simulation profile {name_or_path!r}: give a file or one of {', '.join(names())}")
        data = json.loads(path.read_text())
        return cls(**{**data, "step": StepCost(**data["step"])})

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


def names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))
