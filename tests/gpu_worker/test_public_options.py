"""The public constructors list their options one by one, with the names and defaults of
:class:`gpu_worker.remote_optimizer.RemoteOptions`, and document each in their Args section."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from gpu_worker import RemoteAdam, RemoteAdamW, RemoteLion, RemoteSGD, offload
from gpu_worker.hierarchical import HostGroupAdamW
from gpu_worker.remote_optimizer import RemoteOptions
from netoptim.integrations.remote import REMOTE_OPTIONS, to_remote

OPTION_DEFAULTS = {field.name: field.default for field in dataclasses.fields(RemoteOptions)}

# Each public entry point, and the options it sets itself instead of taking them.
ENTRY_POINTS = [
    (RemoteAdamW.__init__, RemoteAdamW.__doc__, set()),
    (RemoteAdam.__init__, RemoteAdam.__doc__, set()),
    (RemoteSGD.__init__, RemoteSGD.__doc__, set()),
    (RemoteLion.__init__, RemoteLion.__doc__, set()),
    (offload, offload.__doc__, {"units", "push_during_backward", "module"}),
    (HostGroupAdamW.__init__, HostGroupAdamW.__doc__, {"rank", "world_size", "local_size", "push_during_backward"}),
]


def _documented(doc: str) -> set[str]:
    """The names an Args section documents (``a, b: ...`` documents both)."""
    args = doc.split("Args:", 1)[1]
    names: set[str] = set()
    for line in args.splitlines():
        match = re.match(r"^ {8}([a-z_][a-z0-9_, ]*):", line)
        if match:
            names.update(name.strip() for name in match.group(1).split(","))
    return names


@pytest.mark.parametrize(("function", "doc", "own"), ENTRY_POINTS, ids=lambda v: getattr(v, "__qualname__", "")[:40] if callable(v) else "")
def test_every_option_is_an_explicit_documented_keyword_with_the_shared_default(function, doc, own):
    parameters = inspect.signature(function).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()), "options are explicit, not **kwargs"
    for name, default in OPTION_DEFAULTS.items():
        if name in own:
            continue
        assert name in parameters, f"{function.__qualname__} lacks {name}"
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameters[name].default == default, name
    documented = _documented(doc)
    missing = [name for name in parameters if name != "self" and name not in documented]
    assert not missing, f"{function.__qualname__} does not document {missing}"


def test_to_remote_forwards_exactly_the_remote_options():
    assert set(REMOTE_OPTIONS) == set(OPTION_DEFAULTS)
    with pytest.raises(TypeError, match="not lr"):
        to_remote(None, {}, lr=0.1)  # type: ignore[arg-type]
