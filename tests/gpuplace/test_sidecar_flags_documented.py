"""The flags tables stay true to the settings: docs/extender.md lists every setting of the
sidecar and docs/node-agent.md every setting of the node agent, and neither lists a flag
that is gone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from gpuplace.wiring.agent_settings import AgentSettings
from gpuplace.wiring.settings import SidecarSettings

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize(
    ("settings", "doc"), [(SidecarSettings, "extender.md"), (AgentSettings, "node-agent.md")]
)
def test_the_flags_table_lists_every_setting(settings: type[BaseSettings], doc: str) -> None:
    listed = set(re.findall(r"^\| `--([a-z0-9-]+)`", (DOCS / doc).read_text(), re.MULTILINE))
    names = {name.replace("_", "-") for name in settings.model_fields}
    assert sorted(names - listed) == [], f"settings missing from docs/{doc}"
    assert sorted(listed - names) == [], f"docs/{doc} lists flags that do not exist"
