"""The earlier home of the drive's wear budget, which now lives in :mod:`gds_persist.advice.wear`;
this module only re-exports its public names, so that the path documented before
(``gds_persist.training.wear.endurance``) keeps working."""

from ..advice.wear import (
    DAY_S,
    YEAR_DAYS,
    Endurance,
    Wear,
    describe_wear,
    endurance,
    wear,
    wear_interval,
    writes_per_day,
)

__all__ = ["DAY_S", "YEAR_DAYS", "Endurance", "Wear", "describe_wear", "endurance", "wear",
           "wear_interval", "writes_per_day"]
