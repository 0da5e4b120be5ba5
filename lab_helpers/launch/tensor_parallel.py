"""One measuring process per GPU under torchrun: the process group, its coordination over gloo, and failures on any rank."""
import json
import os
import sys
import time

from lab_helpers.core.cli import error_line
from lab_helpers.core.errors import EXIT_PHASE, EXIT_USAGE, LabError, safe_reason
from lab_helpers.core.numbers import parse_whole
from lab_helpers.launch.torchrun import EXIT_TERMINATED, LAUNCHER_STOP, LaunchInfo, launcher_environment
from lab_helpers.measurement.protocol import PhaseError, import_torch


# Every wait between ranks is bounded. A rank that dies is seen by torchrun at once, which stops the
# others; a rank that hangs holds the others at most this long in a collective or in gather.
COORDINATION_TIMEOUT_SECONDS = 300


MONITOR_INTERVAL_SECONDS = 0.1  # how often the monitor reads the store; torchrun's SIGTERM and the end wake it at once


FAILURE_ACK_SECONDS = 20  # a failing rank waits this long for every rank to print the line


ABORT_WAIT_SECONDS = 10  # aborting a communicator can itself block on a broken peer


STORE_LOST_SECONDS = 30  # the monitor gives up on a store it cannot reach for this long


ACK_POLL_SECONDS = 0.005


STORE_CALL_MARGIN_SECONDS = 30  # a store call that timed out still needs the CPU to raise, on a busy machine


class TensorParallelRun:
    """The distributed side of one measuring process among N (a context manager).

    On enter: reads the device's free memory and the allocator's reserved bytes, starts the NCCL
    process group (``init_process_group("nccl", device_id=device)``) and a gloo group that carries
    the lab's own messages (never NCCL, so the caching allocator sees none of them), makes the NCCL
    communicators connect with one all-reduce of a tiny tensor (then an all-gather, which makes the
    process group let go of it), releases them and empties the cache, checks that the allocator is
    back where it was (every phase starts from an empty allocator; a failure otherwise), then reads
    free memory again. ``outside_allocator``
    = {before_bytes, after_bytes, nccl_outside_allocator_bytes}: the drop in free memory less the
    growth of reserved, what NCCL holds outside PyTorch's allocator (None on a CPU device).

    A rank that fails calls ``fail(error)``: the failure {rank, phase, message} goes to torchrun's
    store; every rank's monitor thread sees it, aborts its communicator (a rank blocked in a
    collective must not hang), prints one line ``PROG: error: rank R failed in phase P: ...; no file
    written`` on stderr and ends with the same exit code. On exit the monitor thread is joined and the
    groups are destroyed, their threads with them, before the interpreter exits.
    `backend` and `timeout_seconds` exist for tests on the CPU (gloo)."""

    def __init__(self, info: LaunchInfo, device, prog: str = "mesure_memoire", *, backend=None,
                 timeout_seconds: float = COORDINATION_TIMEOUT_SECONDS, environ=None):
        torch = import_torch()
        self.info = info
        self.rank, self.world_size = info.rank, info.world_size
        self.device = torch.device(device)
        self.prog = prog
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout_seconds = timeout_seconds
        self.group = None
        self.outside_allocator = None
        self._environ = launcher_environment() if environ is None else environ
        self._gloo = None
        self._store = None
        self._store_lock = None
        self._stopped = None
        self._monitor = None
        self._wake = None
        self._ending = None

    # ---- the store: failures and acknowledgements
    def _connect(self, master: bool):
        import datetime
        import torch.distributed as dist
        host = self._environ.get("MASTER_ADDR")
        port = self._environ.get("MASTER_PORT")
        if not host or port is None:
            raise LabError("the launcher's environment lacks MASTER_ADDR or MASTER_PORT; start the command "
                           "with torchrun")
        port = parse_whole(port, "the launcher's MASTER_PORT", 1, 65535)
        return dist.TCPStore(host, port, self.world_size if master else None, is_master=master,
                             timeout=datetime.timedelta(seconds=self.timeout_seconds), wait_for_workers=False)

    def _key(self, name: str) -> str:
        run_id = self._environ.get("TORCHELASTIC_RUN_ID", "")
        restart = self._environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"iteragpu-lab/{run_id}/{restart}/{name}"

    def __enter__(self):
        import datetime
        import socket
        import threading
        import torch
        import torch.distributed as dist
        # torchrun's agent hosts the store; launched otherwise (env:// by hand), rank 0 hosts it
        agent = self._environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self._store = self._connect(master=not agent and self.rank == 0)
        group_store = self._connect(master=False)  # its own connection: the monitor thread uses the first
        self._store_lock = threading.Lock()
        self._stopped = threading.Event()
        self._ending = threading.Lock()
        self._wake = socket.socketpair()  # __exit__ writes one byte: the monitor ends without waiting out a poll
        self._wake[0].setblocking(False)
        self._catch_termination()
        self._monitor = threading.Thread(target=self._watch, name="iteragpu-lab failure monitor", daemon=True)
        self._monitor.start()
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.set_device(self.device)
                torch.cuda.synchronize(self.device)
                free_before = int(torch.cuda.mem_get_info(self.device)[0])
                reserved_before = torch.cuda.memory_reserved(self.device)
                allocated_before = torch.cuda.memory_allocated(self.device)
            timeout = datetime.timedelta(seconds=self.timeout_seconds)
            dist.init_process_group(self.backend, store=dist.PrefixStore(self._key("group"), group_store),
                                    rank=self.rank, world_size=self.world_size, timeout=timeout,
                                    device_id=self.device if cuda else None)
            self.group = dist.group.WORLD
            self._gloo = self.group if self.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
            # NCCL connects at the first collective, not at init: one all-reduce of a tiny tensor
            # makes its buffers exist before any phase (measured: about 0.5 GB more per rank there)
            tiny = torch.ones(1, device=self.device)
            dist.all_reduce(tiny, group=self.group)
            if cuda:
                torch.cuda.synchronize(self.device)
                # the sequence measured (torch 2.11, NCCL 2.28) to leave the allocator empty once
                # released: an all-reduce, then an all-gather. Every wait on the gloo group goes through
                # a CPU tensor: barrier() on a group bound to a GPU puts its token tensor on that GPU,
                # where it stays (measured: 512 bytes and a 2 MiB segment in every phase)
                gathered = torch.empty(self.world_size, device=self.device)
                dist.all_gather_into_tensor(gathered, tiny, group=self.group)
                torch.cuda.synchronize(self.device)
                del gathered
            del tiny
            # not dist.barrier: on a group bound to a GPU it allocates its token tensor on that GPU
            # (measured: 512 bytes and a 2 MiB segment left in the caching allocator)
            dist.all_reduce(torch.zeros(1), group=self._gloo)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.synchronize(self.device)
                free_after = int(torch.cuda.mem_get_info(self.device)[0])
                reserved_after = torch.cuda.memory_reserved(self.device)
                allocated_after = torch.cuda.memory_allocated(self.device)
                if allocated_after != allocated_before or reserved_after != reserved_before:
                    raise RuntimeError(
                        f"the allocator is not back where it was after the process group's set-up: "
                        f"{allocated_after - allocated_before} bytes allocated and "
                        f"{reserved_after - reserved_before} reserved remain, so the phases would not start "
                        "from an empty allocator")
                self.outside_allocator = {
                    "label": "outside PyTorch's caching allocator: device free memory before and after the "
                             "process group and its communicators exist, less the allocator's reserved growth",
                    "before_bytes": free_before, "after_bytes": free_after,
                    "nccl_outside_allocator_bytes": (free_before - free_after) - (reserved_after - reserved_before),
                }
        except Exception as exc:  # every rank must hear of it, or the others wait in a collective
            self.fail(exc, phase="process group setup")
        return self

    def __exit__(self, exc_type, exc, tb):
        import torch.distributed as dist
        if exc is not None and isinstance(exc, Exception):
            self.fail(exc)  # does not return: every rank ends with the same line and code
        self._stop_monitor()
        if dist.is_initialized():
            dist.destroy_process_group()
        # destroy_process_group shuts the groups down but gloo's threads live as long as the group
        # objects: dropping the last references joins them here, while the interpreter is whole. Left
        # to the interpreter's exit, a C++ thread that still needs Python ends the process in
        # std::terminate (SIGABRT: "terminate called without an active exception").
        self.group = None
        self._gloo = None
        self._release_termination()
        return False

    def _stop_monitor(self):
        """End the monitor thread and wait for it. It must not outlive the interpreter: a daemon thread
        that comes back from a store call (which runs without the GIL) once the interpreter is
        finalizing is ended by Python inside a C++ frame, and the process aborts in std::terminate.
        The wake byte ends its wait at once; a store call in progress returns or raises within the
        store's own timeout (timeout_seconds), which bounds this join."""
        self._stopped.set()
        try:
            self._wake[1].send(b"x")
        except OSError:
            pass
        self._monitor.join(timeout=self.timeout_seconds + STORE_CALL_MARGIN_SECONDS)
        for end in self._wake:
            end.close()

    # ---- termination by the launcher
    # torchrun sends SIGTERM to every rank still running once one has ended. A rank reporting a
    # failure must still end with the failure's code, so SIGTERM reaches the monitor thread (through
    # Python's wakeup fd) instead of ending the process at once; the monitor ends it.
    def _catch_termination(self):
        import signal
        import socket
        import threading
        self._termination = None
        self._sigterm = False
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread; torchrun's SIGTERM then ends the rank
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        self._termination = (reader, writer, previous_fd, previous_handler)
        self._sigterm = LAUNCHER_STOP["received"]  # torchrun stopped this rank before the run began

    def _release_termination(self):
        import signal
        if self._termination is None:
            return
        reader, writer, previous_fd, previous_handler = self._termination
        signal.signal(signal.SIGTERM, previous_handler)
        signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()
        self._termination = None

    def _terminated(self) -> bool:
        """True once torchrun's SIGTERM has arrived (read by either thread, remembered for both). Reads
        whatever the signals wrote, so that a wait on the socket never sees an old byte again."""
        import signal
        if self._termination is None:
            return self._sigterm
        try:
            received = self._termination[0].recv(256)
        except (BlockingIOError, OSError):
            received = b""
        if signal.SIGTERM in received:
            self._sigterm = True
        return self._sigterm

    def _wait_for_signal(self, seconds: float, *also):
        """Sleep `seconds`, or less when a signal (torchrun's SIGTERM) or a byte on one of `also` arrives."""
        import select
        ready = [end for end in (self._termination[0] if self._termination else None, *also) if end is not None]
        try:
            select.select(ready, [], [], seconds)
        except (OSError, ValueError):  # a socket closed under the wait: the caller reads the state again
            time.sleep(seconds)

    def gather(self, obj):
        """Every rank's picklable `obj`, in rank order, on rank 0 (None on the others), over gloo."""
        import torch.distributed as dist
        received = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, received, dst=0, group=self._gloo)
        return received

    def broadcast(self, obj):
        """Rank 0's picklable `obj` on every rank, over gloo (`obj` is ignored on the others)."""
        import torch.distributed as dist
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._gloo)
        return box[0]

    # ---- failure
    def fail(self, error, phase=None, rank=None):
        """Publish this rank's failure to every rank, print the one line and end the process with
        the failure's exit code (EXIT_USAGE for a LabError, EXIT_PHASE otherwise). Never returns.
        When another rank failed first, its failure is the one every rank reports. `rank` names
        the rank the failure happened on when every rank reports one rank's failure (default: this)."""
        phase = phase if phase is not None else getattr(error, "phase", None)
        if isinstance(error, PhaseError):
            message = error.message
        elif isinstance(error, LabError):
            message = str(error)
        else:
            message = safe_reason(error)
        failure = {"rank": self.rank if rank is None else rank, "phase": phase, "message": message,
                   "exit_code": EXIT_USAGE if isinstance(error, LabError) else EXIT_PHASE}
        try:
            with self._store_lock:
                # the first failure published wins: every rank then prints the same line
                stored = self._store.compare_set(self._key("failure"), "", json.dumps(failure))
            failure = json.loads(stored)
        except Exception:  # the store is gone: report this rank's own failure
            pass
        self._end(failure)

    def failure_line(self, failure: dict) -> str:
        """The one line every rank prints for a published failure."""
        where = f"in phase {failure['phase']}" if failure.get("phase") else "outside the measured phases"
        return f"{self.prog}: error: rank {failure['rank']} failed {where}: {failure['message']}; no file written"

    def _end(self, failure: dict):
        import threading
        self._ending.acquire()  # once per process: a second caller waits for the exit below
        try:
            sys.stdout.flush()
        except Exception:
            pass
        error_line(self.failure_line(failure))
        # the main thread may be blocked in a collective whose peer will never come: abort the
        # communicator (bounded: an abort can itself wait on a broken peer)
        aborting = threading.Thread(target=self._abort, daemon=True)
        aborting.start()
        aborting.join(ABORT_WAIT_SECONDS)
        try:  # every rank has printed before any exits, and they exit together
            with self._store_lock:
                self._store.add(self._key("failure-ack"), 1)
            deadline = time.monotonic() + FAILURE_ACK_SECONDS
            while time.monotonic() < deadline:
                with self._store_lock:
                    if self._store.add(self._key("failure-ack"), 0) >= self.world_size:
                        break
                # torchrun stops the survivors once a rank has ended: every rank that acknowledges
                # ends after all have, so this one is the last or a rank vanished without a word
                if self._terminated():
                    break
                self._wait_for_signal(ACK_POLL_SECONDS)
        except Exception:
            pass
        os._exit(failure.get("exit_code", EXIT_PHASE))

    def _abort(self):
        try:
            if self.group is not None and hasattr(self.group, "abort"):
                self.group.abort()
        except Exception:  # gloo or an older torch cannot abort: the exit below ends the process
            pass

    def _watch(self):
        key = self._key("failure")
        lost_since = None
        while not self._stopped.is_set():
            try:
                with self._store_lock:
                    found = self._store.check([key])
                    stored = self._store.get(key) if found else None
                lost_since = None
            except Exception:
                if self._stopped.is_set():
                    return
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > STORE_LOST_SECONDS:
                    self._end({"rank": self.rank, "phase": None, "exit_code": EXIT_PHASE,
                               "message": "lost contact with the launcher's store"})
                stored = None
            if stored:
                self._end(json.loads(stored))
            if self._terminated() and not self._ending.locked():
                # stopped by torchrun with no failure published: a rank vanished
                error_line(f"{self.prog}: error: rank {self.rank} stopped by torchrun (another rank ended without "
                           "reporting); no file written")
                os._exit(EXIT_TERMINATED)
            # the failure key is polled (the store has no notification); torchrun's SIGTERM and the
            # end of the run wake this wait at once
            self._wait_for_signal(MONITOR_INTERVAL_SECONDS, self._wake[0])
