"""How the gang and queue controllers' Events word a duration (`gpuplace.controllers.telling`)."""

from __future__ import annotations

import pytest

from gpuplace.controllers.telling import duration


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0.241316, "0.2s"),  # a measured wait, as the queue controller's Events said it
        (-1.0, "0s"),
        (9.96, "10s"),
        (45.7, "46s"),
        (90, "1.5m"),
        (300, "5m"),
        (137.2, "2.3m"),
        (5400, "1.5h"),
    ],
)
def test_a_duration_is_said_to_a_tenth_of_its_unit(seconds: float, said: str) -> None:
    assert duration(seconds) == said
