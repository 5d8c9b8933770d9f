"""One TOML file per job for the flags of ``netoptim node`` (table ``[node]``) and of the training
recipes (table ``[worker]``): every key is a flag's long name (``checkpoint-every`` or
``checkpoint_every``), every value goes through the flag's own parser, and flags on the command line
override the file. Errors name the key and its line.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT = "default"
COMMAND_LINE = "command line"


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message names the file, the line and the key."""


@dataclass(slots=True)
class ConfigSources:
    """Where each flag's value came from: ``default``, ``FILE:LINE`` or ``command line``."""

    by_dest: dict[str, str] = field(default_factory=dict)

    def of(self, dest: str) -> str:
        return self.by_dest.get(dest, DEFAULT)


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each optional flag by its long name without dashes, in both spellings."""
    actions: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and action.dest not in ("help", "config", "print_config"):
                name = option[2:]
                actions[name] = action
                actions[name.replace("-", "_")] = action
    return actions


def _line_of(text: str, key: str, section: str) -> int:
    """The line ``key = ...`` is on in ``[section]`` (1-based; 0 when it cannot be found)."""
    header = re.search(rf"^[ \t]*\[[ \t]*{re.escape(section)}[ \t]*\]", text, re.MULTILINE)
    pattern = re.compile(rf"^[ \t]*[\"']?{re.escape(key)}[\"']?\s*=", re.MULTILINE)
    match = pattern.search(text, header.end() if header else 0)
    return text.count("\n", 0, match.start()) + 1 if match else 0


def _convert(action: argparse.Action, value: Any, where: str, key: str) -> Any:
    """``value`` as the flag's parser would give it; :class:`ConfigFileError` naming ``where`` and ``key``."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: {key} must be true or false, not {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(value, (dict, list)):
        raise ConfigFileError(f"{where}: {key} must be a single value, not {type(value).__name__}")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ConfigFileError(f"{where}: {key} = {value!r}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigFileError(f"{where}: {key} = {value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def load_section(path: str, section: str, parser: argparse.ArgumentParser) -> dict[str, tuple[Any, str]]:
    """The ``[section]`` table of the TOML file at ``path`` (or its top level when it has no tables) as
    ``{dest: (value, "FILE:LINE")}``; :class:`ConfigFileError` for an unreadable file, an unknown key or a
    bad value."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise ConfigFileError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None
    table = document.get(section, None)
    if table is None:
        tables = [key for key, value in document.items() if isinstance(value, dict)]
        if tables:
            raise ConfigFileError(f"{path} has no [{section}] table (it has {', '.join(f'[{t}]' for t in tables)})")
        table = document
    if not isinstance(table, dict):
        raise ConfigFileError(f"{path}: {section} must be a table ([{section}])")
    actions = _long_options(parser)
    values: dict[str, tuple[Any, str]] = {}
    for key, value in table.items():
        where = f"{path}:{_line_of(text, key, section)}"
        action = actions.get(key)
        if action is None:
            known = sorted({name for name in actions if "_" not in name})
            raise ConfigFileError(f"{where}: unknown key {key!r} in [{section}]; the keys are the flags of this command: {', '.join(known)}")
        values[action.dest] = (_convert(action, value, where, key), where)
    return values


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the flags written in ``argv`` (``--flag value`` or ``--flag=value``)."""
    by_option = {option: action.dest for action in parser._actions for option in action.option_strings}
    given = set()
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if name in by_option:
            given.add(by_option[name])
    return given


def config_path(argv: Sequence[str]) -> str | None:
    """The FILE of ``--config FILE`` (or ``--config=FILE``) in ``argv``, if any."""
    for index, token in enumerate(argv):
        if token == "--":
            break
        if token == "--config" and index + 1 < len(argv):
            return argv[index + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str], section: str) -> ConfigSources:
    """Before ``parser`` parses ``argv``: make the ``[section]`` values of ``--config FILE`` its defaults
    (so flags on the command line override them, and a required flag the file gives is no longer
    missing). Returns each value's source; :class:`ConfigFileError` for a bad file."""
    sources = ConfigSources()
    explicit = explicit_dests(parser, argv)
    path = config_path(argv)
    if path:
        values = load_section(path, section, parser)
        parser.set_defaults(**{dest: value for dest, (value, _where) in values.items()})
        for action in parser._actions:
            if action.dest in values:
                action.required = False
        for dest, (_value, where) in values.items():
            sources.by_dest[dest] = where
    for dest in explicit:
        sources.by_dest[dest] = COMMAND_LINE
    return sources


def describe(args: argparse.Namespace, parser: argparse.ArgumentParser, sources: ConfigSources, secret_dests: frozenset[str] = frozenset()) -> str:
    """Each flag's effective value and where it came from, one per line (secrets masked)."""
    lines = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config", "print_config"):
            continue
        value = getattr(args, action.dest, None)
        shown = "***" if action.dest in secret_dests and value else repr(value)
        lines.append(f"{action.option_strings[-1]:<28} = {shown:<40} # {sources.of(action.dest)}")
    return "\n".join(lines)
