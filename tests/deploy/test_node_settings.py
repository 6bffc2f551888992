"""deploy/node/: the host settings a gpuplace node needs, parsed as the NVIDIA container
toolkit parses them (TOML), so a typo or a dropped setting fails here, not on a node."""

from __future__ import annotations

import tomllib

from tests.deploy import rendering

TOOLKIT = rendering.DEPLOY / "node" / "nvidia-container-toolkit.toml"


def test_the_runtime_ignores_a_containers_own_visible_devices() -> None:
    settings = tomllib.loads(TOOLKIT.read_text())
    assert settings == {
        # A CUDA image's NVIDIA_VISIBLE_DEVICES=all reaches no GPU in an unprivileged pod.
        "accept-nvidia-visible-devices-envvar-when-unprivileged": False,
        # The device plugin's volume mounts (or CDI names) are the only way in.
        "accept-nvidia-visible-devices-as-volume-mounts": True,
    }


def test_the_settings_are_top_level_where_the_toolkit_reads_them() -> None:
    lines = [line for line in TOOLKIT.read_text().splitlines() if line.strip()]
    assert not any(line.lstrip().startswith("[") for line in lines)  # no section header
