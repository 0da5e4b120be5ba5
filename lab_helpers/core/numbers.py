"""Units, and parsers of the numbers and device names a user types (ASCII digits, bounded before conversion)."""
import argparse
import math
import re

from lab_helpers.core.errors import LabError, ParameterError


GIB = 2**30  # binary gibibyte


GB = 10**9  # decimal gigabyte, as disk and marketing figures use


BITS_PER_BYTE = 8


MAX_BITS = 64  # no common parameter format is wider


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


MAX_DIGITS = 1000  # checked before int(): Python refuses over 4300 digits, and slowly


_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() and \d accept other scripts' digits


_NEGATIVE = re.compile(r"-[0-9]+")


_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


def _whole_problem(text, minimum, maximum):
    """Return (value, None) for a valid whole number, else (None, what is wrong)."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        return None, f"must be a whole number, got {type(text).__name__}"
    if isinstance(text, str):
        if len(text) > MAX_DIGITS:
            return None, f"has {len(text)} characters; at most {MAX_DIGITS} digits are accepted"
        if _NEGATIVE.fullmatch(text) and text.strip("-0"):  # "-0" is no number below 0: a sign, refused below
            # a minus sign before digits is a number out of range, not a typing error: said as the bound
            return None, _below_minimum(minimum, text)
        if not _DIGITS.fullmatch(text):
            return None, f"not an integer: {text[:40]!r} (a whole number, digits 0-9 only)"
        value = int(text)
    else:
        value = text
    if minimum is not None and value < minimum:
        return None, _below_minimum(minimum, str(value))
    if maximum is not None and value > maximum:
        shown = str(value) if value < 10**40 else f"a {len(str(value))}-digit number"
        return None, f"must be at most {maximum}, got {shown}"
    return value, None


def _below_minimum(minimum, shown: str) -> str:
    """What is wrong with a whole number below `minimum` (None: 0, no sign is accepted), written `shown`."""
    shown = shown if len(shown) <= 41 else f"a {len(shown) - 1}-digit negative number"
    if minimum is None or minimum == 0:
        return f"must be >= 0, got {shown}"
    return f"must be > 0, got {shown}" if minimum == 1 else f"must be >= {minimum}, got {shown}"


def parse_whole(text, name: str, minimum=None, maximum=None) -> int:
    """Return the whole number written in `text` (ASCII digits 0-9 only, no sign, no '_', no spaces),
    within [minimum, maximum]; raise LabError naming `name` otherwise (a ParameterError where `name` is
    a parameter's identifier, such as "batch": the command line names its flag). The digit count is checked
    before conversion, so a huge string is refused at once."""
    return _checked(_whole_problem, text, name, minimum, maximum)


def whole_number(minimum=None, maximum=None):
    """Return an argparse `type=` callable that accepts what parse_whole accepts."""
    return _argument_type(_whole_problem, minimum, maximum, "whole number")


def _checked(problem_of, text, name, minimum, maximum):
    value, problem = problem_of(text, minimum, maximum)
    if problem:
        raise ParameterError(name, problem) if name.isidentifier() else LabError(f"{name} {problem}")
    return value


def _argument_type(problem_of, minimum, maximum, type_name):
    def convert(text):
        value, problem = problem_of(text, minimum, maximum)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    convert.__name__ = type_name  # argparse names a type that fails by its __name__
    return convert


def _decimal_problem(text, minimum, maximum):
    if not isinstance(text, str):
        return None, f"must be a number, got {type(text).__name__}"
    if len(text) > MAX_DIGITS:
        return None, f"has {len(text)} characters; at most {MAX_DIGITS} are accepted"
    if not _DECIMAL.fullmatch(text):
        return None, f"must be a decimal number written with the digits 0-9 and '.', got {text[:40]!r}"
    value = float(text)
    if not math.isfinite(value):
        return None, f"must be finite, got {text[:40]!r}"
    if minimum is not None and value < minimum:
        return None, f"must be at least {minimum}, got {value}"
    if maximum is not None and value > maximum:
        return None, f"must be at most {maximum}, got {value}"
    return value, None


def parse_decimal(text, name: str, minimum=None, maximum=None) -> float:
    """Return the finite, non-negative number written in `text` (ASCII digits and one '.', no sign,
    no exponent, no nan/inf), within [minimum, maximum]; raise LabError naming `name` otherwise."""
    return _checked(_decimal_problem, text, name, minimum, maximum)


def decimal_number(minimum=None, maximum=None):
    """Return an argparse `type=` callable that accepts what parse_decimal accepts."""
    return _argument_type(_decimal_problem, minimum, maximum, "number")


MAX_DEVICE_DIGITS = 6


def parse_device(device: str) -> int:
    """Return N for an explicit 'cuda:N' device string (N: ASCII digits), else raise ParameterError."""
    match = re.fullmatch(r"cuda:([0-9]{1,%d})" % MAX_DEVICE_DIGITS, device) if isinstance(device, str) else None
    if not match:
        shown = repr(device[:40]) if isinstance(device, str) else type(device).__name__
        raise ParameterError("device", f"must be an explicit cuda:N (e.g. cuda:0), got {shown}")
    return int(match.group(1))


MIB = 2**20
