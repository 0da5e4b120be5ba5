"""torchrun, the launcher: its variables, what a rank prints, and how every rank ends on one bad input."""
import os
import time
from dataclasses import dataclass

from lab_helpers.core.errors import LabError, ParameterError, safe_reason
from lab_helpers.core.numbers import parse_whole
from lab_helpers.measurement.protocol import import_torch
from lab_helpers.measurement.schema import MAX_TENSOR_PARALLEL


# One measuring process per GPU, started by torchrun (torch.distributed's launcher); the lab adds
# no launcher of its own. Names other measuring commands use: launch_info, LaunchInfo,
# TensorParallelRun.


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


# Where torchrun's store lives; read to publish a failure to every rank.
STORE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
                   "TORCHELASTIC_RESTART_COUNT")


MAX_LAUNCHER_NUMBER = 2**31 - 1


EXIT_TERMINATED = 128 + 15  # what a shell reports for a process SIGTERM ended


def launcher_environment() -> dict:
    """torchrun's variables (LAUNCHER_VARIABLES and STORE_VARIABLES) that are set, by name: the only
    environment variables the lab reads, and only for a tensor-parallel run."""
    return {name: os.environ[name] for name in (*LAUNCHER_VARIABLES, *STORE_VARIABLES) if name in os.environ}


LAUNCHER_STOP = {"received": False}  # torchrun's SIGTERM, recorded by hold_launcher_stop


def _launched_by_torchrun() -> bool:
    return any(name in launcher_environment() for name in LAUNCHER_VARIABLES)


def hold_launcher_stop() -> None:
    """Under torchrun, from the start of a command: record torchrun's SIGTERM instead of ending at once.
    torchrun stops the ranks still running once one rank has ended. A rank that meets a bad input, as
    every rank does alike, still prints its own line and ends with 2 (keep_own_exit_code); a rank that
    reaches TensorParallelRun after the signal ends there in one line, since a peer is gone."""
    if _launched_by_torchrun():
        import signal
        try:
            signal.signal(signal.SIGTERM, lambda signum, frame: LAUNCHER_STOP.update(received=True))
        except ValueError:  # not the main thread: signal handlers belong to it
            pass


def keep_own_exit_code() -> None:
    """In a process torchrun started, ignore torchrun's SIGTERM from now on: this rank is about to print
    its own line and end with its own code."""
    if _launched_by_torchrun():
        import signal
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:
            pass


USAGE_WAIT_SECONDS = 10.0


def wait_for_every_rank(name: str = "usage-error", timeout_seconds: float = USAGE_WAIT_SECONDS) -> None:
    """Under torchrun (its agent hosting the store), after this rank printed its line: count it in the
    store and wait, at most `timeout_seconds`, until every rank has. torchrun stops the ranks still
    running as soon as one has ended, so a rank that ended at once could cut a slower rank's line
    short; with this wait, every rank that meets the same bad input reports it."""
    env = launcher_environment()
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        import datetime

        import torch.distributed as dist
        world = parse_whole(env["WORLD_SIZE"], "WORLD_SIZE", 1, MAX_LAUNCHER_NUMBER)
        store = dist.TCPStore(env["MASTER_ADDR"], parse_whole(env["MASTER_PORT"], "MASTER_PORT", 1, 65535), None,
                              is_master=False, timeout=datetime.timedelta(seconds=timeout_seconds),
                              wait_for_workers=False)
        key = f"iteragpu-lab/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"
        deadline = time.monotonic() + timeout_seconds
        count = store.add(key, 1)
        while count < world and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(key, 0)
    except Exception:  # no store, a bad variable, a broken connection: end now, the line is printed
        pass


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place among the ranks, as torchrun set it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def device(self) -> str:
        """The GPU of this rank: cuda:LOCAL_RANK (torchrun starts one process per GPU of a machine)."""
        return f"cuda:{self.local_rank}"


def launcher_command(tensor_parallel: int, command) -> str:
    """The torchrun command line that runs `command` at `tensor_parallel` ranks on one machine.
    `command` is what follows torchrun's own flags (`-m lab_helpers.mesure_memoire measure ...`), as
    a string or as an argv list (quoted for a POSIX shell)."""
    import shlex
    tail = command if isinstance(command, str) else shlex.join(str(part) for part in command)
    return f"torchrun --nproc-per-node {tensor_parallel} {tail}"


def launch_info(tensor_parallel: int, command, environ=None) -> LaunchInfo:
    """Read this rank's place from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE) and check it against `tensor_parallel` and the GPUs torch sees. LabError (one
    line) when no launcher started this process (the message holds the torchrun command built from
    `command`, see launcher_command), when a variable is missing or not a whole number, when
    WORLD_SIZE differs from `tensor_parallel`, when a rank is out of range, or when this machine runs
    more ranks than it has visible GPUs. `environ` replaces launcher_environment() (for tests)."""
    info = launcher_place(tensor_parallel, command, environ)
    torch = import_torch()
    try:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken driver reads as no device, with its reason
        raise LabError(f"no CUDA device is usable by torch ({safe_reason(exc)})") from None
    if visible == 0:
        raise ParameterError(None, f"no CUDA device is visible to torch; {{tensor_parallel}} {tensor_parallel} needs one "
                             "GPU per rank and never falls back to the CPU", ("tensor_parallel",))
    if info.local_world_size > visible:
        raise LabError(f"{info.local_world_size} ranks on this machine (LOCAL_WORLD_SIZE) but {visible} GPU(s) "
                       "visible: one GPU per rank; lower --nproc-per-node and --tensor-parallel")
    return info


def launcher_place(tensor_parallel: int, command, environ=None) -> LaunchInfo:
    """launch_info's checks of the launcher's environment alone, with no torch: a command refuses a
    run started without torchrun, or at another degree, before it imports anything heavy."""
    parse_whole(tensor_parallel, "tensor_parallel", 1, MAX_TENSOR_PARALLEL)
    env = launcher_environment() if environ is None else environ
    run_it = launcher_command(tensor_parallel, command)
    present = [name for name in LAUNCHER_VARIABLES if name in env]
    if not present:
        raise ParameterError("tensor_parallel", f"{tensor_parallel} runs one process per GPU, started by torchrun; "
                                                f"run: {run_it}")
    values = {}
    for name in LAUNCHER_VARIABLES:
        if name not in env:
            raise LabError(f"the launcher's environment is incomplete: {name} is not set "
                           f"(start the command with torchrun: {run_it})")
        values[name] = parse_whole(env[name], f"the launcher's {name}", 0, MAX_LAUNCHER_NUMBER)
    info = LaunchInfo(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
    if info.world_size != tensor_parallel:
        raise ParameterError("tensor_parallel", f"{tensor_parallel} disagrees with the launcher's world size "
                                                f"{info.world_size} (WORLD_SIZE): the degree is the number of "
                                                f"ranks; run: {run_it}")
    if info.rank >= info.world_size:
        raise LabError(f"the launcher's RANK {info.rank} is not below its WORLD_SIZE {info.world_size}")
    if not 1 <= info.local_world_size <= info.world_size:
        raise LabError(f"the launcher's LOCAL_WORLD_SIZE {info.local_world_size} is not between 1 and "
                       f"its WORLD_SIZE {info.world_size}")
    if info.local_rank >= info.local_world_size:
        raise LabError(f"the launcher's LOCAL_RANK {info.local_rank} is not below its LOCAL_WORLD_SIZE "
                       f"{info.local_world_size}")
    return info
