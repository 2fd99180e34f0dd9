"""The transports with one IO thread (tcp, ucx, shm): callers queue commands, the thread does all IO.

Why one thread: zmq sockets and UCX workers are not thread-safe, and shm's sockets and staging ring
are simplest owned by one thread. Callers therefore never touch them: they queue an ``IOCommand``
(io_call.py) and wake the thread through an eventfd (waker.py) it sleeps on beside its sockets.

Each pass of the thread runs the commands queued so far, then the transport's ``_io_step``: post
chunks (``_post_chunks``, below, the sender part the three share), read what arrived, and sleep until
woken or something is readable. The IO thread failing fails every send in flight, with its error.
"""

from __future__ import annotations

import logging
import queue
from abc import abstractmethod
from collections import deque
from collections.abc import Callable

import torch

from ..base import Role, TransportConfig
from .io_call import IOCall, IOCommand
from .send_job import Chunk, SendJob
from .threaded import ThreadedTransport
from .waker import Waker

log = logging.getLogger(__name__)


class IOThreadTransport(ThreadedTransport):
    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        super().__init__(kv_cache, role, config)
        self._waker = Waker()
        self._commands: queue.SimpleQueue[IOCommand] = queue.SimpleQueue()
        self._jobs: deque[SendJob] = deque()  # IO thread: sends with chunks left to post, oldest first

    def _start_io(self) -> None:
        """Start the IO thread: the transport calls this last in its __init__, its state complete."""
        self._spawn(self._io_main, f"{self.name}-kv-{self.role}")

    # ---------------------------------------------------------------- the transport's part

    @abstractmethod
    def _io_step(self, busy: bool) -> None:
        """One pass after the commands: post, read, then sleep (briefly; not at all if ``busy``)."""

    @abstractmethod
    def _post_chunk(self, job: SendJob, chunk: Chunk) -> bool:
        """Post ``chunk`` (the job's next) and advance ``job.next_chunk``, or fail the job (the queue
        drops it next); True either way. False: no room for the chunk now, try again next pass."""

    def _has_room(self) -> bool:
        """Whether another chunk may be posted now (flow control)."""
        return True

    def _peer_problem(self, peer_id: str) -> str | None:
        """Why sends to ``peer_id`` cannot go on (peer lost, not linked), or None."""
        return None

    def _queue_job(self, job: SendJob) -> None:
        """IO thread: a new send joins the queue."""
        self._jobs.append(job)

    def _io_shutdown(self) -> None:
        """IO thread, on its way out: close what only it touches."""

    # ---------------------------------------------------------------- caller side

    def _on_io(self, run: Callable[..., object], *args: object) -> None:
        """Have the IO thread run ``run(*args)``; nobody waits for it."""
        self._commands.put(IOCommand(run, args))
        self._waker.wake()

    def _ask_io(self, run: Callable[..., object], *args: object, on_late: Callable[[object], None] | None = None) -> IOCall:
        """Have the IO thread run ``run(*args)``; wait on the returned call for its answer."""
        call = IOCall(on_late)
        self._commands.put(IOCommand(run, args, call))
        self._waker.wake()
        return call

    def _connect_on_io(self, peer_id: str, run: Callable[..., object], *args: object) -> None:
        """connect()'s IO-thread part: waits at most ``timeout_s``; what it raised becomes a
        ConnectionError here."""
        call = self._ask_io(run, *args)
        if not call.wait(self.config.timeout_s):
            raise TimeoutError(f"{self.name} connect to {peer_id} timed out")
        if call.error is not None:
            raise ConnectionError(f"{self.name} connect to {peer_id} failed: {call.error}") from call.error

    def _submit(self, job: SendJob) -> None:
        self._on_io(self._queue_job, job)

    def _wake_threads(self) -> None:
        self._waker.wake()

    def _release(self) -> None:
        self._waker.close()
        super()._release()

    # ---------------------------------------------------------------- IO thread

    def _io_main(self) -> None:
        self._cuda_thread_setup()
        try:
            while not self._stop.is_set():
                self._io_step(self._run_commands())
        except Exception as e:  # noqa: BLE001 - surface in poll_sent rather than die silently
            log.exception("%s IO thread failed", self.name)
            self._tracker.fail_all(f"{self.name} IO thread failed: {e}")
        finally:
            self._io_shutdown()

    def _run_commands(self) -> bool:
        """Run the commands queued before this call (later ones wait for the next pass); True if
        there were any."""
        queued = self._commands.qsize()
        for _ in range(queued):
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command.execute()
        return queued > 0

    def _post_chunks(self) -> bool:
        """Post chunks of the queued sends in order while there is room; True if any was posted."""
        posted = False
        # Bounded: every pass posts a chunk, drops a send, or stops.
        while self._has_room():
            head = self._next_chunk()
            if head is None or not self._post_chunk(*head):
                return posted
            posted = True
        return posted

    def _next_chunk(self) -> tuple[SendJob, Chunk] | None:
        """The oldest send's next chunk. Sends that are complete or failed leave the queue, and so
        do sends to a peer with a problem, failed with it."""
        while self._jobs:
            job = self._jobs[0]
            problem = self._peer_problem(job.peer_id)
            if problem is not None:
                self._tracker.fail_send(job.seq, problem)
            if self._tracker.is_live(job.seq) and job.next_chunk < len(job.chunks):
                return job, job.chunks[job.next_chunk]
            self._jobs.popleft()
        return None
