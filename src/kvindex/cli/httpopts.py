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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvindex.cli.common import UsageError, positive_int, positive_seconds
from kvindex.security.http import HttpGuard, default_allowed_hosts
from kvindex.security.limits import Limits

__all__ = ["HttpOptions", "add_http_arguments", "http_options", "warn_if_exposed"]

TOKEN_ENV = "KVINDEX_TOKEN"
METRICS_TOKEN_ENV = "KVINDEX_METRICS_TOKEN"
ADMIN_TOKEN_ENV = "KVINDEX_ADMIN_TOKEN"
DEFAULT_MAX_BODY = 32 * 1024 * 1024
DEFAULT_MAX_LOOKUP = 1_000_000
DEFAULT_REQUEST_TIMEOUT = 30.0
DEFAULT_MAX_STREAMS = 32
_LIMITS = Limits()  # the front's defaults (kvindex.security.limits)


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP security and limits")
    g.add_argument(
        "--token",
        metavar="TOKEN",
        help=f"require 'Authorization: Bearer TOKEN' (except /healthz, /metrics); default: the "
        f"config file's token_file or token_env, else ${TOKEN_ENV} (safer than a flag, which "
        "`ps` shows)",
    )
    g.add_argument(
        "--metrics-token",
        metavar="TOKEN",
        help="require this bearer token on /metrics; default: the config file's "
        f"metrics_token_file or metrics_token_env, else ${METRICS_TOKEN_ENV}",
    )
    g.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="the token that may add and remove instances (POST/DELETE /v1/instances, "
        "/register, /unregister), which the query token (--token) may not; default: the "
        f"config file's admin_token_file or admin_token_env, else ${ADMIN_TOKEN_ENV}",
    )
    g.add_argument(
        "--no-fleet-changes",
        dest="fleet_changes",
        action="store_const",
        const=False,
        default=None,
        help="refuse every request that adds or removes instances (403), whatever its token: "
        "the fleet is what the command line and config file say",
    )
    g.add_argument(
        "--allowed-hosts",
        metavar="NAMES",
        type=_host_names,
        help="Host names the API answers besides localhost and the --http host (comma-"
        "separated; IP addresses always pass; '*' for any): a DNS-rebound name is refused",
    )
    g.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    g.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    # No argparse defaults below: a flag not given leaves the config file's value.
    g.add_argument(
        "--max-body-bytes",
        type=positive_int,
        metavar="N",
        help=f"largest request body (default: {DEFAULT_MAX_BODY})",
    )
    g.add_argument(
        "--max-lookup-tokens",
        type=positive_int,
        metavar="N",
        help=f"most token ids (or hashes) in one lookup (default: {DEFAULT_MAX_LOOKUP})",
    )
    g.add_argument(
        "--max-streams",
        type=positive_int,
        metavar="N",
        help=f"dashboard event streams open at once; more get 503 (default: {DEFAULT_MAX_STREAMS})",
    )
    g.add_argument(
        "--max-header-bytes",
        type=positive_int,
        metavar="N",
        help="largest request line and headers, counted as they arrive, before the token is "
        f"checked; more: 431 (default: {_LIMITS.max_header_bytes})",
    )
    g.add_argument(
        "--header-timeout",
        type=positive_seconds,
        metavar="S",
        help="seconds for a request's line and headers to arrive; later: 408 (default: "
        f"{_LIMITS.header_timeout:g})",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        metavar="N",
        help=f"HTTP connections open at once; more: 503 (default: {_LIMITS.max_connections})",
    )
    g.add_argument(
        "--tls-handshake-timeout",
        type=positive_seconds,
        metavar="S",
        help="seconds for a TLS handshake (with --tls-cert) before the connection is closed "
        f"(default: {_LIMITS.tls_handshake_timeout:g})",
    )
    g.add_argument(
        "--request-timeout",
        type=positive_seconds,
        metavar="S",
        help=f"seconds for a request body to arrive (default: {DEFAULT_REQUEST_TIMEOUT:g})",
    )


@dataclass(frozen=True, slots=True)
class HttpOptions:
    guard: HttpGuard = field(default_factory=HttpGuard)
    max_body_bytes: int = DEFAULT_MAX_BODY
    tls_cert: str | None = None
    tls_key: str | None = None
    limits: Limits = field(default_factory=Limits)  # the front's, before the token

    def uvicorn_kwargs(self) -> dict[str, Any]:
        if self.tls_cert is None:
            return {}
        return {"ssl_certfile": self.tls_cert, "ssl_keyfile": self.tls_key}


def _host_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(" " in name or "/" in name for name in names):
        raise argparse.ArgumentTypeError(f"must be host names separated by commas, got {text!r}")
    return names


def _allowed_hosts(bind_host: str, extra: list[str] | None) -> tuple[str, ...]:
    names = [*default_allowed_hosts(bind_host), *(extra or [])]
    return ("*",) if "*" in names else tuple(dict.fromkeys(n.lower() for n in names))


def _token(value: str | None, configured: str | None, env: str, flag: str) -> str | None:
    """The flag, else the config file's (token_file / token_env), else $ENV."""
    token = value if value is not None else configured
    if token is None:
        token = os.environ.get(env)
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


def http_options(
    args: argparse.Namespace,
    configured: Mapping[str, Any] | None = None,
    bind_host: str | None = None,
) -> HttpOptions:
    """The flags, over what the config file set (`Settings.http_options`), over defaults.
    With `bind_host` (where serve listens), Host names are checked: that one, localhost,
    and those the flag or the file add."""
    file = configured or {}

    def pick(name: str, default: Any = None) -> Any:
        flag = getattr(args, name, None)
        return flag if flag is not None else file.get(name, default)

    tls_cert, tls_key = pick("tls_cert"), pick("tls_key")
    _check_tls(tls_cert, tls_key)
    token = _token(args.token, file.get("token"), TOKEN_ENV, "--token")
    admin_token = _token(
        getattr(args, "admin_token", None),
        file.get("admin_token"),
        ADMIN_TOKEN_ENV,
        "--admin-token",
    )
    if admin_token is not None and admin_token == token:
        raise UsageError("--admin-token must differ from --token (the query token)")
    guard = HttpGuard(
        token=token,
        metrics_token=_token(
            args.metrics_token, file.get("metrics_token"), METRICS_TOKEN_ENV, "--metrics-token"
        ),
        admin_token=admin_token,
        fleet_changes=pick("fleet_changes", True),
        max_streams=pick("max_streams", DEFAULT_MAX_STREAMS),
        max_lookup_items=pick("max_lookup_tokens", DEFAULT_MAX_LOOKUP),
        request_timeout=pick("request_timeout", DEFAULT_REQUEST_TIMEOUT),
        allowed_hosts=None
        if bind_host is None
        else _allowed_hosts(bind_host, pick("allowed_hosts")),
    )
    defaults = Limits()
    limits = Limits(
        max_header_bytes=pick("max_header_bytes", defaults.max_header_bytes),
        header_timeout=pick("header_timeout", defaults.header_timeout),
        max_connections=pick("max_connections", defaults.max_connections),
        tls_handshake_timeout=pick("tls_handshake_timeout", defaults.tls_handshake_timeout),
    )
    max_body = pick("max_body_bytes", DEFAULT_MAX_BODY)
    return HttpOptions(guard, max_body, tls_cert, tls_key, limits)


def warn_if_exposed(host: str, options: HttpOptions) -> None:
    """One warning line when the API listens beyond loopback without a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    guard = options.guard
    if loopback:
        return
    if guard.token is None:
        what = "read the index" + (
            " and add or remove instances" if guard.fleet_changes and not guard.admin_token else ""
        )
        print(
            f"kvindex serve: warning: listening on {host} without --token: anyone who can "
            f"reach it can {what}",
            file=sys.stderr,
            flush=True,
        )
