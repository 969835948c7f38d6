"""A model that is only a step-time profile, so that one machine can stand in for a fleet of workers.

The engine runs unchanged around it (scheduler, block manager, prefix
cache, preemption, detokenizer, LoRA adapters' device slots); a step waits
as long as the profile says that step takes (and an adapter's load too),
and each drawn token comes from the request's seed and the token's index
alone, so a stream is checkable and a failed-over one goes on
exactly. Nothing here imports torch or loads weights.

Its tokenizer cuts UTF-8 text into 4-byte pieces (so equal prefixes give
equal tokens, as a real tokenizer's do) and spells every token as three
letters and a space; generation never draws EOS, so a request gets its
max_new_tokens. It has no hidden states, so it computes no embeddings.
"""

from __future__ import annotations

import string
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

from schemas.adapters import read_adapter
from workers.engine.adapters import Adapters
from workers.engine.config import EngineConfig
from workers.engine.scheduler import Chunk
from workers.engine.step_output import Scored, StepOutput
from workers.simulated.profile import Profile

_SPECIALS = 3  # pad, bos, eos
_LETTERS = string.ascii_lowercase
_WORDS = len(_LETTERS) ** 3
VOCAB_SIZE = _SPECIALS + _WORDS
EOS = 2
_BYTES_PER_TOKEN = 4
_MASK64 = 2**64 - 1


def _word(token_id: int) -> str:
    if token_id < _SPECIALS:
        return ""
    n = token_id - _SPECIALS
    return _LETTERS[n // 676] + _LETTERS[n // 26 % 26] + _LETTERS[n % 26] + " "


def _mix(x: int) -> int:
    """splitmix64's finaliser: neighbouring inputs give unrelated outputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def simulated_token(seed: int, index: int) -> int:
    """The token a simulated worker draws at `index` of a request with `seed`."""
    return _SPECIALS + _mix((seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64) % _WORDS


class SimulatedTokenizer:
    """A Hugging Face tokenizer's calls, as the engine makes them; it has no special tokens to add."""

    chat_template = "role: content, one line each"

    def __call__(
        self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False
    ) -> dict[str, list]:
        data = text.encode()
        starts = range(0, len(data), _BYTES_PER_TOKEN)
        encoded: dict[str, list] = {
            "input_ids": [_SPECIALS + zlib.crc32(data[i : i + _BYTES_PER_TOKEN]) % _WORDS for i in starts]
        }
        if return_offsets_mapping:  # the characters each piece's bytes touch
            char_of_byte = [index for index, char in enumerate(text) for _ in char.encode()]
            last_byte = [min(i + _BYTES_PER_TOKEN, len(data)) - 1 for i in starts]
            encoded["offset_mapping"] = [
                (char_of_byte[i], char_of_byte[j] + 1) for i, j in zip(starts, last_byte, strict=True)
            ]
        return encoded

    def apply_chat_template(
        self,
        messages,
        tools=None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tokenize: bool = True,
    ):
        text = "".join(f"<tools> {tool}\n" for tool in tools or ())
        text += "".join(f"<{m['role']}> {m['content']}\n" for m in messages)
        text = text.removesuffix("\n") if continue_final_message else text
        text += "<assistant> " if add_generation_prompt else ""
        return self(text) if tokenize else text

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [("<pad>", "<s>", "</s>")[t] if t < _SPECIALS else _word(t) for t in token_ids]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(_word(t) for t in token_ids)


class SimulatedRunner:
    """The engine's runner: a step sleeps for the profile's time and draws `simulated_token`s."""

    def __init__(self, profile: Profile, config: EngineConfig) -> None:
        self._cost = profile.step
        self.block_size = config.block_size
        self.num_blocks = profile.kv_cache_tokens // config.block_size
        # Adapters in device slots as a loaded model has them; a load costs the profile's time, and nothing is
        # computed with them (an adapter changes no simulated token).
        self.adapters = None
        if config.max_loras:
            self.adapters = Adapters(
                config.max_loras,
                config.max_cpu_loras or config.max_loras,
                lambda path: (read_adapter(path, config.max_lora_rank), {}),
                lambda slot, adapter: time.sleep(profile.adapter_load_s),
            )
        self.busy_s = 0.0  # time spent in steps, since start

    def bind_thread(self) -> None:
        """Nothing is bound to a thread here."""

    def yield_between_layers(self, callback: Callable[[], None]) -> None:
        """A simulated step is one wait, with no layers to pause between."""

    def close(self) -> None:
        """Nothing is held."""

    def execute(self, chunks: list[Chunk], drawing: list[Chunk]) -> StepOutput:
        prompt = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        decodes = sum(1 for c in chunks if c.num_tokens == 1)
        context = sum(c.sequence.num_cached_tokens + c.num_tokens for c in chunks)
        seconds = self._cost.seconds(prompt, decodes, context)
        time.sleep(seconds)
        self.busy_s += seconds
        tokens = [simulated_token(c.sequence.request.sampling.seed, c.sequence.next_index) for c in drawing]
        # The simulated model is sure of every token it draws: log-probability 0, and no alternative.
        logprobs = [
            None
            if c.sequence.request.sampling.logprobs is None
            else Scored(0.0, [(t, 0.0)][: c.sequence.request.sampling.logprobs])
            for c, t in zip(drawing, tokens, strict=True)
        ]
        return StepOutput(tokens, logprobs)


@dataclass(frozen=True)
class SimulatedModel:
    """What the engine needs of a model (see engine.Model), from a profile."""

    profile: Profile
    tokenizer: SimulatedTokenizer = SimulatedTokenizer()
    vocab_size: int = VOCAB_SIZE
    max_position_embeddings: int = 1024 * 1024
    eos_token_ids: frozenset[int] = frozenset([EOS])
    device_type: str = "sim"
    tensor_parallel_size: int = 1
    pooling: None = None  # no hidden states to pool: embed requests are refused (424), naming the model

    def runner(self, config: EngineConfig, capture=None, draft=None) -> SimulatedRunner:
        return SimulatedRunner(self.profile, config)

    def grammars(self) -> None:
        """A simulated model draws its tokens by formula: no grammar can constrain them."""
        return None

    def vision(self) -> None:
        return None  # its tokens come from a formula: no image could change them

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """`config` with the profile's batch size and step budget where it leaves them open."""
        return replace(
            config,
            max_batch_size=config.max_batch_size or self.profile.max_batch_size,
            max_tokens_per_step=config.max_tokens_per_step or self.profile.max_tokens_per_step,
        )
