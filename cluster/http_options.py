"""How `pdcluster serve`'s HTTP server listens (vLLM's flags, which vLLM hands to uvicorn): its log level and access
log, a logging config file, the root path of an app served behind a path-prefix proxy, and HTTPS. One record, built
once from the parsed flags, that every launcher hands to ``run_server`` (cluster/http_server.py) and that is pickled
to every API process of several (cluster/frontend/).

Imports only the standard library at module level (the multi-process supervisor imports it with its config).
"""

from __future__ import annotations

import argparse
import configparser
import json
import ssl
from dataclasses import dataclass

from pdcluster.engine.config import ConfigError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's, as vLLM offers them
CERT_REQS = {int(ssl.CERT_NONE): "none", int(ssl.CERT_OPTIONAL): "optional", int(ssl.CERT_REQUIRED): "required"}


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP server (vLLM's flags, handed to uvicorn)")
    g.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info",
                   help="the HTTP server's log level (default info: its start-up lines and one line a request)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line for each HTTP request")
    g.add_argument("--log-config-file", default=None, metavar="PATH",
                   help="the HTTP server's logging config: JSON or YAML (.json, .yaml, .yml: logging.config's "
                        "dictConfig schema) or an ini file (fileConfig), as uvicorn --log-config reads it")
    g.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy serves this server under and strips (e.g. /llm): requests still come "
                        "as /v1/...; /openapi.json names the prefix in its servers")
    g.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS with this private key (PEM), "
                                                                       "of --ssl-certfile's certificate")
    g.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS with this certificate chain "
                                                                        "(PEM; its key in --ssl-keyfile or in it)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="CA certificates (PEM) that client certificates are verified against (with --ssl-cert-reqs)")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), metavar="N",
                   help="whether clients must present a certificate, as Python's ssl.CERT_*: 0 none (default), "
                        "1 optional, 2 required")
    g.add_argument("--enable-ssl-refresh", action="store_true",
                   help="take renewed TLS files while serving: each second a serving process looks at --ssl-certfile, "
                        "--ssl-keyfile and --ssl-ca-certs, and new connections get what changed (cluster/ssl_refresh.py)")


@dataclass(frozen=True)
class HttpOptions:
    uvicorn_log_level: str = "info"
    access_log: bool = True
    log_config_file: str | None = None
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    ssl_refresh: bool = False  # --enable-ssl-refresh: run_server reloads the TLS files when they change

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpOptions:
        """From `serve`'s parsed flags (a flag another command lacks keeps its default)."""
        return cls(uvicorn_log_level=getattr(args, "uvicorn_log_level", "info"),
                   access_log=not getattr(args, "disable_uvicorn_access_log", False),
                   log_config_file=getattr(args, "log_config_file", None) or None,
                   root_path=getattr(args, "root_path", "") or "",
                   ssl_keyfile=getattr(args, "ssl_keyfile", None) or None,
                   ssl_certfile=getattr(args, "ssl_certfile", None) or None,
                   ssl_ca_certs=getattr(args, "ssl_ca_certs", None) or None,
                   ssl_cert_reqs=getattr(args, "ssl_cert_reqs", int(ssl.CERT_NONE)),
                   ssl_refresh=bool(getattr(args, "enable_ssl_refresh", False)))

    @property
    def ssl(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl else "http"

    def check(self) -> HttpOptions:
        """ConfigError naming the flag for what uvicorn would refuse only once the model is loaded (with a
        traceback), or would quietly ignore; itself otherwise."""
        if self.uvicorn_log_level not in LOG_LEVELS:
            raise ConfigError(f"--uvicorn-log-level: want one of {', '.join(LOG_LEVELS)}, "
                              f"got {self.uvicorn_log_level!r}")
        if self.root_path and not self.root_path.startswith("/"):
            raise ConfigError(f"--root-path: want a path that starts with '/' (e.g. /llm), got {self.root_path!r}")
        if self.log_config_file is not None:
            _check_log_config(self.log_config_file)
        self._check_ssl()
        return self

    def _check_ssl(self) -> None:
        # A certificate file alone is served where it holds the key too (one PEM, as uvicorn and vLLM take it); a
        # key alone is not a server's identity.
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ConfigError("--ssl-keyfile: HTTPS needs --ssl-certfile too (the certificate of that key)")
        if self.ssl_cert_reqs not in CERT_REQS:
            raise ConfigError(f"--ssl-cert-reqs: want 0 (none), 1 (optional) or 2 (required), got {self.ssl_cert_reqs}")
        if not self.ssl:
            # uvicorn would ignore them and serve plain HTTP: a server the user thinks checks clients would not.
            for flag, value in (("--ssl-ca-certs", self.ssl_ca_certs),
                                ("--ssl-cert-reqs", self.ssl_cert_reqs or None),
                                ("--enable-ssl-refresh", self.ssl_refresh or None)):
                if value is not None:
                    raise ConfigError(f"{flag}: needs HTTPS (--ssl-certfile, and --ssl-keyfile unless the certificate "
                                      "file holds the key)")
            return
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None:
                _read(flag, path)
        # What uvicorn does at start-up, now: a key that does not match the certificate, or one encrypted with a
        # passphrase (which OpenSSL would ask for on the terminal; there is no flag for one), is one line.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, password=lambda: b"")
        except (ssl.SSLError, OSError) as e:
            key = f"with {self.ssl_keyfile}" if self.ssl_keyfile else "alone (no --ssl-keyfile: it must hold the key too)"
            raise ConfigError(f"--ssl-keyfile/--ssl-certfile: cannot load {self.ssl_certfile} {key} (a PEM "
                              f"certificate and its unencrypted key): {error_reason(e)}") from None
        if self.ssl_ca_certs is not None:
            try:
                context.load_verify_locations(self.ssl_ca_certs)
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(f"--ssl-ca-certs: cannot load {self.ssl_ca_certs} (PEM certificates): "
                                  f"{error_reason(e)}") from None

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's keyword arguments. Without --log-config-file uvicorn keeps its own logging config (None
        would turn it off)."""
        kwargs = dict(log_level=self.uvicorn_log_level, access_log=self.access_log, root_path=self.root_path)
        if self.log_config_file is not None:
            kwargs["log_config"] = self.log_config_file
        if self.ssl:
            kwargs.update(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile,
                          ssl_ca_certs=self.ssl_ca_certs, ssl_cert_reqs=self.ssl_cert_reqs)
        return kwargs


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path}: {e.strerror or e}") from None


def _check_log_config(path: str) -> None:
    """Readable and parsed as uvicorn will read it (by its name's ending). Whether its handlers and formatters can
    be built is only known when logging is configured with it (run_server names the flag then)."""
    flag = "--log-config-file"
    text = _read(flag, path).decode("utf-8", errors="replace")
    try:
        if path.endswith(".json"):
            parsed = json.loads(text)
        elif path.endswith((".yaml", ".yml")):
            import yaml  # a dependency (serve --config); only read here for a YAML file

            parsed = yaml.safe_load(text)
        else:
            ini = configparser.ConfigParser()
            ini.read_string(text, source=path)
            if not ini.has_section("loggers"):
                raise ConfigError(f"{flag}: {path} is read as an ini file (logging.config.fileConfig; a JSON or YAML "
                                  "file must end .json, .yaml or .yml) and has no [loggers] section")
            return
    except ConfigError:
        raise
    except Exception as e:  # json's, yaml's and configparser's errors: what the file holds
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{flag}: cannot parse {path}: {first_line}") from None
    if not isinstance(parsed, dict) or "version" not in parsed:
        raise ConfigError(f"{flag}: {path} is not a logging.config dictConfig object (a mapping with \"version\": 1)")


def error_reason(e: Exception) -> str:
    """What an ssl or OS error says, in a few words (OpenSSL's reason, else the system's)."""
    return getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
