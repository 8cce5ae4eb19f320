"""The earlier home of the per-level advice (``memory_every``, ``drive_every``), which now lives in
:mod:`gds_persist.advice.levels`; this module only re-exports its public names, so that the path
documented before (``gds_persist.training.levels.advise_levels``) keeps working."""

from ..advice.levels import (
    CLASSES,
    Failures,
    LevelAdvice,
    LevelPlan,
    Tier,
    advise_levels,
    describe_levels,
)

__all__ = ["CLASSES", "Failures", "LevelAdvice", "LevelPlan", "Tier", "advise_levels",
           "describe_levels"]
