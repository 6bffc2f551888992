"""deploy/image/build.py's own logic, without root or buildah: which Debian sources the local
base is made from, how an image's packages are read, what counts as a compiler. The build
itself runs on the real-cluster tier (tests/realcluster/test_image_install.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy import rendering

SCRIPT = rendering.ROOT / "deploy" / "image" / "build.py"

MACHINE = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://elsewhere.example/debian
Suites: bookworm
Components: main
"""


@pytest.fixture(scope="module")
def build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_build", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_base_comes_from_the_mirror_apt_uses(build: ModuleType, tmp_path: Path) -> None:
    machine = tmp_path / "debian.sources"
    machine.write_text(MACHINE)
    stanzas = build.deb822(build.sources(None, machine))
    assert stanzas == [
        {
            "types": "deb",
            "uris": "http://mirror.example/debian",
            "suites": "bookworm bookworm-updates",
            "components": "main",
            "signed-by": "/usr/share/keyrings/debian-archive-keyring.gpg",
        },
        {
            "types": "deb",
            "uris": "http://mirror.example/debian-security",
            "suites": "bookworm-security",
            "components": "main",
            "signed-by": "/usr/share/keyrings/debian-archive-keyring.gpg",
        },
    ]
    # --mirror wins; without a machine file, Debian's own mirrors
    given = build.deb822(build.sources("http://given.example/debian", machine))
    assert given[0]["uris"] == "http://given.example/debian"
    assert build.deb822(build.sources(None, tmp_path / "absent"))[0]["uris"] == (
        "http://deb.debian.org/debian"
    )
    # the cache key follows the sources and the recipe
    assert build.base_key(build.sources(None, machine)) != build.base_key(
        build.sources("http://given.example/debian", machine)
    )


def test_compilers_are_told_from_other_tools(build: ModuleType) -> None:
    for name in ("gcc", "gcc-12", "x86_64-linux-gnu-gcc-12", "cc", "c++", "ld", "ld.bfd", "as"):
        assert build.COMPILERS.match(name), name
    for name in ("python3.11", "gpuplace", "tzselect", "ldconfig", "cat", "pip", "assert"):
        assert not build.COMPILERS.match(name), name


def test_packages_are_read_from_the_image_files(build: ModuleType, tmp_path: Path) -> None:
    status = tmp_path / "var" / "lib" / "dpkg" / "status"
    status.parent.mkdir(parents=True)
    status.write_text(
        "Package: python3.11\nStatus: install ok installed\nVersion: 3.11.2-6+deb12u9\n"
        "Description: an interpreter\n continued\n\n"
        "Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n"
    )
    assert build.dpkg_packages(tmp_path) == {"python3.11": "3.11.2-6+deb12u9"}
    site = tmp_path / "site-packages"
    (site / "Kubernetes_Asyncio-36.1.0.dist-info").mkdir(parents=True)
    (site / "Kubernetes_Asyncio-36.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kubernetes_asyncio\nVersion: 36.1.0\n\nName: not-this\n"
    )
    assert build.distributions(site) == {"kubernetes-asyncio": "36.1.0"}
