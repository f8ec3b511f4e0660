"""The ``asyncinfer`` subcommands' parsers: every option's help shows its default."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["SubcommandParser", "positive_int"]


class _DefaultsShown(argparse.HelpFormatter):
    """Adds ``(default: X)`` to an option's help unless it names its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" not in text and action.default not in (None, False, argparse.SUPPRESS)
                and action.option_strings):
            text += f" (default: {action.default})"
        return text


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: every option's help shows its default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(*args, **kwargs)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
