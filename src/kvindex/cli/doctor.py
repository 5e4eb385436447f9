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
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also send this engine (the instance NAME in serve, its OpenAI API at URL) a "
        "short new prompt, then check that kvindex finds its blocks there: a salt, "
        "LoRA or tokenization mismatch, or events not applied, shows here; repeatable",
    )
    p.add_argument("--model", help="the model name the engine serves (default: its first)")
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
    findings = list(doc["findings"])
    for option in args.engine:
        name, sep, url = option.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise UsageError(f"--engine {option!r} must be NAME=http://HOST:PORT")
        findings.append(probe(args.url.rstrip("/"), headers, name, url.rstrip("/"), args.model))
    for finding in findings:
        if finding["verdict"] == "ok" and not args.all:
            continue
        print(_line(finding))
    problems = sum(f["verdict"] == "problem" for f in findings)
    print("no problem found" if not problems else f"{problems} problem(s) found")
    return 0 if not problems else 1


def probe(
    kvindex: str, headers: dict[str, str], name: str, engine: str, model: str | None
) -> dict[str, Any]:
    """Serve a new prompt on `engine`, then look it up in kvindex: found on `name`?"""
    import time
    import uuid

    import httpx

    def finding(verdict: str, message: str, fix: str | None = None) -> dict[str, Any]:
        return {"check": "served_prompt", "engine": name, "verdict": verdict,
                "message": message, "fix": fix}  # fmt: skip

    prompt = f"kvindex doctor probe {uuid.uuid4().hex}. " + "Where is this cached? " * 60
    try:
        with httpx.Client(timeout=30) as client:
            if model is None:
                models = client.get(engine + "/v1/models")
                model = models.json()["data"][0]["id"] if models.status_code == 200 else None
            ids = client.post(engine + "/tokenize", json={"prompt": prompt}).json()["tokens"]
            body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
            if model is not None:
                body["model"] = model
            client.post(engine + "/v1/completions", json=body).raise_for_status()
            deadline = time.monotonic() + 5
            matched = 0
            while True:
                answer = client.post(
                    kvindex + "/v1/lookup", json={"token_ids": ids}, headers=headers
                ).json()
                row = next((r for r in answer.get("instances", []) if r["name"] == name), None)
                if row is None:
                    return finding("problem", f"serve follows no instance {name!r}",
                                   "name the engine as serve's --instance does")  # fmt: skip
                matched = int(row["matched_blocks"])
                if matched or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        return finding(
            "problem",
            f"the probe could not be served by {engine} ({type(exc).__name__}: {exc})"[:300],
            "check the engine's URL: its /tokenize and /v1/completions",
        )
    if matched:
        return finding(
            "ok",
            f"a prompt the engine just served ({len(ids)} tokens) is found there: {matched} blocks",
        )
    return finding(
        "problem",
        f"the engine served a new {len(ids)}-token prompt but 5 s later kvindex finds none "
        f"of its blocks on {name}: its events are not applied here, or the engine keys its "
        "blocks otherwise than a lookup by these tokens (cache_salt, a LoRA adapter, "
        "multimodal inputs, another tokenization)",
        "check the events line above; look up with the request's cache_salt / lora_name",
    )


def _line(f: dict[str, Any]) -> str:
    where = f"{f['engine']}: " if f.get("engine") else ""
    text = f"[{f['verdict']}] {f['check']}: {where}{f['message']}"
    return text + (f" -> {f['fix']}" if f.get("fix") else "")
