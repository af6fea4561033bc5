"""One name per concept: renamed options keep their old spellings, which warn once; errors and
--help name the option by its name."""

import pytest

from partitioner_cli._args import canonical_names
from partitioner_cli.main import build_parser, main

PLAN = ["plan", "examples/profiles/vgg16_v100.json", "--cluster", "examples/clusters/v100x8.yaml"]
COMPARE = ["compare", "examples/profiles/vgg16_v100.json", "--cluster", "examples/clusters/v100x8.yaml"]
PROFILE = ["profile", "gpt2-tiny", "--analytic", "-o", "p.json"]

# (command line without the option, the option's name, its old spelling, a value, the parsed attribute, parsed value)
RENAMED = [
    (PLAN, "--micro-batches", "--microbatches", "4", "micro_batches", "4"),
    (COMPARE, "--micro-batches", "--microbatches", "4", "micro_batches", 4),
    (PROFILE, "--micro-batch-size", "--batch-size", "3", "batch_size", 3),
]


@pytest.mark.parametrize(("argv", "name", "old", "value", "attr", "parsed"), RENAMED)
def test_old_spelling_works_and_warns_once(capsys, argv, name, old, value, attr, parsed):
    args = build_parser().parse_args([*argv, old, "7", old, value])
    assert getattr(args, attr) == parsed
    err = capsys.readouterr().err
    assert err.splitlines() == [f"partitioner: warning: {old} is deprecated; use {name}"]


@pytest.mark.parametrize(("argv", "name", "old", "value", "attr", "parsed"), RENAMED)
def test_name_does_not_warn(capsys, argv, name, old, value, attr, parsed):
    args = build_parser().parse_args([*argv, name, value])
    assert getattr(args, attr) == parsed
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("spelling", ["--micro-batches", "--microbatches"])
def test_plan_error_names_the_option_by_its_name(capsys, spelling):
    assert main([*PLAN, spelling, "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("partitioner plan: error: --micro-batches = 0: must be an integer in [1, ")
    assert "--microbatches" not in err[-1]


@pytest.mark.parametrize("spelling", ["--micro-batch-size", "--batch-size"])
def test_argparse_error_names_the_option_by_its_name(capsys, spelling):
    assert main(["profile", "gpt2-tiny", "--analytic", spelling, "0", "-o", "p.json"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("partitioner: error: argument --micro-batch-size: 0 is out of range")


def test_missing_required_option_is_named_once(capsys):
    assert main(["profile", "gpt2-tiny", "--analytic", "-o", "p.json"]) == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: --micro-batch-size (" in err and "--batch-size" not in err


def test_help_shows_the_name_and_mentions_the_old_spelling(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--micro-batches auto|N micro-batches per iteration" in out
    assert "(old spelling --microbatches: deprecated)" in out
    assert "[--micro-batches auto|N]" in out and "--microbatches auto|N" not in out


def test_canonical_names_keeps_other_options_whole():
    build_parser()
    assert canonical_names("use a smaller --batch-size") == "use a smaller --micro-batch-size"
    assert canonical_names("--micro-batch-size and --global-batch-size") == "--micro-batch-size and --global-batch-size"
    assert canonical_names("--policy/--microbatches auto") == "--policy/--micro-batches auto"
    assert canonical_names("argument --micro-batches/--microbatches: bad") == "argument --micro-batches: bad"
