"""real_model's answers say why: a negative size is out of range (not a typing error), a GPU not on the
card points to the flags that answer it anyway."""
import pytest

from lab_helpers.core.errors import LabError
from lab_helpers.real.commands import main
from lab_helpers.real.fit import gpu_budget_entry


def run_main(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


@pytest.mark.parametrize("flag,value,said", [
    ("--context", "-5", "argument --context: must be > 0, got -5"),
    ("--batch", "-1", "argument --batch: must be > 0, got -1"),
    ("--new-tokens", "-64", "argument --new-tokens: must be > 0, got -64"),
    ("--tensor-parallel", "-2", "argument --tensor-parallel: must be > 0, got -2"),
    ("--memory-bytes", "-8", "argument --memory-bytes: must be > 0, got -8"),
    ("--context", "-0", "argument --context: not an integer: '-0'"),  # no sign is accepted, and -0 is 0
    ("--context", "-", "argument --context: not an integer: '-'"),
])
def test_a_negative_size_is_out_of_range(capsys, flag, value, said):
    argv = {"--config": "qwen1.5-0.5b", "--batch": "1", "--context": "8", "--new-tokens": "1",
            "--memory-bytes": "1000000000", flag: value}
    code, out, err = run_main(capsys, "fit", *[x for kv in argv.items() for x in kv])
    assert code == 2 and out == "" and len(err) == 1
    assert said in err[0], err[0]


def test_an_unknown_gpu_names_the_choices_then_the_other_ways():
    with pytest.raises(LabError) as caught:
        gpu_budget_entry("h9000")
    text = str(caught.value)
    assert text.startswith("unknown --gpu 'h9000'; valid choices: a10, a100-pcie-40gb, ")
    assert text.endswith("; or give the budget with --memory-bytes N, or a rate card that has it with "
                         "fit --card --tariffs PATH")
