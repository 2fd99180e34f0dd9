"""`serve --enable-ssl-refresh` (vLLM's flag): a serving process takes renewed TLS files without a restart.

Certificates are renewed under a running server (cert-manager in Kubernetes, certbot, a mesh's rotation); without
this the server keeps presenting the old certificate until it expires and every client's handshake fails. Each
serving process (each API process of several too) polls its files' identity once a second and, when one changed,
loads them into the SSLContext its socket already serves with: connections made after that get the new certificate
(and a new CA file's certificates are trusted); connections already open keep their session.

Why a poll of ``os.stat`` and not inotify: a Kubernetes Secret volume renews its files by swapping a symlink (the
files themselves are never written, so a watch on them sees nothing), and inotify sees nothing on network file
systems; a stat a second of two or three paths costs nothing.

Why files are copied and loaded twice: the files are renewed one at a time (the certificate, then its key), and
``SSLContext.load_cert_chain`` into the live context with a certificate whose key has not arrived yet leaves that
context with no usable key (OpenSSL drops the old key as it takes the new certificate): every new handshake would fail
until the key arrived. So the bytes are read once, loaded into a scratch context first, and only a pair that loads
there goes into the live one (from the same bytes: a file renewed in between waits for the next poll). A pair that
does not load is one warning line, and the old certificate keeps being served until the files change again.

What cannot be undone in place: OpenSSL adds CA certificates to a context and never removes one, so a CA taken out of
``--ssl-ca-certs`` stays trusted until a restart (as with vLLM, which reloads the same way).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
from dataclasses import dataclass

from pdcluster.cluster.http_options import error_reason

# The HTTP server's own log (uvicorn's general logger): --uvicorn-log-level and --log-config-file apply to these lines.
log = logging.getLogger("uvicorn.error")

POLL_INTERVAL_S = 1.0


def file_identity(path: str) -> tuple | None:
    """What changes when a file is rewritten or replaced (through a swapped symlink too); None while it is missing
    (a renewal mid-swap)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns


@dataclass
class SSLCertRefresher:
    """Reloads ``context`` (the one the server's socket serves with) from the TLS files when they change."""

    context: ssl.SSLContext | None  # set once the server made it (the files' identity is taken before it reads them)
    certfile: str
    keyfile: str | None = None  # None: the certificate file holds the key too
    ca_certs: str | None = None
    poll_interval_s: float = POLL_INTERVAL_S
    reloads: int = 0  # certificate pairs taken (for tests and the log)
    ca_reloads: int = 0

    def __post_init__(self) -> None:
        self._chain_seen = self._chain_identity()
        self._ca_seen = file_identity(self.ca_certs) if self.ca_certs else None

    def _chain_identity(self) -> tuple:
        return file_identity(self.certfile), file_identity(self.keyfile) if self.keyfile else None

    def poll(self) -> None:
        """One look at the files; reload what changed. Never raises for what the files hold."""
        assert self.context is not None, "poll() before the server's SSLContext was given"
        chain = self._chain_identity()
        if chain != self._chain_seen and None not in chain[: 2 if self.keyfile else 1]:
            self._chain_seen = chain  # tried once per change: a pair that does not load waits for the next one
            self._reload_chain()
        if self.ca_certs:
            ca = file_identity(self.ca_certs)
            if ca != self._ca_seen and ca is not None:
                self._ca_seen = ca
                self._reload_ca()

    def _reload_chain(self) -> None:
        try:
            cert_pem = _read(self.certfile)
            key_pem = _read(self.keyfile) if self.keyfile else None
            with tempfile.TemporaryDirectory(prefix="pdcluster-tls-") as d:  # 0700: the key's copy is ours alone
                cert_path = _write(d, "cert.pem", cert_pem)
                key_path = _write(d, "key.pem", key_pem) if key_pem is not None else None
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=lambda: b"")
                self.context.load_cert_chain(cert_path, key_path, password=lambda: b"")
        except (ssl.SSLError, OSError, ValueError) as e:
            log.warning("TLS: %s changed but cannot be loaded%s (%s); still serving the previous certificate",
                        self.certfile, f" with {self.keyfile}" if self.keyfile else "", error_reason(e))
            return
        self.reloads += 1
        log.info("TLS: serving the renewed certificate %s", self.certfile)

    def _reload_ca(self) -> None:
        try:
            pem = _read(self.ca_certs)
            with tempfile.TemporaryDirectory(prefix="pdcluster-tls-") as d:
                path = _write(d, "ca.pem", pem)
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(path)
                self.context.load_verify_locations(path)
        except (ssl.SSLError, OSError, ValueError) as e:
            log.warning("TLS: %s changed but cannot be loaded (%s); client certificates are checked against the "
                        "CAs loaded before", self.ca_certs, error_reason(e))
            return
        self.ca_reloads += 1
        log.info("TLS: client certificates are now also checked against the CAs in %s", self.ca_certs)

    async def run(self) -> None:
        """Poll until cancelled (the server's shutdown cancels it)."""
        while True:
            await asyncio.sleep(self.poll_interval_s)
            self.poll()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(directory: str, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
