"""The environment report: Python, torch, its CUDA/HIP build, every visible GPU and the memory a fresh process can use."""
import json
import platform
import sys
from dataclasses import asdict, dataclass, field

from lab_helpers.allocator.settings import recorded_environment_variables
from lab_helpers.core.errors import safe_reason
from lab_helpers.core.numbers import parse_device
from lab_helpers.core.tables import format_bytes, text_table


RUNTIME_NOTE = ("cuda_build_version / hip_build_version is the runtime built into torch, not the "
                "installed driver; record the driver separately with the vendor tool "
                "(nvidia-smi or rocm-smi).")


UNAVAILABLE = "unavailable"


USABLE_MEMORY_TIMEOUT_SECONDS = 180


USABLE_MEMORY_STEP_BYTES = 2 * 2**20  # the allocator's large segments are whole multiples of 2 MiB


USABLE_MEMORY_MAX_TRIES = 2048  # at most 4 GiB below the free figure


# Runs in a fresh process: the caller then holds no CUDA context that would take device memory.
# It creates what a measuring process has (CUDA context, a float32 cuBLAS product, a bfloat16 addmm
# with bias for cuBLASLt, their workspaces), then asks for the largest block that succeeds.
USABLE_MEMORY_CHILD = r"""
import json, sys
import torch
index, step, max_tries = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
device = torch.device("cuda", index)
torch.cuda.set_device(device)
a = torch.ones((64, 64), device=device)
keep = [a @ a]
if torch.cuda.is_bf16_supported():
    b = torch.ones((64, 64), device=device, dtype=torch.bfloat16)
    keep.append(torch.addmm(b[0], b, b.t()))
torch.cuda.synchronize(device)
size = torch.cuda.mem_get_info(device)[0] // step * step
tries = 0
while size > 0 and tries < max_tries:
    tries += 1
    try:
        block = torch.empty(size, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        size -= step
        continue
    torch.cuda.synchronize(device)
    print(json.dumps({"usable_memory_bytes": torch.cuda.memory_reserved(device), "block_bytes": size,
                      "tries": tries}))
    sys.exit(0)
print(json.dumps({"usable_memory_bytes": None, "tries": tries}))
"""


def usable_memory_command(index: int) -> list:
    """The argv of the child process that measures usable memory on cuda:`index`."""
    return [sys.executable, "-c", USABLE_MEMORY_CHILD, str(index), str(USABLE_MEMORY_STEP_BYTES),
            str(USABLE_MEMORY_MAX_TRIES)]


def usable_memory(index: int, command=None, timeout_seconds: float = USABLE_MEMORY_TIMEOUT_SECONDS) -> dict:
    """Measure, in a child process, the largest `reserved` a fresh process reaches on cuda:`index`
    (its handles and workspaces included). Return usable_memory_bytes (or "unavailable") and the reason."""
    import subprocess
    argv = usable_memory_command(index) if command is None else list(command)
    unavailable = {"usable_memory_bytes": UNAVAILABLE, "usable_memory_unavailable_reason": None}
    try:
        child = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_seconds,
                               stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {**unavailable, "usable_memory_unavailable_reason": f"no answer within {timeout_seconds} s"}
    except OSError as exc:
        return {**unavailable, "usable_memory_unavailable_reason": safe_reason(exc)}
    lines = child.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
        value = answer["usable_memory_bytes"] if isinstance(answer, dict) else None
    except (ValueError, KeyError):
        value = None
    if child.returncode == 0 and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return {"usable_memory_bytes": value, "usable_memory_unavailable_reason": None}
    last = (child.stderr.strip().splitlines() or [f"exit code {child.returncode}, no figure"])[-1]
    if child.returncode == 0:
        last = "no allocation succeeded"
    return {**unavailable, "usable_memory_unavailable_reason": safe_reason(RuntimeError(last))[14:]}


@dataclass
class EnvironmentReport:
    """Every field the diagnostic reports; what cannot be read says why."""

    python_version: str
    torch_version: str = UNAVAILABLE
    torch_unavailable_reason: str | None = None
    cuda_build_version: str | None = None
    hip_build_version: str | None = None
    runtime_note: str = RUNTIME_NOTE
    device: str = "cuda:0"
    device_count: int = 0
    device_visible: bool = False
    device_unavailable_reason: str | None = None
    device_name: str | None = None
    compute_capability: str | None = None
    total_memory_bytes: int | None = None
    free_memory_bytes: int | None = None
    usable_memory_bytes: int | str | None = None  # None: not measured (inside a measuring process)
    usable_memory_unavailable_reason: str | None = None
    # the allocator's settings as this process's environment held them when the report was made
    # (a measurement makes it after CUDA started, so they are the ones its allocator ran under)
    pytorch_cuda_alloc_conf: str | None = None
    pytorch_alloc_conf: str | None = None
    os: str = field(default_factory=platform.system)
    machine: str = field(default_factory=platform.machine)


def environment(device: str = "cuda:0", usable_memory_figure: bool = True, usable_memory_probe=None) -> dict:
    """Report Python, torch, its CUDA/HIP build and the chosen device, and in ``devices`` every
    visible GPU (index, name, total, free and usable memory, or why it is unavailable); never raises
    for a missing GPU. With `usable_memory_figure`, usable_memory_bytes is measured in a child
    process per GPU (see usable_memory); `usable_memory_probe` replaces that function (for tests)."""
    return environment_document(device, parse_device(device), usable_memory_figure, usable_memory_probe, all_devices=True)


def environment_document(device: str, index: int, usable_memory_figure: bool, usable_memory_probe,
                 all_devices: bool = False) -> dict:
    """The environment report; `all_devices` adds the ``devices`` list (left out of measurement
    files: reading another GPU's free memory would put a CUDA context on it)."""
    probe = usable_memory if usable_memory_probe is None else usable_memory_probe
    report = EnvironmentReport(python_version=platform.python_version(), device=device,
                               **recorded_environment_variables())
    devices = []

    def result():
        document = asdict(report)
        if all_devices:
            document["devices"] = devices
        return document

    if usable_memory_figure:
        report.usable_memory_bytes = UNAVAILABLE
    try:
        import torch
    except Exception as exc:  # an absent or broken torch is a valid report
        report.torch_unavailable_reason = safe_reason(exc)
        report.usable_memory_unavailable_reason = "torch cannot be imported" if usable_memory_figure else None
        return result()
    report.torch_version = str(torch.__version__)
    report.cuda_build_version = torch.version.cuda
    report.hip_build_version = getattr(torch.version, "hip", None)
    try:
        if not torch.cuda.is_available():
            report.device_unavailable_reason = "torch.cuda.is_available() is False"
        else:
            report.device_count = torch.cuda.device_count()
            if index >= report.device_count:
                report.device_unavailable_reason = f"{report.device_count} device(s) visible"
    except Exception as exc:
        report.device_unavailable_reason = safe_reason(exc)
    listed = range(report.device_count) if all_devices else ([] if report.device_unavailable_reason else [index])
    figures = {}
    if usable_memory_figure:
        # every child before this process reads free memory: that creates a CUDA context, which
        # takes device memory
        held = torch.cuda.is_initialized()
        for i in listed:
            figures[i] = dict(probe(i))
            if held and isinstance(figures[i]["usable_memory_bytes"], int):
                figures[i]["usable_memory_unavailable_reason"] = (
                    "this process already held a CUDA context: a fresh process can reach more")
    readings = {}
    for i in listed:
        try:
            props = torch.cuda.get_device_properties(i)
            readings[i] = {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                           "total_memory_bytes": int(props.total_memory),
                           "free_memory_bytes": int(torch.cuda.mem_get_info(i)[0])}
        except Exception as exc:
            readings[i] = {"unavailable_reason": safe_reason(exc)}
    for i in listed if all_devices else ():
        entry = {"index": i, **readings[i]}
        entry.pop("compute_capability", None)
        if usable_memory_figure:
            entry.update(figures[i])
        else:
            entry.update(usable_memory_bytes=None, usable_memory_unavailable_reason="not measured (--no-usable-memory)")
        devices.append(entry)
    if report.device_unavailable_reason:
        if usable_memory_figure:
            report.usable_memory_unavailable_reason = "no device visible: " + report.device_unavailable_reason
        return result()
    if usable_memory_figure:
        report.usable_memory_bytes = figures[index]["usable_memory_bytes"]
        report.usable_memory_unavailable_reason = figures[index]["usable_memory_unavailable_reason"]
    reading = readings[index]
    if "unavailable_reason" in reading:
        report.device_visible = False
        report.device_unavailable_reason = reading["unavailable_reason"]
        return result()
    report.device_visible = True
    report.device_name = reading["name"]
    report.compute_capability = reading["compute_capability"]
    report.total_memory_bytes = reading["total_memory_bytes"]
    report.free_memory_bytes = reading["free_memory_bytes"]
    return result()


def environment_table(result: dict) -> str:
    """The environment report as 'key  value' lines, then one row per visible GPU, for people."""
    fields = {key: value for key, value in result.items() if key != "devices"}
    width = max(map(len, fields))

    def shown(key, value):  # a size for people, the exact bytes beside it
        if value is None:
            return ""
        return format_bytes(value) if key.endswith("_bytes") and type(value) is int else value
    lines = [f"{key.ljust(width)}  {shown(key, value)}".rstrip() for key, value in fields.items()]
    if "devices" not in result:
        return "\n".join(lines)
    if not result["devices"]:
        return "\n".join([*lines, "visible GPUs: none"])

    def usable(entry):
        value = entry.get("usable_memory_bytes")
        return format_bytes(value) if isinstance(value, int) else f"unavailable: {entry.get('usable_memory_unavailable_reason')}"
    rows = []
    for entry in result["devices"]:
        if "unavailable_reason" in entry:
            rows.append((f"cuda:{entry['index']}", f"unavailable: {entry['unavailable_reason']}", "", "", ""))
        else:
            rows.append((f"cuda:{entry['index']}", entry["name"], format_bytes(entry["total_memory_bytes"]),
                         format_bytes(entry["free_memory_bytes"]), usable(entry)))
    return "\n".join([*lines, "visible GPUs:", text_table(("device", "name", "total", "free", "usable"), rows)])
