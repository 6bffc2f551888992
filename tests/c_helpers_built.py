"""The extender's C helpers in tests: whether this run requires them built, the check
that they are, the helpers themselves whatever the switch says (`built`), and the
helpers put in and taken out of use for a test (`in_use`).

The helpers are optional (`setup.py`): a machine without a C compiler installs without
them and the Python paths answer the same, so there their absence is no failure. Where
the build is required, `GPUPLACE_REQUIRE_EXTENSIONS=1` says so (CI's main run, `.ci/run`,
sets it; so does whoever checks an image): their absence is then a failure, not a quiet
slowdown. Built is not the same as in use: `GPUPLACE_NO_EXTENSIONS=1` leaves them built
and unused, so these tests import them themselves.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from gpuplace.extender import c_helpers

if TYPE_CHECKING:
    from gpuplace.extender._node_names import NameSet

REQUIRE = "GPUPLACE_REQUIRE_EXTENSIONS"
HELPERS = ("gpuplace.extender._node_names", "gpuplace.extender._priorities")


def required() -> bool:
    """Whether this run requires the C helpers built."""
    return bool(os.environ.get(REQUIRE))


def skip_unless_required() -> None:
    if not required():
        pytest.skip(
            f"{REQUIRE} is not set: the C helpers are optional here (an install without a C "
            "compiler has none); CI's main run and the image check require them"
        )


NOTICE = "(C) is not in use"
"""What the sidecar's start-up WARNING says of a C helper it runs without
(`gpuplace.wiring.sidecar`): a notice for operators, expected where the helpers are optional and
not built (or switched off)."""


def is_expected_notice(message: str) -> bool:
    """Whether a log line is the sidecar's notice of a C helper not in use, where that is
    expected: the helpers optional here, or switched off (`c_helpers.SWITCH`); where they
    are required and on, it is a failure to see."""
    return NOTICE in message and (not required() or bool(os.environ.get(c_helpers.SWITCH)))


def check_built(module: str) -> None:
    """Fail unless `module` (one of `HELPERS`) imports; skip where the build is optional."""
    skip_unless_required()
    try:
        importlib.import_module(module)
    except ImportError as error:
        pytest.fail(f"{module} was not built ({error}): install gcc and python3-dev")


@dataclass(frozen=True, slots=True)
class Built:
    name_set: type[NameSet]
    ranked_json: Callable[[list[str], list[Any], int], bytes | None]


def _import() -> Built | None:
    try:
        from gpuplace.extender._node_names import NameSet
        from gpuplace.extender._priorities import ranked_json
    except ImportError:  # built without a C compiler
        return None
    return Built(NameSet, ranked_json)


BUILT = _import()
"""Both helpers, imported here whatever `GPUPLACE_NO_EXTENSIONS` says; None: not built."""


def built() -> Built:
    """Both helpers; the test is skipped where they are not built."""
    if BUILT is None:
        pytest.skip("the C helpers are not built (no C compiler): nothing to compare with")
    return BUILT


@contextlib.contextmanager
def in_use(name_set: type[Any] | None, ranked_json: Callable[..., Any] | None) -> Iterator[None]:
    """`c_helpers.NAME_SET` and `c_helpers.RANKED_JSON` set to these for the block (None:
    the Python path), whatever `GPUPLACE_NO_EXTENSIONS` said at import."""
    saved = c_helpers.NAME_SET, c_helpers.RANKED_JSON
    c_helpers.NAME_SET, c_helpers.RANKED_JSON = name_set, ranked_json
    try:
        yield
    finally:
        c_helpers.NAME_SET, c_helpers.RANKED_JSON = saved
