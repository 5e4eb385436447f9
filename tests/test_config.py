"""`kvindex serve --config`: the file takes every serve option (tokens by file or
environment, TLS, limits, CURVE per instance), deploy/kvindex.toml (the documented example)
loads, flags win over the file, and every problem is one line."""

from __future__ import annotations

import argparse
import re
import shutil
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from clitools import ROOT
from netutil import free_port
from test_http_security import self_signed

from kvindex.cli import build_parser
from kvindex.cli.common import UsageError
from kvindex.cli.config import ROUTING_KEYS, SECURITY_KEYS, SERVER_KEYS, load_settings
from kvindex.cli.httpopts import http_options
from kvindex.security.curve import generate_keys

pytestmark = pytest.mark.timeout(60)

EXAMPLE = ROOT / "deploy" / "kvindex.toml"
TOKEN = "example-token-0123456789"
ADMIN_TOKEN = "example-admin-token-0123456789"


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def example_in(tmp: Path) -> Path:
    """deploy/kvindex.toml with its /etc/kvindex and /var/lib/kvindex files made under tmp."""
    etc = tmp / "etc"
    (etc / "tls").mkdir(parents=True)
    (etc / "token").write_text(TOKEN + "\n")
    (etc / "admin-token").write_text(ADMIN_TOKEN + "\n")
    cert, key = self_signed(tmp)
    shutil.copy(cert, etc / "tls" / "tls.crt")
    shutil.copy(key, etc / "tls" / "tls.key")
    relay = generate_keys(etc, "relay-vllm-1")
    relay.secret.unlink()
    generate_keys(etc, "kvindex")
    text = EXAMPLE.read_text().replace("/etc/kvindex", str(etc))
    text = text.replace("/var/lib/kvindex", str(tmp))
    config = tmp / "kvindex.toml"
    config.write_text(text)
    return config


def test_the_documented_example_loads_with_every_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVINDEX_METRICS_TOKEN", "metrics-token-0123456789")
    monkeypatch.delenv("KVINDEX_TOKEN", raising=False)
    config = example_in(tmp_path)
    args = serve_args("--config", str(config))
    settings = load_settings(args)
    assert settings.http == "0.0.0.0:8080"
    assert settings.store == f"sqlite:///{tmp_path}/kvindex.sqlite"
    names = [(s.name, s.dp, s.topic, s.curve is not None) for s in settings.instances]
    assert names == [("vllm-0", 1, "", False), ("vllm-1", 2, "", True), ("vllm-2", 1, "kv", False)]
    zero = settings.instances[0]
    assert (zero.model, zero.http, zero.metrics_url) == (
        "llama",
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/metrics",
    )
    assert settings.tokenizers == ["llama=vllm"]
    one = settings.instances[1]
    assert one.client_key == str(tmp_path / "etc" / "kvindex.key_secret")
    assert len(one.sources()) == 2 and one.sources()[1].endpoint == "tcp://10.0.0.6:6558"
    http = http_options(args, settings.http_options)
    assert http.guard.token == TOKEN  # the file's content, without its newline
    assert http.guard.metrics_token == "metrics-token-0123456789"
    assert http.guard.admin_token == ADMIN_TOKEN and http.guard.fleet_changes
    assert http.guard.max_streams == 32
    assert (http.tls_cert, http.tls_key) == (
        str(tmp_path / "etc/tls/tls.crt"),
        str(tmp_path / "etc/tls/tls.key"),
    )
    assert http.max_body_bytes == 33554432 and http.guard.max_lookup_items == 1000000
    assert http.guard.request_timeout == 30.0
    assert settings.prediction_ttl == 2.0
    assert settings.weights == {
        "prefix": 3.0, "queue": 2.0, "running": 1.0, "kv": 1.0, "predicted": 1.0,
        "gpu": 1.0, "cpu": 0.8, "disk": 0.5, "external": 0.5,
    }  # fmt: skip
    # every [server] key is in the example, so the example shows them all
    assert set(
        re.findall(r"^#? ?(\w+) =", EXAMPLE.read_text().split("[[instances]]")[0], re.M)
    ) >= (SERVER_KEYS - {"token_env", "metrics_token_file", "admin_token_env"})


def test_discovery_interval_flag_over_the_file(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text("[server]\ndiscovery_interval = 5\n")
    assert load_settings(serve_args("--config", str(config))).discovery_interval == 5.0
    flagged = serve_args("--config", str(config), "--discovery-interval", "0")
    assert load_settings(flagged).discovery_interval == 0.0
    assert load_settings(serve_args()).discovery_interval is None  # the default: 30 s


def test_flags_win_over_the_file_and_the_file_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVINDEX_TOKEN", "from-the-environment-0123")
    monkeypatch.setenv("MY_TOKEN", "from-my-variable-01234567")
    config = tmp_path / "k.toml"
    config.write_text(
        '[server]\nhttp = "127.0.0.1:9000"\ntoken_env = "MY_TOKEN"\nmax_body_bytes = 1000\n'
    )
    args = serve_args("--config", str(config), "--http", "127.0.0.1:9001", "--max-body-bytes", "5")
    settings = load_settings(args)
    http = http_options(args, settings.http_options)
    assert settings.http == "127.0.0.1:9001" and http.max_body_bytes == 5
    assert http.guard.token == "from-my-variable-01234567"
    flagged = serve_args("--config", str(config), "--token", "from-the-flag-0123456789")
    assert http_options(flagged, load_settings(flagged).http_options).guard.token == (
        "from-the-flag-0123456789"
    )
    # the routing score: a weight flag over the file's, the others kept; the TTL's flag wins
    config.write_text("[routing]\nprediction_ttl = 3\n[routing.weights]\ncpu = 0.5\nqueue = 1\n")
    routed = load_settings(
        serve_args("--config", str(config), "--weights", "queue=4,kv=0", "--prediction-ttl", ".5")
    )
    assert routed.weights == {"cpu": 0.5, "queue": 4.0, "kv": 0.0}
    assert routed.prediction_ttl == 0.5
    assert load_settings(serve_args("--config", str(config))).prediction_ttl == 3.0
    assert not routed.local_hashes  # Dynamo's local hashes: off unless asked, by file or flag
    assert load_settings(serve_args("--config", str(config), "--local-hashes")).local_hashes
    config.write_text("[routing]\nlocal_hashes = true\n")
    assert load_settings(serve_args("--config", str(config))).local_hashes
    config.write_text("[server]\n")
    plain = serve_args("--config", str(config))
    assert http_options(plain, load_settings(plain).http_options).guard.token == (
        "from-the-environment-0123"
    )


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ('token_file = "/nonexistent/token"', "can't read the token file /nonexistent/token"),
        ('token_env = "KVINDEX_TEST_UNSET"', "server.token_env: $KVINDEX_TEST_UNSET is not set"),
        ('token_file = "x"\ntoken_env = "y"', "give server.token_file or server.token_env"),
        ("max_body_bytes = 0", "server.max_body_bytes must be a whole number of at least 1"),
        ('request_timeout = "soon"', "server.request_timeout must be a positive number"),
        (
            "discovery_interval = -1",
            "server.discovery_interval must be a number of seconds (0: never)",
        ),
        ('discovery_interval = "often"', "server.discovery_interval must be a number of seconds"),
        (
            'tlscert = "x"',
            "[server]: unknown key 'tlscert' (admin_token_env, admin_token_file, allowed_hosts, ",
        ),
    ],
)
def test_config_problems_are_one_line(tmp_path: Path, server: str, message: str) -> None:
    config = tmp_path / "k.toml"
    config.write_text(f"[server]\n{server}\n")
    with pytest.raises(UsageError) as exc:
        load_settings(serve_args("--config", str(config)))
    assert message in str(exc.value) and "\n" not in str(exc.value)


INSTANCE = '[[instances]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[routing]\nprediction_ttl = 0", "routing.prediction_ttl must be a positive number"),
        ('[routing]\nprediction_ttl = "2s"', "routing.prediction_ttl must be a positive number"),
        ("[routing]\nweights = 3", "routing.weights must be a table"),
        ("[routing]\nweights = {cache = 1}", "routing.weights: unknown routing weight 'cache'"),
        ("[routing]\nweights = {cpu = -0.5}", "tier weight cpu must be a number >= 0"),
        ("[routing]\nweights = {queue = nan}", "routing weight queue must be a number >= 0"),
        ('[routing]\nweights = {queue = "high"}', "routing.weights.queue must be a number"),
        (
            "[routing]\nttl = 2",
            "[routing]: unknown key 'ttl' (idle_grace, local_hashes, min_engines, "
            "prediction_ttl, weights)",
        ),
        ("[routing]\nlocal_hashes = 1", "routing.local_hashes must be true or false"),
        (INSTANCE + "model = 5", "instances[0].model must be a string"),
        (INSTANCE + 'model = "a b"', "instances[0]: model 'a b' must be 1-256 characters"),
        (INSTANCE + 'http = "ftp://x"', "instances[0]: http 'ftp://x' is not an http(s) URL"),
    ],
)
def test_bad_routing_settings_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "k.toml"
    config.write_text(text + "\n")
    with pytest.raises(UsageError) as exc:
        load_settings(serve_args("--config", str(config)))
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights", "cache=1"], "argument --weights: unknown routing weight 'cache' (prefix,"),
        (["--weights", "queue"], "argument --weights: 'queue' must be NAME=NUMBER"),
        (["--weights", "gpu=-1"], "argument --weights: tier weight gpu must be a number >= 0"),
        (["--weights", "kv=inf"], "argument --weights: routing weight kv must be a number >= 0"),
        (["--prediction-ttl", "0"], "argument --prediction-ttl: '0' must be a positive number"),
    ],
)
def test_serve_refuses_bad_routing_flags_in_one_line(flags: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvindex", "serve", "--store", "memory", "--http", "127.0.0.1:0",
         *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_an_instance_with_a_bad_key_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text(
        '[[instances]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\ncurve = "/nonexistent.key"\n'
    )
    with pytest.raises(UsageError, match=r"instances\[0\]: curve=/nonexistent.key: can't read"):
        load_settings(serve_args("--config", str(config)))


def test_every_serve_flag_has_a_config_key_and_is_documented() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    flags = {
        action.option_strings[-1]
        for action in commands["serve"]._actions
        if action.option_strings and action.dest not in ("help", "config", "instance")
    }
    as_keys = {flag.removeprefix("--").removeprefix("no-").replace("-", "_") for flag in flags}
    keys = {
        k.removesuffix("_file").removesuffix("_env")
        for k in SERVER_KEYS | ROUTING_KEYS | SECURITY_KEYS
    }
    assert as_keys - {"max_lookup_tokens"} <= keys and "max_lookup_tokens" in keys
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for key in SERVER_KEYS | ROUTING_KEYS | SECURITY_KEYS:
        assert f"| `{key}` |" in doc, key
    for flag in flags:
        assert f"`{flag}" in doc, flag


def test_serve_runs_from_the_example_config(tmp_path: Path) -> None:
    config = example_in(tmp_path)
    port = free_port()
    text = config.read_text().replace("0.0.0.0:8080", f"127.0.0.1:{port}")
    text = text.replace('metrics_token_env = "KVINDEX_METRICS_TOKEN"', "")
    config.write_text(text)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"listening on https://127.0.0.1:{port}/ (3 instance(s)" in line
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        url = f"https://127.0.0.1:{port}/v1/instances"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, context=context, timeout=5)
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, context=context, timeout=5) as r:
            assert r.status == 200 and b'"vllm-1"' in r.read()
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
