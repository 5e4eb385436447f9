"""ZMQ CURVE keys: generating and reading them, and setting them on sockets.

Key files are text: comment lines (`#`) and one Z85 key (40 characters). A public key file
(`NAME.key`) can be handed to anyone; a secret key file (`NAME.key_secret`, mode 0600)
holds the secret key only (its public half is derived from it). pyzmq's certificate files
(`zmq.auth.create_certificates`) are read too.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

__all__ = [
    "CurveClient",
    "KeyFileError",
    "KeyFiles",
    "check_private",
    "client_setup",
    "generate_keys",
    "is_key",
    "read_public_key",
    "read_secret_key",
    "server_setup",
]

_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_PUBLIC_HEADER = "# kvindex CURVE public key (Z85): give it to the peers that must trust it\n"
_SECRET_HEADER = "# kvindex CURVE secret key (Z85): keep it private (mode 0600)\n"


class KeyFileError(ValueError):
    """A key or key file that can't be used; the message says why."""


def is_key(text: str) -> bool:
    """Whether `text` is a Z85-encoded CURVE key (40 characters)."""
    return _Z85_KEY.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class KeyFiles:
    public: Path
    secret: Path
    public_key: str


def generate_keys(out_dir: Path, name: str, *, force: bool = False) -> KeyFiles:
    """Write a new key pair as `out_dir/NAME.key` and `out_dir/NAME.key_secret` (0600)."""
    public, secret = zmq.curve_keypair()
    out_dir.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = out_dir / f"{name}.key", out_dir / f"{name}.key_secret"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise KeyFileError(f"{path} exists (use --force to replace it)")
    _write(secret_path, _SECRET_HEADER + secret.decode() + "\n", 0o600)
    _write(public_path, _PUBLIC_HEADER + public.decode() + "\n", 0o644)
    return KeyFiles(public_path, secret_path, public.decode())


def _write(path: Path, text: str, mode: int) -> None:
    # Created with its final mode: a secret is never readable by others, not even briefly.
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.chmod(tmp, mode)  # whatever the umask
    os.replace(tmp, path)


def _key_line(path: Path) -> tuple[str, str]:
    """The key in a file and what it says it is: "secret", "public" or "" (a bare key)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"can't read key file {path}: {exc}") from None
    if "public-key" in text or "secret-key" in text:  # a pyzmq certificate
        return _certificate_key(path)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if len(lines) != 1 or not is_key(lines[0]):
        raise KeyFileError(f"{path} does not hold one Z85 CURVE key (40 characters)")
    comments = " ".join(ln.lower() for ln in text.splitlines() if ln.startswith("#"))
    if "secret" in comments or path.suffix == ".key_secret":
        return lines[0], "secret"
    return lines[0], "public" if "public" in comments else ""


def _certificate_key(path: Path) -> tuple[str, str]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"can't read certificate {path}: {exc}") from None
    if secret:
        return secret.decode(), "secret"
    return public.decode(), "public"


def read_public_key(value: str) -> str:
    """A public key given as Z85 text, or as a file holding one (or a secret key, whose
    public half is taken)."""
    if is_key(value):
        return value
    key, kind = _key_line(Path(value))
    return zmq.curve_public(key.encode()).decode() if kind == "secret" else key


def read_secret_key(path: str | Path) -> tuple[str, str]:
    """(public, secret) from a secret key file."""
    key, kind = _key_line(Path(path))
    if kind == "public":
        raise KeyFileError(f"{path} holds a public key, not a secret one")
    return zmq.curve_public(key.encode()).decode(), key


def check_private(path: str | Path) -> None:
    """Refuse a secret key file that others can read or write (as ssh refuses a private
    key with group or other permissions): whoever reads it can be the server."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise KeyFileError(f"can't read key file {path}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise KeyFileError(
            f"{path} is accessible by others (mode {mode & 0o777:04o}): a secret key must be "
            f"private to its owner (chmod 600 {path})"
        )


@dataclass(frozen=True, slots=True)
class CurveClient:
    """What a CURVE client socket needs: the server's public key and its own key pair."""

    server_key: str
    public_key: str
    secret_key: str = field(repr=False)

    @classmethod
    def create(cls, server_key: str, client_key_file: str | None) -> CurveClient:
        """With no key file, an ephemeral pair: encrypted, but the server can't tell who
        we are (a relay that allow-lists keys refuses it)."""
        if client_key_file is None:
            public, secret = (k.decode() for k in zmq.curve_keypair())
        else:
            public, secret = read_secret_key(client_key_file)
        return cls(server_key, public, secret)


def client_setup(sock: zmq.Socket[bytes], client: CurveClient) -> None:
    """Make `sock` a CURVE client of the server whose public key is `client.server_key`
    (before it connects)."""
    sock.curve_serverkey = client.server_key.encode()
    sock.curve_publickey = client.public_key.encode()
    sock.curve_secretkey = client.secret_key.encode()


def server_setup(secret_key: str) -> Callable[[zmq.Socket[bytes]], None]:
    """A socket setup (before bind) that makes sockets CURVE servers with this secret key;
    ZAP (an authenticator in the socket's context) decides which clients get in."""

    def setup(sock: zmq.Socket[bytes]) -> None:
        sock.curve_secretkey = secret_key.encode()
        sock.curve_publickey = zmq.curve_public(secret_key.encode())
        sock.curve_server = True
        sock.zap_domain = b"kvindex"

    return setup
