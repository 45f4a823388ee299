"""The README's configuration reference names every setting a user can set through the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SECTIONS = ("## Architecture", "## Configuration reference", "## Deployment (docker compose)",
            "## Local stack without Docker", "## Operations", "## Scale-out")


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _settings_classes():
    from prunewatch.alerts.settings import AlertingSettings, RuleSettings
    from prunewatch.collector.fleet import FleetSettings
    from prunewatch.engine.settings import EngineSettings
    from prunewatch.roi.settings import RoiAppSettings
    from prunewatch.server.settings import ServerSettings
    from prunewatch.stack.settings import StackSettings

    return [EngineSettings, ServerSettings, FleetSettings, RuleSettings, AlertingSettings, RoiAppSettings,
            StackSettings]


def test_deployment_sections_come_last_in_order():
    text = README.read_text()
    positions = [text.index(f"\n{title}\n") for title in SECTIONS]
    assert positions == sorted(positions)
    assert "\n## " not in text[positions[-1] + 1:].split("\n", 1)[1]  # Scale-out is the last section


@pytest.mark.parametrize("cls", _settings_classes(), ids=lambda c: c.__name__)
def test_configuration_reference_names_every_variable(cls):
    section = _section("## Configuration reference")
    prefix = cls.model_config["env_prefix"]
    missing = []
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        full = alias if isinstance(alias, str) else (prefix + name).upper()
        short = name.upper()
        # Full name, or (for the paragraphs that state the prefix once) the bare suffix in backticks.
        if f"`{full}`" not in section and not (f"`{prefix}*`" in section and re.search(rf"`{short}`", section)):
            missing.append(full)
    assert missing == []
