"""The command-line layer: one parser class (usage errors in one line, exit 2), the broken-pipe guard, one dispatcher."""
import argparse
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable

from lab_helpers.core.errors import EXIT_BROKEN_PIPE, EXIT_USAGE, LabError
from lab_helpers.core.text import printable


def quiet_broken_pipe(main_function):
    """Wrap a command's `main(argv=None) -> int` so that a reader closing its stdout early
    (`iteragpu-memory predict ... | head -1`) ends it quietly with EXIT_BROKEN_PIPE instead of
    a BrokenPipeError traceback. stdout is flushed inside the wrapper (after `--help` too), then
    pointed at devnull, so Python's own flush at exit finds nothing left to write."""
    @functools.wraps(main_function)
    def main(argv=None) -> int:
        try:
            try:
                return main_function(argv)
            finally:  # argparse's --help leaves its text in the buffer and raises SystemExit
                sys.stdout.flush()
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
                pass
            return EXIT_BROKEN_PIPE
    return main


class CommandParser(argparse.ArgumentParser):
    """argparse that reports every usage error as one line `prog: error: msg` and exit code 2.
    With a `hint` (" (see --help)"), the line ends with it, and the message is folded to one line of
    printable text first (argparse quotes a user's stray arguments as typed)."""

    def __init__(self, *args, hint: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.hint = hint

    def error(self, message):
        if self.hint:
            message = printable(" ".join(message.split())) + self.hint
        # a subcommand's parser is named "prog sub": its errors start "prog: error:", as the
        # command's other errors do
        self.exit(EXIT_USAGE, f"{self.prog.split()[0]}: error: {message}\n")


def error_line(text: str) -> None:
    """Print one line on stderr in a single write. Python's stderr writes through, so print() sends the
    text and its newline separately; two ranks sharing torchrun's stderr would then interleave their
    lines (one pipe write up to 4096 bytes is atomic)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one line of help, the parser-builder that adds its flags, and the
    handler that runs it on the parsed arguments and returns the exit code."""

    name: str
    help: str
    add_arguments: Callable
    handle: Callable
    example: str = ""


@dataclass(frozen=True)
class Program:
    """A command-line program: its subcommands, or one command that is the whole program (`single`).
    `on_usage_error` runs before a LabError's line is printed (torchrun's ranks use it); `usage_hint`
    ends the parser's usage errors (see CommandParser)."""

    prog: str
    description: str
    commands: tuple
    single: bool = False
    on_start: Callable = None
    on_usage_error: Callable = None
    epilog: str = ""
    usage_hint: str = ""


def program_parser(program: Program) -> argparse.ArgumentParser:
    """The whole parser of `program`, as its --help shows it."""
    # an epilog holds examples laid out by hand; without one, argparse wraps the description
    layout = {"formatter_class": argparse.RawDescriptionHelpFormatter} if program.epilog else {}
    parser = CommandParser(prog=program.prog, description=program.description, epilog=program.epilog or None,
                           hint=program.usage_hint, **layout)
    if program.single:
        program.commands[0].add_arguments(parser)
        parser.set_defaults(handler=program.commands[0].handle, command=program.commands[0].name)
        return parser
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser, metavar="COMMAND")
    for command in program.commands:
        child = sub.add_parser(command.name, help=command.help, description=command.help,
                               epilog=f"example:\n  {command.example}" if command.example else None,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_arguments(child)
        child.set_defaults(handler=command.handle)
    return parser


def command_list(program: Program) -> str:
    """What a program run with no arguments prints: its commands, one line each."""
    width = max(len(command.name) for command in program.commands)
    lines = [f"  {command.name.ljust(width)}  {command.help}" for command in program.commands]
    return "\n".join([f"usage: {program.prog} COMMAND [--help]", "commands:", *lines])


def run(program: Program, argv=None) -> int:
    """Parse `argv` (default sys.argv[1:]) and run the chosen command's handler; a LabError is one line
    `prog: error: ...` on stderr and exit code 2."""
    if program.on_start is not None:
        program.on_start()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv and not program.single:
        print(command_list(program), file=sys.stderr)
        return EXIT_USAGE
    args = program_parser(program).parse_args(argv)
    args.command_argv = argv
    try:
        return args.handler(args)
    except LabError as exc:
        if program.on_usage_error is not None:
            program.on_usage_error()
        error_line(f"{program.prog}: error: {exc}")
        return EXIT_USAGE
