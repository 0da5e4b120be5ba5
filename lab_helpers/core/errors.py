"""Exit codes and the lab's one error type: a bad input or precondition is a LabError (one line, exit 2)."""
import re


EXIT_OK, EXIT_USAGE, EXIT_PHASE = 0, 2, 3  # a phase failed on the GPU (out of memory, a CUDA error): 3


class LabError(Exception):
    """A bad input or precondition: one line, exit code 2."""


class ParameterError(LabError):
    """One parameter's value is refused: the message names the parameter as the caller gave it
    ("days must be one of 3, 7, 30, got 9"); the command line names the flag whose dest it is
    (lab_helpers.core.cli). The other parameters a problem names are written {name} in it and listed
    in `others`: a caller reads the name, the command line the flag. With `parameter` None the
    refusal is no one parameter's and `problem` is the whole message ("give {batch}, {context} or
    both")."""

    def __init__(self, parameter: "str | None", problem: str, others: tuple = ()):
        self.parameter, self.others, self.template = parameter, tuple(others), problem
        self.problem = self.worded(lambda name: name)
        super().__init__(self.problem if parameter is None else f"{parameter}{self._gap()}{self.problem}")

    def worded(self, name_of) -> str:
        """The problem with each of `others` written as `name_of(name)`."""
        text = self.template
        for other in self.others:
            text = text.replace("{" + other + "}", name_of(other))
        return text

    def flagged(self, is_flag) -> str:
        """The message as the command line words it: each parameter for which `is_flag(name)` holds
        written as its flag (new_tokens -> --new-tokens)."""
        def named(name):
            return f"--{name.replace('_', '-')}" if name.isidentifier() and is_flag(name) else name
        if self.parameter is None:
            return self.worded(named)
        return f"{named(self.parameter)}{self._gap()}{self.worded(named)}"

    def _gap(self) -> str:
        """A problem that starts with ':' follows the name at once ("predict_fit: the budget is 0")."""
        return "" if self.template.startswith(":") else " "

    def __reduce__(self):
        return type(self), (self.parameter, self.template, self.others)


EXIT_FAILURE = 1  # the command ran but its check failed (e.g. compare --fail-on-difference)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`'s writer


def safe_reason(exc: BaseException) -> str:
    """One line about `exc` with file paths blanked, so no home or user path leaks."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = re.sub(r"(?:[A-Za-z]:)?[\\/][^\s'\"]*", "<path>", text)
    return f"{type(exc).__name__}: {text}"[:300]
