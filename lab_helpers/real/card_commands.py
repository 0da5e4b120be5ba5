"""python -m lab_helpers.forfait_fit: the cheapest forfait's old command, now `real_model fit --card`.

Old command lines keep working: their arguments are handed to `real_model fit --card`; an answer is
followed by one line on stderr saying where the command lives now (a refusal stays one line)."""
import sys

from lab_helpers.core.cli import error_line
from lab_helpers.real.commands import main as real_model_main

MOVED_NOTE = ("forfait_fit: note: this command is now `python -m lab_helpers.real_model fit --card` "
              "(also `iteragpu-model fit --card`); it ran with the same arguments")


def main(argv=None) -> int:
    """`real_model fit --card` on `argv` (default the process's own arguments)."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    code = real_model_main(["fit", "--card", *arguments])
    if code == 0:
        error_line(MOVED_NOTE)
    return code
