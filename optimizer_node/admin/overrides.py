"""What an operator set for a node's job: hyperparameter overrides (``netoptim admin set-hparams``)
and the clipping threshold, each with who set it and when, kept in checkpoints; and the
hyperparameters each param group's last update used. One per job, composed by the daemon (daemon
thread only).

A new ``max_grad_norm`` set in the middle of a step waits for the next one: the buckets of a step
are clipped with one coefficient, from one threshold.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from optimizer_node.update.adamw import AdamWHyper, HyperOverrides

if TYPE_CHECKING:
    from protos.job.spec import JobSpec

log = logging.getLogger(__name__)

ADMIN = "netoptim admin set-hparams"


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class OperatorOverrides:
    """The job's overrides in force and where each came from."""

    def __init__(self) -> None:
        self.hyper = HyperOverrides()
        self.origins: dict[str, str] = {}  # override name -> who set it, when (admin status)
        self._clip: float | None = None  # the operator's max_grad_norm, in force
        self._clip_next: tuple[float | None] | None = None  # set mid-step, in force from the next step
        self._last_applied: dict[int, AdamWHyper] = {}  # param group -> hyperparameters of its last update

    def apply(self, hyper: AdamWHyper) -> AdamWHyper:
        """``hyper`` (a step's, as the workers sent it) with the overrides in force."""
        return self.hyper.apply(hyper)

    def applied(self, group: int, hyper: AdamWHyper) -> None:
        """Param group ``group`` was just updated with ``hyper``."""
        self._last_applied[group] = hyper

    def last_applied(self) -> dict[int, AdamWHyper]:
        return dict(self._last_applied)

    def set(self, overrides: HyperOverrides, origin: str = ADMIN) -> None:
        """Use ``overrides`` from the next update on; ``ValueError`` (nothing changed) if invalid. Each
        value that changes is recorded with ``origin`` and the time (see :meth:`listing`)."""
        overrides.validate()
        before = self.hyper.to_dict()
        said = f"{origin} at {_utc_now()}"
        origins = {name: self.origins.get(name, said) if before.get(name) == value else said for name, value in overrides.to_dict().items()}
        if "max_grad_norm" in self.origins:
            origins["max_grad_norm"] = self.origins["max_grad_norm"]
        self.hyper, self.origins = overrides, origins
        log.warning("hyperparameter overrides now %s (%s)", overrides, origin)

    def listing(self) -> list[dict]:
        """Every override in force (or waiting for the next step: max_grad_norm), with who set it and when."""
        values: dict[str, float] = dict(self.hyper.to_dict())
        if self.clip_override is not None:
            values["max_grad_norm"] = self.clip_override
        return [{"name": name, "value": value, "origin": self.origins.get(name, "")} for name, value in sorted(values.items())]

    @property
    def clip_override(self) -> float | None:
        """The operator's max_grad_norm (the one in force, or the one waiting for the next step)."""
        return self._clip_next[0] if self._clip_next is not None else self._clip

    def max_grad_norm(self, spec: JobSpec | None) -> float | None:
        """The clipping threshold in force: the operator's, else the job's (``spec``; None: no job)."""
        if self._clip is not None:
            return self._clip
        return spec.max_grad_norm if spec is not None else None

    @staticmethod
    def check_max_grad_norm(value: float | None, spec: JobSpec | None) -> None:
        """``ValueError`` if ``value`` (``None``: back to the job's) cannot be used for the job ``spec``."""
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"invalid max_grad_norm {value}: must be a positive number")
        if spec is None:
            raise ValueError("no job is registered yet: max_grad_norm can be set once rank 0 registered")
        clipping_now = (value if value is not None else spec.max_grad_norm) is not None
        if spec.num_nodes > 1 and clipping_now != (spec.max_grad_norm is not None):
            raise ValueError(
                f"the job was registered {'with' if spec.max_grad_norm else 'without'} clipping over {spec.num_nodes} nodes; switching it on or off on one node would leave the others out: restart the workers with another max_grad_norm"
            )

    def set_max_grad_norm(self, value: float | None, spec: JobSpec | None, *, between_steps: bool, origin: str = ADMIN) -> None:
        """Clip at ``value`` from the next step on (now, if ``between_steps``)."""
        self.check_max_grad_norm(value, spec)
        if value is None:
            self.origins.pop("max_grad_norm", None)
        elif value != self.clip_override:
            self.origins["max_grad_norm"] = f"{origin} at {_utc_now()}"
        if between_steps:
            self._clip = value
        else:
            self._clip_next = (value,)
        log.warning("max_grad_norm override now %s%s", value, "" if between_steps else " (from the next step)")

    def step_begins(self) -> None:
        """A step is over and the next begins: a threshold set during the last one is in force now."""
        if self._clip_next is not None:
            (self._clip,) = self._clip_next
            self._clip_next = None

    def to_manifest(self) -> dict[str, Any]:
        """What a checkpoint keeps of them."""
        return {"overrides": self.hyper.to_dict(), "max_grad_norm_override": self._clip, "override_origins": dict(self.origins)}

    def restore(self, manifest: dict[str, Any], checkpoint_name: str) -> list[str]:
        """Take the overrides a checkpoint kept (:meth:`to_manifest`); returns their names."""
        self.hyper = HyperOverrides(**manifest.get("overrides", {}))
        self._clip = manifest.get("max_grad_norm_override")
        origins = manifest.get("override_origins", {})
        named = [*self.hyper.to_dict(), *(["max_grad_norm"] if self._clip is not None else [])]
        self.origins = {name: f"{origins.get(name, 'an operator')}, restored from {checkpoint_name}" for name in named}
        return named
