"""`kvindex serve`'s HTTP security and limit flags: tokens, TLS, body and lookup limits.

Kept apart from serve.py: `add_http_arguments` registers the flags, `http_options` checks
them (a one-line usage error for each problem) and says what to give `create_app` and
uvicorn.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import ssl
import sys
from dataclasses import dataclass, field
from typing import Any

from kvindex.cli.common import UsageError, positive_int, positive_seconds
from kvindex.security.http import HttpGuard

__all__ = ["HttpOptions", "add_http_arguments", "http_options", "warn_if_exposed"]

TOKEN_ENV = "KVINDEX_TOKEN"
METRICS_TOKEN_ENV = "KVINDEX_METRICS_TOKEN"
DEFAULT_MAX_BODY = 32 * 1024 * 1024
DEFAULT_MAX_LOOKUP = 1_000_000


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP security and limits")
    g.add_argument(
        "--token",
        metavar="TOKEN",
        help=f"require 'Authorization: Bearer TOKEN' (except /healthz, /metrics); "
        f"default: ${TOKEN_ENV} (safer than a flag, which `ps` shows)",
    )
    g.add_argument(
        "--metrics-token",
        metavar="TOKEN",
        help=f"require this bearer token on /metrics; default: ${METRICS_TOKEN_ENV}",
    )
    g.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    g.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    g.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY,
        metavar="N",
        help=f"largest request body (default: {DEFAULT_MAX_BODY})",
    )
    g.add_argument(
        "--max-lookup-tokens",
        type=positive_int,
        default=DEFAULT_MAX_LOOKUP,
        metavar="N",
        help=f"most token ids (or hashes) in one lookup (default: {DEFAULT_MAX_LOOKUP})",
    )
    g.add_argument(
        "--request-timeout",
        type=positive_seconds,
        default=30.0,
        metavar="S",
        help="seconds for a request body to arrive (default: 30)",
    )


@dataclass(frozen=True, slots=True)
class HttpOptions:
    guard: HttpGuard = field(default_factory=HttpGuard)
    max_body_bytes: int = DEFAULT_MAX_BODY
    tls_cert: str | None = None
    tls_key: str | None = None

    def uvicorn_kwargs(self) -> dict[str, Any]:
        if self.tls_cert is None:
            return {}
        return {"ssl_certfile": self.tls_cert, "ssl_keyfile": self.tls_key}


def _token(value: str | None, env: str, flag: str) -> str | None:
    token = value if value is not None else os.environ.get(env)
    if token is None:
        return None
    if not token.strip() or token != token.strip() or len(token) < 16:
        raise UsageError(f"{flag} (or ${env}) must be at least 16 characters, no spaces around")
    return token


def _check_tls(cert: str | None, key: str | None) -> None:
    if (cert is None) != (key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if cert is None or key is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"can't use --tls-cert {cert} / --tls-key {key}: {exc}") from None


def http_options(args: argparse.Namespace) -> HttpOptions:
    _check_tls(args.tls_cert, args.tls_key)
    guard = HttpGuard(
        token=_token(args.token, TOKEN_ENV, "--token"),
        metrics_token=_token(args.metrics_token, METRICS_TOKEN_ENV, "--metrics-token"),
        max_lookup_items=args.max_lookup_tokens,
        request_timeout=args.request_timeout,
    )
    return HttpOptions(guard, args.max_body_bytes, args.tls_cert, args.tls_key)


def warn_if_exposed(host: str, options: HttpOptions) -> None:
    """One warning line when the API listens beyond loopback without a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and options.guard.token is None:
        print(
            f"kvindex serve: warning: listening on {host} without --token: anyone who can "
            "reach it can read the index and add or remove instances",
            file=sys.stderr,
            flush=True,
        )
