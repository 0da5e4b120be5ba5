"""The command-line layer: one parser class (usage errors in one line, exit 2), the broken-pipe guard, one dispatcher."""
import argparse
import difflib
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable

from lab_helpers.core.errors import EXIT_BROKEN_PIPE, EXIT_USAGE, LabError, ParameterError
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
    """argparse that reports every usage error as one line `prog: error: msg` and exit code 2, the
    message folded to one line of printable text (argparse quotes a user's stray arguments as typed).
    With a `hint` (" (see --help)"), the line ends with it. A flag it does not know is named, with the
    closest valid one, even where argparse would first complain of a missing required flag."""

    def __init__(self, *args, hint: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.hint = hint
        self.seen_arguments = []

    def parse_known_args(self, args=None, namespace=None):
        # kept for error(): argparse checks required flags before it reports unknown ones, so
        # `--confg x` would otherwise read "the following arguments are required: --config"
        self.seen_arguments = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [extra for extra in extras if self.looks_like_flag(extra)]
            if flags:
                self.error(self.unknown_flag_message(flags[0], self.option_names(parsed)))
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def looks_like_flag(self, token: str) -> bool:
        return (len(token) > 1 and token[0] in self.prefix_chars
                and not self._negative_number_matcher.match(token))

    def knows_flag(self, token: str) -> bool:
        name = token.split("=", 1)[0]
        known = self._option_string_actions
        if name in known or (not token.startswith("--") and token[:2] in known):  # -n5
            return True
        return self.allow_abbrev and name.startswith("--") and any(o.startswith(name) for o in known)

    def option_names(self, parsed=None) -> list:
        """This parser's flags, and those of the subcommand chosen in `parsed` (if any)."""
        names = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and parsed is not None:
                child = action.choices.get(getattr(parsed, action.dest, None) or "")
                if child is not None:
                    names += list(child._option_string_actions)
        return names

    def unknown_flag_message(self, token: str, candidates) -> str:
        name = token.split("=", 1)[0]
        close = difflib.get_close_matches(name, [c for c in candidates if c.startswith("--")] or candidates,
                                          n=1, cutoff=0.6)
        suggestion = f" (did you mean {close[0]}?)" if close else ""
        return f"unrecognized arguments: {name}{suggestion}"  # argparse's own words, the flag named

    def first_unknown_flag(self):
        has_commands = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        for token in self.seen_arguments:
            if token == "--":
                return None
            if not self.looks_like_flag(token):
                if has_commands:  # what follows the command name is the subcommand's to judge
                    return None
                continue
            if not self.knows_flag(token):
                return token
        return None

    def error(self, message):
        # argparse reports a missing required flag, or the word after a mistyped flag as a wrong
        # command, before the mistyped flag itself: name that flag instead
        if message.startswith(("the following arguments are required", "argument COMMAND: invalid choice")):
            unknown = self.first_unknown_flag()
            if unknown is not None:
                message = self.unknown_flag_message(unknown, self.option_names())
        message = printable(message) + self.hint  # a newline or escape in an argument spelled out
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


# Packages the lab installs in .venv (`make lab`): a Python without one of them gets one line saying so.
THIRD_PARTY_PACKAGES = frozenset({"torch", "transformers", "pandas", "matplotlib", "numpy", "nbformat",
                                  "jupyterlab", "tqdm", "safetensors", "huggingface_hub", "tokenizers", "PIL"})


def missing_package(exc: ModuleNotFoundError):
    """The top-level name of the third-party package whose import failed, or None for any other module
    (a module of the lab itself missing is a broken install, not a missing requirement)."""
    name = (exc.name or "").split(".")[0]
    return name if name in THIRD_PARTY_PACKAGES else None


def run(program: Program, argv=None) -> int:
    """Parse `argv` (default sys.argv[1:]) and run the chosen command's handler; a LabError is one line
    `prog: error: ...` on stderr and exit code 2, and so is a package of the lab's .venv that this
    Python lacks (the commands import torch, pandas or matplotlib only when they need them)."""
    try:
        return run_parsed(program, argv)
    except ModuleNotFoundError as exc:
        package = missing_package(exc)
        if package is None:
            raise
        error_line(f"{program.prog}: error: this Python has no '{package}' package; run the lab with the "
                   f"Python that `make lab` sets up (.venv/bin/python), or install the lab's requirements")
        return EXIT_USAGE


def usage_message(exc: LabError, args) -> str:
    """The command line's words for a refusal: a parameter that is one of the parsed flags' dests is
    named as its flag (days -> --days, new_tokens -> --new-tokens); any other message as raised."""
    if not isinstance(exc, ParameterError):
        return str(exc)
    return exc.flagged(lambda name: hasattr(args, name))


def run_parsed(program: Program, argv=None) -> int:
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
        # one line whatever the message quotes: a path holding a newline or an escape sequence
        # is spelled out (\n, \x1b), never written raw to the terminal
        error_line(f"{program.prog}: error: {printable(usage_message(exc, args))}")
        return EXIT_USAGE
