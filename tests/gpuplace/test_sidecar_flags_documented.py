"""docs/extender.md's flags table stays true to the sidecar's settings: every setting
is listed, and nothing listed is gone."""

from __future__ import annotations

import re
from pathlib import Path

from gpuplace.sidecar import SidecarSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "extender.md"


def test_the_flags_table_lists_every_sidecar_setting() -> None:
    listed = set(re.findall(r"^\| `--([a-z0-9-]+)`", DOC.read_text(), re.MULTILINE))
    settings = {name.replace("_", "-") for name in SidecarSettings.model_fields}
    assert sorted(settings - listed) == [], "settings missing from docs/extender.md"
    assert sorted(listed - settings) == [], "docs/extender.md lists flags that do not exist"
