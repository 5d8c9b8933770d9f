"""Checking the command lines an example uses against the real parsers: ``netoptim``'s, torchrun's
and the training recipe's. A flag that does not exist, or a value its flag refuses, fails the test
with argparse's own message."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Sequence

from netoptim.console import build_parser as netoptim_parser
from netoptim.recipes.train_gpt import build_parser as recipe_parser

RECIPES = {"netoptim.recipes.train_gpt": recipe_parser}
"""The training recipes the examples run, by the module they give ``torchrun -m``: the packaged
recipes, which the container image and any installation of netoptim-train have (a path into a
checkout would not be there)."""


def parse(parser: argparse.ArgumentParser, argv: Sequence[str], what: str) -> argparse.Namespace:
    """``parser.parse_args(argv)``, or an ``AssertionError`` with argparse's message."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(list(argv))
    except SystemExit:
        raise AssertionError(f"{what}: {' '.join(argv)}\n{errors.getvalue()}") from None


def check_netoptim(argv: Sequence[str]) -> argparse.Namespace:
    """``netoptim ARGV...`` (without the program name) parsed by the real ``netoptim`` parser."""
    return parse(netoptim_parser(), argv, "netoptim")


def check_torchrun(argv: Sequence[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """``torchrun ARGV...`` parsed by torch's own parser, and the training script's arguments by
    the recipe's parser; returns both namespaces."""
    from torch.distributed.run import get_args_parser

    launcher = parse(get_args_parser(), argv, "torchrun")
    assert launcher.module, f"torchrun runs the file {launcher.training_script}: the examples run the packaged recipes, torchrun -m MODULE"
    assert launcher.training_script in RECIPES, f"torchrun runs {launcher.training_script}, not one of {sorted(RECIPES)}"
    parser = RECIPES[launcher.training_script]()
    parser.add_argument("--config")  # added by parse_recipe_args
    return launcher, parse(parser, launcher.training_script_args, launcher.training_script)
