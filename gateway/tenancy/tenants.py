"""Tenants: whom an API key belongs to, and what that tenant may use (--tenants-file).

An operator who serves several teams or customers from one fleet gives each a
tenant: its keys, a fair-share weight, limits per minute on requests and on
tokens (prompt plus output, as OpenAI counts them), a limit on concurrent
requests, the most urgent priority it may ask for, the models it may call and
a max_tokens ceiling. The limits hold across every gateway (quotas.py).

The file is TOML or YAML, by its suffix. It is read again when it changes and
on SIGHUP, without a restart: a key added is let in at once, a key removed is
refused at once, and requests in flight go on. A file that no longer parses
is logged and the tenants read before stay: a typo must neither open the
gateway nor lock everyone out. At start, a bad file stops the gateway.

Keys are kept only as SHA-256 digests (the file may give them so, as
`sha256:<hex>`): a presented key is hashed and looked up, so that neither the
memory nor the time a lookup takes gives a key away.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from pathlib import Path

import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bus.topics import PRIORITIES

log = structlog.get_logger(__name__)

_HASHED = "sha256:"


class Tenant(BaseModel):
    """One tenant's entry. A limit left out is no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[str] = Field(min_length=1)  # API keys, as given or as `sha256:<hex>`
    weight: float = Field(1.0, gt=0)  # its share against other tenants of the same priority
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt and output tokens
    max_concurrent: int | None = Field(None, ge=1)  # requests in flight at once, across the gateways
    # The most urgent priority it may use (1 is the most urgent): a request asking for a more urgent one runs at
    # this one. Lowered rather than refused: MindIE's clients send a priority as a wish, and a tenant's request
    # should not fail because its client always asks for 1.
    max_priority: int = Field(PRIORITIES[0], ge=PRIORITIES[0], le=PRIORITIES[-1])
    # The models it may call, by their canonical (first served) names, whatever alias a request uses; and the
    # adapters, by name. Empty: all.
    models: list[str] = []
    max_tokens: int | None = Field(None, ge=1)  # a ceiling on tokens generated per request

    @field_validator("keys")
    @classmethod
    def _keys_are_usable(cls, keys: list[str]) -> list[str]:
        for key in keys:
            digest = key.removeprefix(_HASHED)
            if not key.strip():
                raise ValueError("a key is empty")
            if key.startswith(_HASHED) and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
                raise ValueError(f"{key[:12]}...: a hashed key is sha256: and 64 lower-case hex digits")
        return keys

    def digests(self) -> list[str]:
        return [key.removeprefix(_HASHED) if key.startswith(_HASHED) else digest_of(key.encode()) for key in self.keys]


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # The per-minute limits are measured over a sliding window of this many seconds, as that share of a minute
    # (600 requests per minute over 10 s: 100 per 10 s). A shorter window spreads a minute's quota more evenly.
    rate_window_s: int = Field(60, ge=1, le=60)
    tenants: dict[str, Tenant]


class TenantsFileError(Exception):
    """The tenants file cannot be read, or says something that cannot be: the message names the entry."""


def digest_of(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def read_tenants_file(path: str) -> TenantsFile:
    """The file parsed and checked; TenantsFileError naming the entry and what is wrong with it."""
    try:
        text = Path(path).read_text()
        raw = yaml.safe_load(text) if Path(path).suffix in (".yaml", ".yml") else tomllib.loads(text)
        parsed = TenantsFile.model_validate(raw)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError) as error:
        raise TenantsFileError(f"{path}: {error}") from None
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}" for e in error.errors())
        raise TenantsFileError(f"{path}: {problems}") from None
    owners: dict[str, str] = {}
    for name, tenant in parsed.tenants.items():
        for digest in tenant.digests():
            if digest in owners:
                raise TenantsFileError(f"{path}: a key of tenant {name} is also one of tenant {owners[digest]}")
            owners[digest] = name
    return parsed


class Tenants:
    """The tenants of a file, as last read well; `reload_if_changed` and `reload` read it again."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stamp_now()
        self._file = read_tenants_file(path)  # raises at start: a gateway does not start on a bad file
        self._by_digest = self._index(self._file)

    @staticmethod
    def _index(file: TenantsFile) -> dict[str, str]:
        return {digest: name for name, tenant in file.tenants.items() for digest in tenant.digests()}

    def _stamp_now(self) -> tuple[int, int] | None:
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        return status.st_mtime_ns, status.st_size

    @property
    def window_s(self) -> int:
        return self._file.rate_window_s

    def names(self) -> list[str]:
        return sorted(self._file.tenants)

    def get(self, name: str) -> Tenant | None:
        return self._file.tenants.get(name)

    def of_digest(self, digest: str) -> str | None:
        """The name of the tenant whose key has this SHA-256 digest (digest_of); None if it is no tenant's."""
        return self._by_digest.get(digest)

    def reload_if_changed(self) -> None:
        if self._stamp_now() != self._stamp:
            self.reload()

    def reload(self) -> None:
        """Read the file again; if it no longer reads well, say why and keep the tenants read before."""
        self._stamp = self._stamp_now()
        try:
            file = read_tenants_file(self.path)
        except TenantsFileError as error:
            log.error("tenants_file_not_reloaded", error=str(error), kept=self.names())
            return
        before = self._file.tenants
        self._file, self._by_digest = file, self._index(file)
        changed = [name for name in file.tenants if name in before and file.tenants[name] != before[name]]
        log.info(
            "tenants_reloaded",
            path=self.path,
            added=sorted(set(file.tenants) - set(before)),
            removed=sorted(set(before) - set(file.tenants)),
            changed=changed,
            keys=len(self._by_digest),
        )
