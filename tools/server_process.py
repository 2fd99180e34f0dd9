"""`pdcluster serve` in a subprocess, as tests and benchmarks run it: started with its own Ray temp dir
and HOME, ready once it prints ``pdcluster serving <model> on <url>``, stopped with SIGTERM (SIGKILL
if it does not exit) or interrupted with SIGINT as Ctrl-C would.

    with ServeProcess(["--mode", "local", "--model", "tiny-random"]) as server:
        httpx.get(server.base_url + "/health")
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdcluster.engine.models.registry import default_cache_dir

READY = re.compile(r"pdcluster serving \S+ on (https?://\S+)")  # https: served with --ssl-certfile


class ServeProcessError(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log's tail."""


# Runs the command after it with SIGINT and SIGQUIT at their defaults, as a shell in a terminal starts it. A process
# started in the background by a shell without job control ignores them, and so does all it starts (a CI run
# launched with "... &": its servers then never saw Ctrl-C); a command cannot undo an ignore it was started with.
AS_FROM_A_TERMINAL = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"]


class ServeProcess:
    """``flags`` are `pdcluster serve`'s; without ``--port`` it listens on a free port (``--port 0``),
    which ``base_url`` and ``port`` tell once ready. Its stdout and stderr go to ``log_path`` (default:
    a file in its temp dir)."""

    def __init__(self, flags: list[str], log_path: str | os.PathLike | None = None, timeout_s: float = 240.0,
                 stop_timeout_s: float = 30.0, entry: list[str] | None = None, extra_env: dict | None = None):
        """``entry``: the command before ``serve`` (default: this Python's ``-m pdcluster.cli``; a benchmark's
        wrapper of the CLI, e.g. bench/serve_stubbed.py). ``extra_env``: variables over this process's own."""
        self.tmp = tempfile.mkdtemp(prefix="pdcluster-serve-")
        self.log_path = Path(log_path) if log_path is not None else Path(self.tmp) / "serve.log"
        self.stop_timeout_s = stop_timeout_s
        # Ray's files and HOME go to the temp dir; the model cache must not follow HOME there (every
        # server would convert the model again).
        env = dict(os.environ, PDCLUSTER_CACHE_DIR=str(default_cache_dir()), RAY_TMPDIR=self.tmp, HOME=self.tmp,
                   **(extra_env or {}))
        cmd = [*(entry or [sys.executable, "-m", "pdcluster.cli"]), "serve", *flags]
        if "--port" not in flags:
            cmd += ["--port", "0"]
        with open(self.log_path, "w") as log:
            # Its own session: interrupt() signals the server's whole process group, as Ctrl-C does.
            self.proc = subprocess.Popen([*AS_FROM_A_TERMINAL, *cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.base_url = ""
        self.port = 0
        self._final_output: str | None = None  # the log's text once close() removed the temp dir
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = READY.search(self.output())
            if match:
                self.base_url = match.group(1)
                self.port = int(self.base_url.rsplit(":", 1)[1])
                return
            if self.proc.poll() is not None:
                raise ServeProcessError(f"server exited with status {self.proc.returncode}: {self.output()[-3000:]}")
            time.sleep(0.3)
        self.close()
        raise ServeProcessError(f"server not ready in {timeout_s:.0f} s: {self.output()[-3000:]}")

    def output(self) -> str:
        """Everything the server printed so far (stdout and stderr); after close(), all it printed."""
        if self._final_output is not None:
            return self._final_output
        return self.log_path.read_text(errors="replace")

    def interrupt(self, timeout_s: float | None = None) -> int:
        """SIGINT to the server's process group (what Ctrl-C in its terminal does); its exit status. Where it has
        not exited in time, ServeProcessError with the server's signal state (a SIGINT it blocks, ignores or holds
        pending) and its log's tail."""
        before = signal_state(self.proc.pid)
        os.killpg(self.proc.pid, signal.SIGINT)
        timeout_s = timeout_s if timeout_s is not None else self.stop_timeout_s
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            after = signal_state(self.proc.pid)
            raise ServeProcessError(f"server did not exit {timeout_s:.0f} s after SIGINT; its SIGINT before: {before}, "
                                    f"after: {after}; log: {self.output()[-3000:]}") from None

    def close(self) -> None:
        """SIGTERM; SIGKILL if it has not exited within ``stop_timeout_s``; then removes its temp dir (Ray's
        session files: a test suite starts hundreds of servers), keeping the log's text for output().
        Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._final_output is None and os.path.isdir(self.tmp):
            self._final_output = self.output()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def signal_state(pid: int) -> dict:
    """Whether process ``pid``'s SIGINT is blocked, ignored, caught (a handler) or pending, from /proc (Linux);
    {} where that cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return {}
    bit = 1 << (signal.SIGINT - 1)
    return {name: bool(int(fields[key].strip(), 16) & bit) for name, key in
            (("blocked", "SigBlk"), ("ignored", "SigIgn"), ("caught", "SigCgt"), ("pending", "SigPnd"),
             ("pending_process", "ShdPnd")) if key in fields}
