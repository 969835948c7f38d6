"""The gateway's settings: its service on the bus, its HTTP server, the media it may load.

A light module (dataclasses, and the API keys file read), so that a command's
settings are built and checked (tokenrelay/settings.py) before the web stack
is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MB = 1024 * 1024


@dataclass(frozen=True)
class GatewaySettings:
    topic_prefix: str = "tokenrelay"
    gateway_id: str = ""  # empty: a fresh random id per process
    default_timeout_s: int = 600
    default_priority: int = 5
    default_model: str = ""  # what /infer_token and /infer serve; empty: the only model served
    full_text: bool = False  # MindIE's fullTextEnabled: stream events carry the text so far
    max_in_flight: int = 4096  # requests waiting for their last event; beyond: 429
    # Requests of a model waiting for a worker, as this gateway sees them, past which one that would wait too
    # gets 429 at once (dispatch/dispatcher.py's queue_ahead); 0: no bound.
    max_waiting_requests: int = 0
    route: bool = True  # pick each request's worker (dispatch/router.py); False: the shared queue decides
    # Bearer keys that may load and unload LoRA adapters at run time (routes/lora.py); none: refused.
    admin_api_keys: tuple[str, ...] = ()
    lora_root: str = ""  # resolved: the directory run-time adapters must lie under; empty: refused
    tenants_file: str = ""  # API keys' tenants and their limits (tenancy/tenants.py); empty: no tenants
    # A body's field no document lists: True refuses it (422), False ignores it and names it (bodies/ignored_fields.py).
    reject_unknown_fields: bool = False


@dataclass(frozen=True)
class MediaPolicy:
    media_dir: Path = Path("/data/multimodal_inputs")
    allowed_domains: frozenset[str] = frozenset()  # host names or IP literals, lower case
    max_bytes: dict[str, int] = field(
        default_factory=lambda: {"image_url": 40 * MB, "audio_url": 40 * MB, "video_url": 512 * MB}
    )
    fetch_timeout_s: float = 10.0

    @staticmethod
    def parse_domains(value: str) -> frozenset[str]:
        return frozenset(d.strip().lower() for d in value.split(",") if d.strip())


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP server in front: where it listens, what it lets in."""

    host: str = "127.0.0.1"
    port: int = 1025  # MindIE's
    max_request_bytes: int = 40 * MB  # a larger body is answered 413 before it is parsed (maxRequestLength)
    api_keys: tuple[str, ...] = ()  # Bearer keys clients must send; none (and no file): open
    api_keys_file: str = ""  # more keys, one per line; read when the server is built
    tls_cert: str = ""  # PEM certificate chain: https (with tls_key)
    tls_key: str = ""
    tls_ca: str = ""  # PEM CA bundle: client certificates it signed are required (mutual TLS)
    media: MediaPolicy = field(default_factory=MediaPolicy)


def load_keys(keys: Sequence[str], keys_file: str) -> list[str]:
    """The keys given directly, and those of `keys_file` (one per line; blank lines and # comments skipped)."""
    found = [k.strip() for k in keys if k.strip()]
    if keys_file:
        for line in Path(keys_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found
