"""vLLM's HTTP-server flags on `pdcluster serve` (cluster/http_options.py): --uvicorn-log-level,
--disable-uvicorn-access-log, --log-config-file, --root-path and HTTPS (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs). Real servers (`pdcluster serve --mode local` on tiny-random), one process and several
(--api-servers 2: the options are pickled to each API process); bad values are one line at start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys

import httpx
import pytest

from pdcluster.engine.config import ConfigError
from pdcluster.tools.server_process import READY, ServeProcess

pytestmark = pytest.mark.timeout(300)

BASE = ["--model", "tiny-random", "--mode", "local", "--num-kv-blocks", "64", "--max-model-len", "512"]
KEY = "k-123"
ROOT = "/llm"
ACCESS_LINE = 'HTTP/1.1" 200'  # uvicorn's access log: 127.0.0.1:PORT - "GET /llm/v1/models HTTP/1.1" 200 OK
LOG_CONFIG = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"tagged": {"format": "CFGTEST %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "tagged", "stream": "ext://sys.stderr"}},
    "loggers": {"uvicorn": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
                "uvicorn.access": {"handlers": ["stderr"], "level": "INFO", "propagate": False}},
}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (also its own CA, so it serves as a client certificate too)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (it makes the test's certificate)")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return str(d / "key.pem"), str(d / "cert.pem")


def _client_context(cert: str, key: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cert)
    if key is not None:
        context.load_cert_chain(cert, key)
    return context


@pytest.fixture(scope="module")
def prefixed(tiny_dir, tmp_path_factory):
    """Plain HTTP behind a path prefix, with an API key, no access log and a logging config file."""
    config = tmp_path_factory.mktemp("logcfg") / "log.json"
    config.write_text(json.dumps(LOG_CONFIG))
    with ServeProcess([*BASE, "--root-path", ROOT, "--api-key", KEY, "--disable-uvicorn-access-log",
                       "--log-config-file", str(config)]) as server:
        yield server


def test_root_path_serves_the_stripped_paths_and_names_the_prefix(prefixed):
    auth = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(f"{prefixed.base_url}/v1/models", headers=auth, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-random", models.text
    # The proxy took the prefix off: a path that still carries it is not ours (uvicorn puts the prefix before it).
    assert httpx.get(f"{prefixed.base_url}{ROOT}/v1/models", headers=auth, timeout=30).status_code == 404
    spec = httpx.get(f"{prefixed.base_url}/openapi.json", timeout=30).json()
    assert spec["servers"] == [{"url": ROOT}]  # FastAPI behind a root_path: clients' docs call through the proxy


def test_root_path_keeps_the_api_key_on_v1(prefixed):
    """Behind a root path the ASGI path carries the prefix: the key check must still see /v1/*."""
    r = httpx.get(f"{prefixed.base_url}/v1/models", timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(f"{prefixed.base_url}/tokenize", json={"model": "tiny-random", "prompt": "hi"}, timeout=30)
    assert r.status_code == 401, r.text
    assert httpx.get(f"{prefixed.base_url}/health", timeout=30).status_code == 200  # open, as without a prefix


def test_log_config_file_and_no_access_log(prefixed):
    r = httpx.post(f"{prefixed.base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny-random", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    out = prefixed.output()
    # The file's format on uvicorn's lines, at the default level (info) ...
    assert "CFGTEST INFO uvicorn.error: Application startup complete." in out, out[-3000:]
    # ... and still no line for the requests.
    assert ACCESS_LINE not in out and "/v1/completions" not in out, out[-3000:]


def test_https_one_process_with_warning_log_level(tls, tiny_dir):
    key, cert = tls
    with ServeProcess([*BASE, "--ssl-keyfile", key, "--ssl-certfile", cert, "--uvicorn-log-level", "warning"]) \
            as server:
        assert server.base_url.startswith("https://127.0.0.1:"), server.output()
        assert READY.search(server.output()).group(0).startswith("pdcluster serving tiny-random on https://")
        context = _client_context(cert)
        models = httpx.get(f"{server.base_url}/v1/models", verify=context, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-random"
        import httpx2  # the openai client's HTTP library
        import openai

        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                               http_client=httpx2.Client(verify=context, timeout=60))
        completion = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=3, temperature=0)
        assert completion.usage.completion_tokens >= 1
        with pytest.raises(httpx.TransportError):  # plain HTTP to a TLS socket: no answer
            httpx.get(f"http://127.0.0.1:{server.port}/v1/models", timeout=10)
        with pytest.raises(httpx.ConnectError):  # the server's certificate is checked, and not trusted by default
            httpx.get(f"{server.base_url}/v1/models", timeout=10)
        out = server.output()
    # warning: none of uvicorn's start-up lines (info), nor an access line; the serving line is ours, always there.
    for info in ("Started server process", "Waiting for application startup", "Application startup complete"):
        assert info not in out, out[-3000:]
    assert ACCESS_LINE not in out, out[-3000:]


def test_two_api_processes_serve_https_with_client_certificates_behind_a_root_path(tls, tiny_dir):
    """--api-servers 2: every API process gets TLS (requiring a client certificate signed by --ssl-ca-certs) and
    the root path; the one serving line says https. The default log level and access log, for contrast."""
    key, cert = tls
    with ServeProcess([*BASE, "--api-servers", "2", "--root-path", ROOT, "--ssl-keyfile", key, "--ssl-certfile", cert,
                       "--ssl-ca-certs", cert, "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED))]) as server:
        assert server.base_url.startswith("https://"), server.output()
        assert server.output().count("pdcluster serving") == 1
        with pytest.raises(httpx.TransportError):  # no client certificate: the handshake fails
            httpx.get(f"{server.base_url}/v1/models", verify=_client_context(cert), timeout=10)
        with httpx.Client(verify=_client_context(cert, key), timeout=60) as client:
            for _ in range(4):  # connections spread over both processes (each its own)
                with httpx.Client(verify=_client_context(cert, key), timeout=60) as fresh:
                    assert fresh.get(f"{server.base_url}/openapi.json").json()["servers"] == [{"url": ROOT}]
            r = client.post(f"{server.base_url}/v1/completions",
                            json={"model": "tiny-random", "prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        out = server.output()
    assert out.count("Application startup complete.") == 2, out[-3000:]  # info: each process's start-up
    assert f'"POST {ROOT}/v1/completions HTTP/1.1" 200' in out, out[-3000:]  # the access log, on by default


def test_default_options_keep_uvicorns_defaults():
    """No flag: the same uvicorn settings as before the flags existed (and uvicorn's own logging config)."""
    from pdcluster.cluster.http_options import HttpOptions

    assert HttpOptions().uvicorn_kwargs() == {"log_level": "info", "access_log": True, "root_path": ""}
    assert HttpOptions().scheme == "http"


def _check(*argv):
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.serve_cli import _check_args

    args = build_parser().parse_args(["serve", "--mode", "local", "--port", "0", "--api-servers", "1", *argv])
    _check_args(args)
    return args.http_options


def test_bad_values_are_named_at_start_up(tmp_path, tls):
    key, cert = tls
    missing = str(tmp_path / "missing.pem")
    bad_json = tmp_path / "log.json"
    bad_json.write_text("{not json")
    no_version = tmp_path / "log.yaml"
    no_version.write_text("loggers: {}\n")
    other_key = tmp_path / "other.pem"
    other_key.write_text(open(cert).read())  # a certificate where the key should be
    cases = [
        (["--ssl-keyfile", key], "--ssl-keyfile: HTTPS needs --ssl-certfile too"),
        (["--ssl-certfile", cert], f"cannot load {cert} alone (no --ssl-keyfile: it must hold the key too)"),
        (["--ssl-keyfile", missing, "--ssl-certfile", cert], f"--ssl-keyfile: cannot read {missing}: No such file"),
        (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", missing], "--ssl-ca-certs: cannot read"),
        (["--ssl-keyfile", str(other_key), "--ssl-certfile", cert], "--ssl-keyfile/--ssl-certfile: cannot load"),
        (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-cert-reqs", "3"], "--ssl-cert-reqs: want 0 (none), 1"),
        (["--ssl-ca-certs", cert], "--ssl-ca-certs: needs HTTPS"),
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs: needs HTTPS"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh: needs HTTPS"),
        (["--log-config-file", missing], f"--log-config-file: cannot read {missing}"),
        (["--log-config-file", str(bad_json)], f"--log-config-file: cannot parse {bad_json}"),
        (["--log-config-file", str(no_version)], "is not a logging.config dictConfig object"),
        (["--root-path", "llm"], "--root-path: want a path that starts with '/'"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError) as info:
            _check(*argv)
        assert message in str(info.value) and "\n" not in str(info.value), (argv, str(info.value))
    combined = tmp_path / "combined.pem"  # one PEM with the key and its certificate: served alone
    combined.write_text(open(key).read() + open(cert).read())
    assert _check("--ssl-certfile", str(combined)).uvicorn_kwargs()["ssl_certfile"] == str(combined)
    good = _check("--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", cert, "--ssl-cert-reqs", "2",
                  "--root-path", ROOT, "--uvicorn-log-level", "debug", "--disable-uvicorn-access-log")
    assert good.scheme == "https" and good.uvicorn_kwargs() == {
        "log_level": "debug", "access_log": False, "root_path": ROOT, "ssl_keyfile": key, "ssl_certfile": cert,
        "ssl_ca_certs": cert, "ssl_cert_reqs": 2}


def _serve(*argv, timeout=120):
    cmd = [sys.executable, "-m", "pdcluster.cli", "serve", *BASE, "--port", "0", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


@pytest.mark.parametrize("argv, message", [
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile: HTTPS needs --ssl-certfile too"),
    (["--uvicorn-log-level", "loud"], "--uvicorn-log-level: invalid choice: 'loud'"),
])
def test_the_command_says_one_line_and_exits_2(argv, message):
    r = _serve(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_log_config_that_cannot_be_applied_is_one_line(tiny_dir, tmp_path):
    """It parses, but its handler class does not exist: known only when uvicorn configures logging with it."""
    config = tmp_path / "log.json"
    config.write_text(json.dumps({**LOG_CONFIG, "handlers": {"stderr": {"class": "no.such.Handler"}}}))
    r = _serve("--log-config-file", str(config))
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"--log-config-file: {config}: logging cannot be configured with it" in errors[0], errors


def test_the_admin_proxy_forwards_the_routes_path_behind_a_root_path():
    """An API process of several hands /admin/* to the router process, which serves no prefix."""
    from fastapi import FastAPI

    from pdcluster.cluster.frontend.admin_proxy import install_admin_proxy
    from pdcluster.cluster.frontend.protocol import AdminReply

    class Router:
        def __init__(self):
            self.targets = []

        async def admin(self, method, target, headers, body):
            self.targets.append(target)
            return AdminReply(0, 200, ["content-type"], ["application/json"], b"{}")

    router = Router()
    app = FastAPI()
    install_admin_proxy(app, router)

    async def as_uvicorn_does(scope, receive, send):  # uvicorn with --root-path: the prefix before the path
        if scope["type"] == "http":
            scope = dict(scope, path=ROOT + scope["path"], raw_path=ROOT.encode() + scope["raw_path"], root_path=ROOT)
        await app(scope, receive, send)

    import asyncio

    async def call():
        transport = httpx.ASGITransport(app=as_uvicorn_does)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await client.get("/admin/workers?x=1")

    assert asyncio.run(call()).status_code == 200
    assert router.targets == ["/admin/workers?x=1"]
