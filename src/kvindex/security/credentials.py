"""Secrets the operator names once, that clients refer to by name (docs/security.md).

A client of the HTTP API may add an engine (with the admin token), but never names a file,
an environment variable or a key of the host: those are the operator's. The config file
defines credentials,

    [credentials.sglang-prod]
    api_key_file = "/etc/kvindex/sglang-key"     # or api_key_env = "NAME"
    [credentials.relay-a]
    client_key = "/etc/kvindex/kvindex.key_secret"   # our CURVE secret key, for a relay

and a spec refers to one, `NAME=sglang+http://HOST:PORT,credential=sglang-prod` or
`NAME=tcp://HOST:PORT,curve=KEY,credential=relay-a`. Where a credential's secret is sent
or used is still bounded by the engine allow-list (kvindex.security.engines).

`registry` is the process's set (serve defines it from its config file at start). A key
read from a file is one line of printable ASCII, at most `MAX_KEY_CHARS`: anything else is
refused with one line that names the setting, never the file's contents.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_KEY_CHARS",
    "Credential",
    "CredentialError",
    "Credentials",
    "api_key_from_env",
    "read_key_file",
    "registry",
]

MAX_KEY_CHARS = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # no spaces, controls or line ends inside a key


class CredentialError(ValueError):
    """A credential that can't be used; the message names the setting, never a secret."""


def read_key_file(path: str | Path, setting: str) -> str:
    """The key a file holds: one printable line (a trailing line end is dropped), at most
    MAX_KEY_CHARS. Every failure is one line naming `setting` and the file, never what it
    holds."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_CHARS + 3)
    except OSError as exc:
        raise CredentialError(f"{setting}: can't read {path}: {exc.strerror or 'error'}") from None
    return _one_key(raw.removesuffix(b"\n").removesuffix(b"\r"), f"{setting} ({path})")


def api_key_from_env(variable: str, setting: str) -> str:
    """An API key held by an environment variable, under the same rules as a file's."""
    value = os.environ.get(variable)
    if value is None:
        raise CredentialError(f"{setting}: ${variable} is not set")
    return _one_key(value.encode("utf-8", "replace"), f"{setting} (${variable})")


def _one_key(raw: bytes, where: str) -> str:
    if not raw:
        raise CredentialError(f"{where} is empty")
    if len(raw) > MAX_KEY_CHARS:
        raise CredentialError(f"{where} holds more than {MAX_KEY_CHARS} characters: not a key")
    text = raw.decode("ascii", "replace")
    if not _PRINTABLE.fullmatch(text):
        raise CredentialError(
            f"{where} is not one line of printable ASCII without spaces (a key file holds "
            "the key alone)"
        )
    return text


@dataclass(frozen=True, slots=True)
class Credential:
    """A named secret of the operator's: an engine's API key (by file or environment
    variable), and/or a CURVE client secret key file."""

    name: str
    api_key_file: str | None = None
    api_key_env: str | None = None
    client_key: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise CredentialError(
                f"credential name {self.name!r} must be 1-64 letters, digits or _.- "
                "(starting with a letter or digit)"
            )
        if self.api_key_file is not None and self.api_key_env is not None:
            raise CredentialError(
                f"credential {self.name}: give api_key_file or api_key_env, not both"
            )
        if self.api_key_file is None and self.api_key_env is None and self.client_key is None:
            raise CredentialError(
                f"credential {self.name}: give api_key_file, api_key_env or client_key"
            )

    @property
    def has_api_key(self) -> bool:
        return self.api_key_file is not None or self.api_key_env is not None

    def api_key(self) -> str | None:
        """The API key, read now (a file may be rotated), or None if it holds none."""
        setting = f"credential {self.name}"
        if self.api_key_file is not None:
            return read_key_file(self.api_key_file, f"{setting}'s api_key_file")
        if self.api_key_env is not None:
            return api_key_from_env(self.api_key_env, f"{setting}'s api_key_env")
        return None


class Credentials:
    """The credentials defined, by name (thread-safe: discovery reads them on its thread)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Credential] = {}
        self._lock = threading.Lock()

    def define(self, credential: Credential) -> None:
        with self._lock:
            self._by_name[credential.name] = credential

    def replace(self, credentials: list[Credential]) -> None:
        """Make these the whole set (serve at start, from its config file)."""
        with self._lock:
            self._by_name = {c.name: c for c in credentials}

    def get(self, name: str) -> Credential:
        with self._lock:
            found = self._by_name.get(name)
        if found is None:
            raise CredentialError(f"unknown credential {name!r} (the config's [credentials.NAME])")
        return found

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)


registry = Credentials()
