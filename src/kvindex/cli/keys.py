"""`kvindex keys`: generate a CURVE key pair for `kvindex relay` and its subscribers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvindex.cli.common import UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "keys",
        help="generate a CURVE key pair (relay server or subscriber client)",
        description="Write a CURVE key pair: DIR/NAME.key (public, give it to peers) and "
        "DIR/NAME.key_secret (secret, mode 0600). Prints the public key.",
    )
    p.add_argument("--out", metavar="DIR", type=Path, default=Path("."), help="default: .")
    p.add_argument("--name", default="kvindex", help="file name stem (default: kvindex)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvindex.security.curve import KeyFileError, generate_keys

    if not args.name or "/" in args.name or args.name.startswith("."):
        raise UsageError(f"--name {args.name!r} must be a plain file name")
    try:
        files = generate_keys(args.out, args.name, force=args.force)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"can't write keys in {args.out}: {exc.strerror or exc}") from None
    print(files.public_key)
    print(f"public key: {files.public}\nsecret key: {files.secret} (mode 0600)", flush=True)
    return 0
