"""Reading the repository's Dockerfile: its instructions, and the image tag everything names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import netoptim

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"

IMAGE_TAG = f"{netoptim.DISTRIBUTION}:{netoptim.__version__}"
"""The tag the Dockerfile's image is built with, and the one the examples run: the distribution's
name and version."""


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``(KEYWORD, arguments)`` of each instruction, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].strip() + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        result.append((keyword.upper(), arguments.strip()))
        pending = ""
    if pending:
        raise ValueError(f"{path}: the last instruction ends with a continuation")
    return result


def exec_form(arguments: str) -> list[str]:
    """The JSON array of an exec-form instruction (ENTRYPOINT, CMD, HEALTHCHECK's CMD)."""
    value = json.loads(arguments)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"not an exec-form array of strings: {arguments}")
    return value


def stages(path: Path = DOCKERFILE) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, FROM first (ARGs before the first FROM are dropped)."""
    result: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions(path):
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, arguments))
    return result


def labels(stage: list[tuple[str, str]]) -> dict[str, str]:
    """The LABELs of ``stage`` (key="value" pairs)."""
    found: dict[str, str] = {}
    for keyword, arguments in stage:
        if keyword == "LABEL":
            found.update(re.findall(r'([\w.-]+)="([^"]*)"', arguments))
    return found
