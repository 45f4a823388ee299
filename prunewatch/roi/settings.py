"""Settings of the ROI app: where the store is (PRUNEWATCH_DB_URL), whether a password guards it and which load run
prices time per request (PRUNEWATCH_ROI_*)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prunewatch.records.settings import DEFAULT_STORE_URL, STORE_URL_ENV

ENV_PREFIX = "PRUNEWATCH_ROI_"
PASSWORD_ENV = f"{ENV_PREFIX}PASSWORD"
DEFAULT_DAYS_ENV = f"{ENV_PREFIX}DEFAULT_DAYS"
LOAD_RESULTS_ENV = f"{ENV_PREFIX}LOAD_RESULTS"
CONCURRENCY_ENV = f"{ENV_PREFIX}CONCURRENCY"
WINDOW_CHOICES_DAYS = (1, 7, 30, 60, 90, 180, 365)


class RoiAppSettings(BaseSettings):
    """The app reads cost data, so it can be locked with a password taken from the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True)

    db_url: str = Field(DEFAULT_STORE_URL, validation_alias=STORE_URL_ENV, min_length=1,
                        description="SQLAlchemy URL of the result store.")
    password: SecretStr | None = Field(None, description="When set, the app asks for it before showing any number.")
    default_days: int = Field(30, ge=1, le=365, description="Window selected when the app opens, in days.")
    load_results: Path | None = Field(
        None, description="Results JSON of `prunewatch bench load`: when set, time per request is priced from its "
                          "measured aggregate tokens/s at the selected concurrency (batched serving), not from "
                          "the probes' one-at-a-time times.")
    concurrency: int | None = Field(
        None, ge=1, description="Concurrent clients the app starts at (a level the load run measured); default: "
                                "the run's highest level, labelled assumed-default.")

    @model_validator(mode="after")
    def _concurrency_needs_load_results(self) -> RoiAppSettings:
        if self.concurrency is not None and self.load_results is None:
            raise ValueError(f"{CONCURRENCY_ENV} needs {LOAD_RESULTS_ENV} (a `prunewatch bench load` result)")
        return self
