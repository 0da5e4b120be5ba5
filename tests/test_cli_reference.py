"""docs/cli.md is the generated command-line reference: it must equal what the parsers give."""
import os
import sys
from pathlib import Path

import pytest

from lab_helpers.build.cli_reference import (REFERENCE_BANNER, REFERENCE_PATH, main, programs, reference_text,
                                             subcommand_parsers, write_reference)
from lab_helpers.core.paths import REPOSITORY


def test_docs_cli_md_is_up_to_date():
    committed = (REPOSITORY / REFERENCE_PATH).read_text(encoding="utf-8")
    assert committed == reference_text(), "docs/cli.md is stale: run `make sync`"


def test_check_mode_reports_a_stale_reference_and_writes_nothing(tmp_path):
    (tmp_path / "docs").mkdir()
    stale = tmp_path / REFERENCE_PATH
    stale.write_text("old\n", encoding="utf-8")
    assert write_reference(tmp_path, check=True) == [REFERENCE_PATH]
    assert stale.read_text(encoding="utf-8") == "old\n"
    assert write_reference(tmp_path) == [REFERENCE_PATH]
    assert stale.read_text(encoding="utf-8") == reference_text()
    assert write_reference(tmp_path, check=True) == []


def test_check_command_exit_codes(capsys):
    assert main(["--check"]) == 0
    assert capsys.readouterr().out == ""


def test_the_banner_comes_first():
    lines = reference_text().splitlines()
    assert lines[0] == "# Command-line reference"
    assert REFERENCE_BANNER in lines[:4]


@pytest.mark.parametrize("title, builder", programs(), ids=[title for title, _ in programs()])
def test_every_program_appears_with_its_subcommands(title, builder):
    text = reference_text()
    assert f"\n## {title}\n" in text
    parser = builder()
    assert f"usage: {parser.prog}" in text
    for name, child in subcommand_parsers(parser):
        assert f"\n### {title} {name}\n" in text
        assert f"usage: {child.prog}" in text


@pytest.mark.parametrize("title, commands", [
    ("mesure_memoire", ("estimate", "environment", "measure", "predict", "compare")),
    ("real_model", ("predict", "measure", "compare", "fit")),
    ("timeline", ("plot", "explain")),
    ("kit", ("build", "verify")),
])
def test_each_programs_commands_are_listed(title, commands):
    text = reference_text()
    for name in commands:
        assert f"\n### {title} {name}\n" in text


def test_the_width_does_not_follow_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = reference_text()
    monkeypatch.setenv("COLUMNS", "250")
    assert reference_text() == narrow
    assert os.environ["COLUMNS"] == "250"


def test_no_absolute_path_of_this_machine():
    text = reference_text()
    places = {str(REPOSITORY), str(Path.home()), sys.prefix, sys.base_prefix, str(Path.cwd()),
              str(Path(__file__).resolve().parent)}
    for place in places:
        if len(place) > 1:
            assert place not in text, place
    assert "/tmp/" not in text
