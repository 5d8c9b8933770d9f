"""What ``netoptim doctor`` found: one :class:`Finding` per check, and their rendering as text or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

Level = Literal["ok", "note", "warn", "fail"]
LEVELS: tuple[Level, ...] = ("ok", "note", "warn", "fail")
"""From fine to broken: ``note`` is worth knowing, ``warn`` costs speed or safety, ``fail`` stops a run."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One check's verdict: where (``area``: ``host``, ``state dir DIR``, ``node ADDRESS``, ...),
    what was checked, what was found, and for ``warn`` and ``fail`` what to do about it."""

    area: str
    check: str
    level: Level
    detail: str
    fix: str = ""
    figures: dict[str, float | int | str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, not {self.level!r}")
        if self.level in ("warn", "fail") and not self.fix:
            raise ValueError(f"a {self.level} finding says what to do about it ({self.area}: {self.check})")


def failed(findings: Sequence[Finding]) -> bool:
    """Whether any check found something that stops a run."""
    return any(finding.level == "fail" for finding in findings)


def as_json(findings: Sequence[Finding]) -> str:
    """The findings and a count per level, as one JSON object."""
    counts = {level: sum(finding.level == level for finding in findings) for level in LEVELS}
    return json.dumps({"ok": not failed(findings), "counts": counts, "findings": [asdict(finding) for finding in findings]}, indent=2)


def as_text(findings: Sequence[Finding]) -> str:
    """The findings grouped by area, one line each (a ``fix:`` line under what needs one), and a summary."""
    width = max((len(finding.check) for finding in findings), default=0)
    lines: list[str] = []
    area = None
    for finding in findings:
        if finding.area != area:
            area = finding.area
            lines.append(("\n" if lines else "") + area)
        lines.append(f"  {finding.level.upper():4}  {finding.check:{width}}  {finding.detail}")
        if finding.fix:
            lines.append(f"        {'':{width}}  fix: {finding.fix}")
    warned = sum(finding.level == "warn" for finding in findings)
    broken = sum(finding.level == "fail" for finding in findings)
    verdict = "nothing stops a run here" if not broken else f"{broken} problem(s) stop a run"
    lines.append(f"\n{len(findings)} checks: {verdict}" + (f"; {warned} warning(s)" if warned else ""))
    return "\n".join(lines)
