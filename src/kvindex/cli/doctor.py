"""`kvindex doctor [--url URL]`: what is mis-wired between a running `serve` and its engines.

It asks `GET /v1/doctor` (kvindex.runtime.doctor's checks: events arriving and applied per
engine, replay configured, block sizes agreeing, the engines' `/metrics` readable, clocks
close, lookups matching, chats tokenized with the engine's chat template) and prints one
line per finding, the fix beside each problem. Exit code 0 when nothing is wrong, 1 when
something is, 2 when serve can't be asked.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvindex.cli.common import UsageError

DEFAULT_URL = "http://127.0.0.1:8080"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="find what is mis-wired between a running serve and its engines",
        description="Ask a running `kvindex serve` (GET /v1/doctor) whether each engine's "
        "events arrive and are applied, replay is configured, block sizes agree, its "
        "/metrics is readable, clocks are close, lookups match and chats are tokenized "
        "with the engine's chat template; one line per finding, exit 1 on a problem.",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"serve's address (default {DEFAULT_URL})")
    p.add_argument(
        "--token-env",
        default="KVINDEX_TOKEN",
        metavar="VAR",
        help="the environment variable holding serve's bearer token, if it asks for one "
        "(default KVINDEX_TOKEN)",
    )
    p.add_argument("--all", action="store_true", help="print the findings that are ok too")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    token = os.environ.get(args.token_env)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(args.url.rstrip("/") + "/v1/doctor", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise UsageError(f"can't ask {args.url}: {exc or type(exc).__name__}") from None
    if resp.status_code != 200:
        raise UsageError(f"{args.url}/v1/doctor answered {resp.status_code}: {resp.text[:200]}")
    doc = resp.json()
    for finding in doc["findings"]:
        if finding["verdict"] == "ok" and not args.all:
            continue
        print(_line(finding))
    problems = int(doc["problems"])
    print("no problem found" if not problems else f"{problems} problem(s) found")
    return 0 if doc["ok"] else 1


def _line(f: dict[str, Any]) -> str:
    where = f"{f['engine']}: " if f.get("engine") else ""
    text = f"[{f['verdict']}] {f['check']}: {where}{f['message']}"
    return text + (f" -> {f['fix']}" if f.get("fix") else "")
