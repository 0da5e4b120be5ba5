"""The allocator settings the lab models (PYTORCH_CUDA_ALLOC_CONF), read once from a flag, the
environment or a measurement file; a setting the lab does not model is refused in one line."""
import os
import sys
from dataclasses import dataclass

from lab_helpers.allocator.expandable import ExpandableAllocator
from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.errors import LabError


# torch reads PYTORCH_ALLOC_CONF in its newer versions and PYTORCH_CUDA_ALLOC_CONF in all of them;
# the lab reads both and refuses two different texts, whichever one a given torch prefers
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


MAX_ALLOC_CONF_CHARS = 200  # checked before the text is read: PyTorch's own settings fit in far fewer


# What the lab replays, and the values PyTorch's parser accepts for it (AllocatorConfig::parseArgs:
# exactly True or False). Every other key (max_split_size_mb, garbage_collection_threshold,
# roundup_power2_divisions, backend, ...) changes what the allocator does in ways the lab does not model.
MODELLED_SETTINGS = {"expandable_segments": ("True", "False")}


ALLOCATOR_CONF_HELP = ("the CUDA caching allocator's settings, as PYTORCH_CUDA_ALLOC_CONF writes them: "
                       "expandable_segments:True or expandable_segments:False (the lab models no other "
                       "setting); default: PYTORCH_CUDA_ALLOC_CONF from the environment, else PyTorch's defaults")


def allocator_environment():
    """The process's environment, of which only ALLOC_CONF_VARIABLES are ever read or set here."""
    return os.environ  # the allocator's variables only: PyTorch reads its settings there


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator settings a run uses (only those the lab models)."""

    expandable_segments: bool = False

    def conf_text(self) -> str:
        """The settings as PYTORCH_CUDA_ALLOC_CONF writes them."""
        return f"expandable_segments:{self.expandable_segments}"

    def describe(self) -> str:
        """For people and documents: what the allocator replays."""
        if self.expandable_segments:
            return ("expandable_segments:True (one segment per pool that grows in pages: 2 MiB for requests "
                    "up to 1 MiB, 20 MiB for larger ones)")
        return "PyTorch's default caching allocator (expandable_segments:False)"


DEFAULT_SETTINGS = AllocatorSettings()


def parse_allocator_conf(text, name: str) -> AllocatorSettings:
    """The settings written in `text` (`key:value` pairs separated by commas; spaces ignored, as
    PyTorch's lexer ignores them); LabError naming `name` for anything the lab does not model."""
    if not isinstance(text, str):
        raise LabError(f"{name} must be a text such as expandable_segments:True, got {type(text).__name__}")
    if len(text) > MAX_ALLOC_CONF_CHARS:
        raise LabError(f"{name} has {len(text)} characters; at most {MAX_ALLOC_CONF_CHARS} are accepted")
    if any(not " " <= c <= "~" for c in text):
        raise LabError(f"{name} holds a character that is not printable ASCII: {text[:40]!r}")
    compact = text.replace(" ", "")
    if not compact:
        return DEFAULT_SETTINGS
    found = {}
    for item in compact.split(","):
        key, colon, value = item.partition(":")
        if not colon or not key or not value or ":" in value or "[" in item or "]" in item:
            raise LabError(f"{name}: {item[:40]!r} is not a key:value pair (e.g. expandable_segments:True)")
        if key not in MODELLED_SETTINGS:
            raise LabError(f"{name}: {key[:40]!r} is an allocator setting the lab does not model; it models "
                           f"expandable_segments:True and expandable_segments:False only")
        if value not in MODELLED_SETTINGS[key]:
            raise LabError(f"{name}: {key} must be True or False (as PyTorch writes them), got {value[:40]!r}")
        if key in found:
            raise LabError(f"{name}: {key} is given twice")
        found[key] = value
    return AllocatorSettings(expandable_segments=found.get("expandable_segments") == "True")


def settings_from_environment(environ=None) -> AllocatorSettings:
    """The settings PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) gives; PyTorch's defaults if unset."""
    environ = allocator_environment() if environ is None else environ
    given = {name: environ[name] for name in ALLOC_CONF_VARIABLES if name in environ}
    texts = {parse_allocator_conf(text, name) for name, text in given.items()}
    if len(texts) > 1:
        raise LabError(f"{' and '.join(given)} are both set, to different settings; set one")
    return texts.pop() if texts else DEFAULT_SETTINGS


def allocator_settings(flag_text=None, environ=None) -> AllocatorSettings:
    """The settings of a command: --allocator-conf when given, else the environment's."""
    if flag_text is not None:
        return parse_allocator_conf(flag_text, "--allocator-conf")
    return settings_from_environment(environ)


def recorded_settings(environment_record) -> AllocatorSettings:
    """The settings a measurement ran under, from its environment block (what the measuring process's
    environment held; a file without the fields ran before they were recorded, under the defaults)."""
    record = environment_record if isinstance(environment_record, dict) else {}
    given = {}
    for variable in ALLOC_CONF_VARIABLES:
        value = record.get(variable.lower())
        if value is not None:
            given[variable] = value
    texts = {parse_allocator_conf(text, f"the measurement's environment.{name.lower()}")
             for name, text in given.items()}
    if len(texts) > 1:
        raise LabError("the measurement's environment records two different allocator settings")
    return texts.pop() if texts else DEFAULT_SETTINGS


def recorded_environment_variables(environ=None) -> dict:
    """{pytorch_cuda_alloc_conf, pytorch_alloc_conf}: the variables as this process holds them (None
    when unset), cut to MAX_ALLOC_CONF_CHARS, for the environment report."""
    environ = allocator_environment() if environ is None else environ
    return {name.lower(): (environ[name][:MAX_ALLOC_CONF_CHARS] if name in environ else None)
            for name in ALLOC_CONF_VARIABLES}


def put_in_force(settings: AllocatorSettings, environ=None) -> None:
    """Make `settings` the allocator's for this process, before CUDA initialises: the variables are
    set (PyTorch reads them when its allocator starts); a torch already imported is told at once.
    LabError when CUDA already runs here under other settings (they cannot change it any more)."""
    environ = allocator_environment() if environ is None else environ
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        current = settings_from_environment(environ)
        if current != settings:
            raise LabError(f"CUDA is already initialised in this process under {current.conf_text()}; "
                           f"{settings.conf_text()} must be set before it starts")
        return
    for name in ALLOC_CONF_VARIABLES:
        environ[name] = settings.conf_text()
    if torch is not None:  # its allocator may have read the variables at import: tell it directly
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # newer torch; the older name warns
        (setter or torch.cuda.memory._set_allocator_settings)(settings.conf_text())


def replay_allocator(settings: AllocatorSettings):
    """The model of the allocator under `settings`, on a device that never runs out of memory."""
    return ExpandableAllocator() if settings.expandable_segments else AllocatorModel()
