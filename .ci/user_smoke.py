"""CI's first stage: install and serve exactly as the README tells a new user, then talk to the server.

Runs inside a fresh virtualenv (activated by .ci/run) with nothing of the project installed yet:
1. reads the quick-start line (the line after ``<!-- quickstart-command -->`` and its fence in README.md)
   and runs it as written, in its own process group, with ``PDCLUSTER_PORT`` set to a free port and a new
   model/kernel cache (what a new user has), so the install, the model conversion and the start are real;
2. waits for ``/health`` (bounded), sends one chat completion and one streamed completion;
3. stops the server as Ctrl-C does (SIGINT to the process group) and requires a clean exit (status 0).
Any failed step exits non-zero with the server's output tail. Standard library only: this runs before
anything is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 1500  # the install (torch, ray, xgrammar...) is part of it
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60


def quickstart_line(readme: str) -> str:
    lines = readme.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "<!-- quickstart-command -->":
            if i + 2 < len(lines) and lines[i + 1].startswith("```"):
                return lines[i + 2].strip()
    raise SystemExit(".ci/user_smoke.py: no quick-start line after <!-- quickstart-command --> in README.md")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(message: str, log_path: Path | None = None) -> None:
    print(f"user smoke test FAILED: {message}", file=sys.stderr)
    if log_path is not None and log_path.exists():
        tail = log_path.read_text(errors="replace")[-6000:]
        print(f"---- server output (tail) ----\n{tail}\n------------------------------", file=sys.stderr)
    raise SystemExit(1)


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def wait_healthy(base: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"the quick-start command exited with status {proc.returncode} before serving", log_path)
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(2)
    fail(f"no healthy /health within {START_TIMEOUT_S} s", log_path)


def chat_completion(base: str, log_path: Path) -> str:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 16,
            "temperature": 0}
    with urllib.request.urlopen(post(f"{base}/v1/chat/completions", body), timeout=REQUEST_TIMEOUT_S) as r:
        answer = json.load(r)
    choice = answer["choices"][0]
    text = choice["message"]["content"]
    if not (isinstance(text, str) and text.strip()) or choice["finish_reason"] not in ("stop", "length"):
        fail(f"chat completion: unexpected answer {answer}", log_path)
    if answer["usage"]["completion_tokens"] < 1:
        fail(f"chat completion: no completion tokens counted: {answer['usage']}", log_path)
    return text


def streamed_completion(base: str, log_path: Path) -> str:
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "stream": True}
    pieces, finish, done = [], None, False
    with urllib.request.urlopen(post(f"{base}/v1/completions", body), timeout=REQUEST_TIMEOUT_S) as r:
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            fail(f"streamed completion: Content-Type {r.headers.get('Content-Type')!r}", log_path)
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            for choice in chunk["choices"]:
                pieces.append(choice["text"])
                finish = choice.get("finish_reason") or finish
    text = "".join(pieces)
    if not done or not text.strip() or finish not in ("stop", "length") or len(pieces) < 2:
        fail(f"streamed completion: {len(pieces)} chunks, text {text!r}, finish {finish!r}, [DONE] {done}",
             log_path)
    return text


def stop(proc: subprocess.Popen, log_path: Path) -> None:
    """Ctrl-C in a terminal: SIGINT to the whole foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rc = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        fail(f"the server did not exit within {STOP_TIMEOUT_S} s of SIGINT", log_path)
    if rc != 0:
        fail(f"the server exited with status {rc} after SIGINT (want 0)", log_path)
    log = log_path.read_text(errors="replace")
    if re.search(r"^Traceback", log, re.M):
        fail("the server printed a traceback", log_path)


def main() -> int:
    line = quickstart_line((ROOT / "README.md").read_text())
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="pdcluster-user-smoke-"))
    log_path = work / "server.log"
    env = {**os.environ, "PDCLUSTER_PORT": str(port), "PDCLUSTER_CACHE_DIR": str(work / "cache"),
           "RAY_TMPDIR": str(work / "ray")}
    (work / "ray").mkdir()
    print(f"+ {line}   (PDCLUSTER_PORT={port}, a new cache in {work})", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        # SIGINT and SIGQUIT at their defaults, as a terminal's shell starts a command: a CI run started in the
        # background without job control ignores them, and a shell cannot undo an ignore it was started with.
        terminal = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"]
        proc = subprocess.Popen([*terminal, "bash", "-c", line], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(base, proc, log_path)
        print(f"  healthy after {time.monotonic() - t0:.0f} s (install and start)", flush=True)
        print(f"  chat completion: {chat_completion(base, log_path)!r}", flush=True)
        print(f"  streamed completion: {streamed_completion(base, log_path)!r}", flush=True)
        stop(proc, log_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"  stopped by SIGINT, exit status 0: user smoke test passed in {time.monotonic() - t0:.0f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)  # kept on failure, for a look
    return 0


if __name__ == "__main__":
    sys.exit(main())
