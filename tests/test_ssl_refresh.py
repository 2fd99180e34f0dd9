"""`serve --enable-ssl-refresh` (cluster/ssl_refresh.py): renewed TLS files are served without a restart.

Real TLS handshakes on loopback against the certificate a client sees: the refresher on an asyncio TLS server in this
process (a renewal that arrives one file at a time keeps the old certificate served until the pair is whole, a file
that does not load changes nothing), and `pdcluster serve` itself (one process renewed the way a Kubernetes Secret
volume renews, by a symlink swap; two API processes, each taking a renewed certificate and a CA file that gained a
client's CA).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdcluster.cluster.ssl_refresh import SSLCertRefresher, file_identity
from pdcluster.tools.server_process import ServeProcess

pytestmark = pytest.mark.timeout(300)

BASE = ["--model", "tiny-random", "--mode", "local", "--num-kv-blocks", "64", "--max-model-len", "512"]
RENEWAL_WAIT_S = 15.0  # the server polls once a second


def make_pair(directory: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 named CN=<name> (its own CA) and its key: (key, cert)."""
    directory.mkdir(parents=True, exist_ok=True)
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return str(key), str(cert)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (it makes the test's certificates)")
    d = tmp_path_factory.mktemp("pairs")
    return {name: make_pair(d, name) for name in ("old", "new", "client")}


def served_certificate(port: int, trusted: str, client: tuple[str, str] | None = None) -> bytes:
    """The DER certificate a fresh connection to 127.0.0.1:port is served, verified against ``trusted``
    (ssl.SSLError where it is not); ``client``: (key, cert) presented to the server."""
    context = ssl.create_default_context(cafile=trusted)
    if client is not None:
        context.load_cert_chain(client[1], client[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            served = tls.getpeercert(binary_form=True)
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            # With TLS 1.3 a refused client certificate shows on the first read (an alert, or the connection shut).
            if not tls.recv(1):
                raise ConnectionError("the server closed the connection without an answer")
            return served


def der(cert_path: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(cert_path).read_text())


def wait_for(predicate, what: str, timeout_s: float = RENEWAL_WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (ssl.SSLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


class TlsEchoServer:
    """An asyncio TLS server on loopback in a thread, serving ``context``; ``call(fn)`` runs fn on its loop."""

    def __init__(self, context: ssl.SSLContext):
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start():
            async def handle(reader, writer):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                writer.close()

            self.server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()),
                                                       self.loop.run_forever()), daemon=True)
        self.thread.start()
        assert ready.wait(30)

    def call(self, fn):
        return asyncio.run_coroutine_threadsafe(_as_coroutine(fn), self.loop).result(30)

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


async def _as_coroutine(fn):
    return fn()


def _copy(src: str, dst: Path) -> None:
    # A new inode, as a renewal makes (and so a new identity however fast the test runs).
    tmp = dst.with_suffix(".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def test_a_pair_renewed_one_file_at_a_time_is_served_only_once_whole(pairs, tmp_path, caplog):
    """The certificate first, its key a poll later: meanwhile the old pair is still served (loading the new
    certificate into the live context beside the old key would leave it no usable key: every handshake failing),
    then the new one. A file that does not load is one warning and changes nothing."""
    (old_key, old_cert), (new_key, new_cert) = pairs["old"], pairs["new"]
    key, cert = tmp_path / "tls.key", tmp_path / "tls.crt"
    _copy(old_key, key)
    _copy(old_cert, cert)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    refresher = SSLCertRefresher(context, str(cert), str(key))
    server = TlsEchoServer(context)
    try:
        assert served_certificate(server.port, old_cert) == der(old_cert)
        server.call(refresher.poll)  # nothing changed: nothing loaded
        assert refresher.reloads == 0

        _copy(new_cert, cert)  # the certificate renewed, its key not yet
        with caplog.at_level("WARNING", logger="uvicorn.error"):
            server.call(refresher.poll)
        assert refresher.reloads == 0
        assert any("changed but cannot be loaded" in r.getMessage() for r in caplog.records), caplog.text
        assert served_certificate(server.port, old_cert) == der(old_cert)  # the old pair, whole

        _copy(new_key, key)
        server.call(refresher.poll)
        assert refresher.reloads == 1
        assert served_certificate(server.port, new_cert) == der(new_cert)
        with pytest.raises(ssl.SSLError):  # a client that trusts only the old certificate no longer connects
            served_certificate(server.port, old_cert)

        cert.write_text("not a certificate\n")  # garbage: a warning, the renewed pair still served
        server.call(refresher.poll)
        assert refresher.reloads == 1 and served_certificate(server.port, new_cert) == der(new_cert)
    finally:
        server.close()


def test_a_combined_pem_and_a_missing_file_mid_swap(pairs, tmp_path):
    """--ssl-certfile alone (the PEM holds the key too) is reloaded as one file; a file missing for a moment (a
    renewal's swap) is waited for, not an error."""
    (old_key, old_cert), (new_key, new_cert) = pairs["old"], pairs["new"]
    combined = tmp_path / "combined.pem"
    combined.write_text(Path(old_key).read_text() + Path(old_cert).read_text())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(combined))
    refresher = SSLCertRefresher(context, str(combined))
    server = TlsEchoServer(context)
    try:
        combined.unlink()
        assert file_identity(str(combined)) is None
        server.call(refresher.poll)
        assert refresher.reloads == 0 and served_certificate(server.port, old_cert) == der(old_cert)
        combined.write_text(Path(new_key).read_text() + Path(new_cert).read_text())
        server.call(refresher.poll)
        assert refresher.reloads == 1 and served_certificate(server.port, new_cert) == der(new_cert)
    finally:
        server.close()


def _secret_volume(root: Path, key: str, cert: str, version: str) -> None:
    """What the kubelet does to a Secret volume: the files in a new timestamped directory, then the ..data symlink
    swapped to it (tls.crt and tls.key are symlinks through ..data and are never written themselves)."""
    version_dir = root / f"..{version}"
    version_dir.mkdir()
    shutil.copyfile(cert, version_dir / "tls.crt")
    shutil.copyfile(key, version_dir / "tls.key")
    link = root / "..data_tmp"
    link.symlink_to(version_dir.name)
    os.replace(link, root / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")


def test_serve_takes_a_certificate_renewed_in_a_secret_volume(pairs, tiny_dir, tmp_path):
    (old_key, old_cert), (new_key, new_cert) = pairs["old"], pairs["new"]
    volume = tmp_path / "secret"
    volume.mkdir()
    _secret_volume(volume, old_key, old_cert, "2026_12_01")
    flags = [*BASE, "--ssl-keyfile", str(volume / "tls.key"), "--ssl-certfile", str(volume / "tls.crt"),
             "--enable-ssl-refresh"]
    with ServeProcess(flags) as server:
        assert served_certificate(server.port, old_cert) == der(old_cert)
        with httpx.Client(verify=ssl.create_default_context(cafile=old_cert), timeout=60) as kept:
            assert kept.get(f"{server.base_url}/v1/models").status_code == 200  # a connection made before
            _secret_volume(volume, new_key, new_cert, "2026_12_07")
            wait_for(lambda: served_certificate(server.port, new_cert) == der(new_cert),
                     "a new connection is served the renewed certificate")
            with pytest.raises(ssl.SSLError):
                served_certificate(server.port, old_cert)
            # The connection made before keeps its session, and requests on new ones are answered.
            assert kept.get(f"{server.base_url}/v1/models").status_code == 200
        with httpx.Client(verify=ssl.create_default_context(cafile=new_cert), timeout=60) as client:
            r = client.post(f"{server.base_url}/v1/completions",
                            json={"model": "tiny-random", "prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        out = server.output()
    assert out.count("TLS: serving the renewed certificate") == 1, out[-3000:]


def test_every_api_process_takes_a_renewed_certificate_and_ca(pairs, tiny_dir, tmp_path):
    """--api-servers 2, client certificates required: each process reloads its own context; a client whose CA
    was added to --ssl-ca-certs is let in from then on."""
    (old_key, old_cert), (new_key, new_cert), client = pairs["old"], pairs["new"], pairs["client"]
    key, cert, ca = tmp_path / "tls.key", tmp_path / "tls.crt", tmp_path / "ca.pem"
    _copy(old_key, key)
    _copy(old_cert, cert)
    _copy(old_cert, ca)  # the old certificate is its own CA: it is the client certificate allowed at first
    flags = [*BASE, "--api-servers", "2", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
             "--ssl-ca-certs", str(ca), "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)), "--enable-ssl-refresh"]
    with ServeProcess(flags) as server:
        assert served_certificate(server.port, old_cert, client=pairs["old"]) == der(old_cert)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            served_certificate(server.port, old_cert, client=client)  # its CA is not trusted yet
        ca.write_text(Path(old_cert).read_text() + Path(client[1]).read_text())
        _copy(new_cert, cert)
        _copy(new_key, key)
        wait_for(lambda: server.output().count("TLS: serving the renewed certificate") == 2
                 and server.output().count("TLS: client certificates are now also checked") == 2,
                 "both API processes reload")
        for _ in range(8):  # fresh connections, spread over both processes
            assert served_certificate(server.port, new_cert, client=client) == der(new_cert)
            assert served_certificate(server.port, new_cert, client=pairs["old"]) == der(new_cert)
