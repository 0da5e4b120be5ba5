"""Exit codes and the lab's one error type: a bad input or precondition is a LabError (one line, exit 2)."""
import re


EXIT_OK, EXIT_USAGE, EXIT_PHASE = 0, 2, 3  # a phase failed on the GPU (out of memory, a CUDA error): 3


class LabError(Exception):
    """A bad input or precondition: one line, exit code 2."""


class ParameterError(LabError):
    """One parameter's value is refused: the message names the parameter as the caller gave it
    ("days must be one of 3, 7, 30, got 9"); the command line names the flag whose dest it is."""

    def __init__(self, parameter: str, problem: str):
        super().__init__(f"{parameter} {problem}")
        self.parameter = parameter
        self.problem = problem

    def __reduce__(self):
        return type(self), (self.parameter, self.problem)


EXIT_FAILURE = 1  # the command ran but its check failed (e.g. compare --fail-on-difference)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`'s writer


def safe_reason(exc: BaseException) -> str:
    """One line about `exc` with file paths blanked, so no home or user path leaks."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = re.sub(r"(?:[A-Za-z]:)?[\\/][^\s'\"]*", "<path>", text)
    return f"{type(exc).__name__}: {text}"[:300]
