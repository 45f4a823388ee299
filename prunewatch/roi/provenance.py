"""Where each number comes from: every input and derived figure carries one of these labels."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict


class Provenance(str, Enum):
    """How a figure was obtained; shown next to the figure everywhere (app, CSV, PDF, HTML)."""

    MEASURED = "measured"  # read from probe results in the store (or a benchmark results file it names)
    MEASURED_UNDER_LOAD = "measured-under-load"  # from a load run's aggregate tokens/s at the deployment's concurrency
    ESTIMATED = "estimated"  # derived from measured figures through a stated model with assumptions
    ASSUMED_DEFAULT = "assumed-default"  # the product's default assumption, nobody changed it
    USER_ENTERED = "user-entered"  # typed in by the user (sidebar, --assumptions file)


class InputValue(BaseModel):
    """One input of the cost model, with its unit and the reason it has this value."""

    model_config = ConfigDict(frozen=True)

    key: str
    label: str
    value: float
    unit: str
    provenance: Provenance
    note: str = ""

    def with_value(self, value: float) -> InputValue:
        """A copy with another value (used by the sensitivity analysis); provenance is kept."""
        return self.model_copy(update={"value": value})
