"""Settings of the ROI app: where the store is (PRUNEWATCH_DB_URL) and whether a password guards it (PRUNEWATCH_ROI_*)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from prunewatch.records.settings import DEFAULT_STORE_URL, STORE_URL_ENV

ENV_PREFIX = "PRUNEWATCH_ROI_"
PASSWORD_ENV = f"{ENV_PREFIX}PASSWORD"
DEFAULT_DAYS_ENV = f"{ENV_PREFIX}DEFAULT_DAYS"
WINDOW_CHOICES_DAYS = (1, 7, 30, 60, 90, 180, 365)


class RoiAppSettings(BaseSettings):
    """The app reads cost data, so it can be locked with a password taken from the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True)

    db_url: str = Field(DEFAULT_STORE_URL, validation_alias=STORE_URL_ENV, min_length=1,
                        description="SQLAlchemy URL of the result store.")
    password: SecretStr | None = Field(None, description="When set, the app asks for it before showing any number.")
    default_days: int = Field(30, ge=1, le=365, description="Window selected when the app opens, in days.")
