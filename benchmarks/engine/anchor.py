"""The llama.cpp anchor: whether its standalone decode speed held still over the invocation
(`AnchorCheck`), and the bounds against it that hold whatever the drift."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .catalogue import ANCHOR
from .runs import Run


def _per_system(runs: list[Run], value: Callable[[Run], float]) -> dict[str, list[float]]:
    """``value`` of each run, by system, the anchor's runs left out."""
    by_system: dict[str, list[float]] = {}
    for run in runs:
        if run.system != ANCHOR:
            by_system.setdefault(run.system, []).append(value(run))
    return by_system


@dataclass(frozen=True)
class AnchorCheck:
    """Whether llama.cpp's standalone decode speed held still over the invocation: its runs'
    speeds (tok/s, in run order) may differ by at most ``tolerance`` of the fastest."""

    speeds: tuple[float, ...]
    tolerance: float

    @property
    def spread(self) -> float:
        """(fastest - slowest) / fastest."""
        top = max(self.speeds)
        return (top - min(self.speeds)) / top if top > 0 else 1.0

    @property
    def ok(self) -> bool:
        return len(self.speeds) >= 2 and self.spread <= self.tolerance

    def describe(self) -> str:
        speeds = ", ".join(f"{v:.1f}" for v in self.speeds)
        if len(self.speeds) < 2:
            return f"llama.cpp ran once ({speeds} tok/s): no steadiness check, no ratio against it"
        verdict = ("steady" if self.ok else
                   "UNSTEADY: the machine's load changed during the run; ratios against it withheld")
        return (f"llama.cpp anchor runs {speeds} decode tok/s, spread {self.spread:.1%} "
                f"(tolerance {self.tolerance:.0%}): {verdict}")

    def bounds(self, runs: list[Run]) -> dict[str, tuple[float, float]]:
        """Per system, its decode speed against llama.cpp's whatever the drift: ``(slowest run
        / fastest anchor run, fastest run / slowest anchor run)``. Every run of the system was
        at least the low bound times every anchor run, however the load moved."""
        top, bottom = max(self.speeds), min(self.speeds)
        return {system: (min(v) / top, max(v) / bottom)
                for system, v in _per_system(runs, lambda r: r.decode_tok_s).items()
                if top > 0 and bottom > 0}

    @staticmethod
    def prefill_bounds(runs: list[Run]) -> dict[str, tuple[float, float]]:
        """Per system, how much faster its prefill was than llama.cpp's, run against run:
        ``(fastest anchor run / slowest run, slowest anchor run / fastest run)`` of the mean
        prefill seconds."""
        anchor = [run.prefill_s for run in runs if run.system == ANCHOR]
        return {system: (min(anchor) / max(v), max(anchor) / min(v))
                for system, v in _per_system(runs, lambda r: r.prefill_s).items()
                if anchor and min(v) > 0}

    @classmethod
    def of(cls, runs: list[Run], tolerance: float) -> "AnchorCheck | None":
        """The check over the anchor's runs (None when the anchor did not run)."""
        speeds = tuple(run.decode_tok_s for run in runs if run.system == ANCHOR)
        return cls(speeds, tolerance) if speeds else None
