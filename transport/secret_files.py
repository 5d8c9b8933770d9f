"""Files that hold secrets (CURVE secret keys, admin tokens): refused when others may read them."""

from __future__ import annotations

import os
import stat


def check_private(path: str, what: str) -> None:
    """``ValueError`` when ``path`` can be read or written by its group or by others: a secret the
    whole host can read is no secret. ``FileNotFoundError`` passes through."""
    mode = os.stat(path).st_mode
    if stat.S_IMODE(mode) & 0o077:
        raise ValueError(f"{what} {path} is accessible to other users (mode {stat.S_IMODE(mode):o}): run chmod 600 {path}")


def read_token_file(path: str) -> str:
    """The token in ``path`` (one line, surrounding whitespace dropped); ``ValueError`` for a file that
    others can read, an empty one or one that cannot be read."""
    try:
        check_private(path, "the token file")
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    if not token or "\n" in token:
        raise ValueError(f"the token file {path} must hold one line: the token")
    return token
