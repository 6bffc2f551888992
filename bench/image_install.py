"""How long an install from the image takes (issue 44), on real Kubernetes v1.36.2 with the
kit's kubelet node (`../shared/k8s`): gpuplace's image built from the shipped Dockerfile
(`deploy/image/build.py`), the images imported into the node's containerd, then
docs/deploy.md steps 3-5 as the real-cluster tier plays them (`tests/realcluster/pods.py`):
apply, the certificate Job, the Deployment's rollout, the node agent's DaemonSet serving
the kubelet. Prints one JSON document: the build's size and seconds per step (a warm
cache: the base image, wheels and apt packages kept from an earlier build, under
~/.cache/gpuplace-image) and the install's seconds per step.

Needs root, buildah, runc and mmdebstrap, and the machine's one kubelet:

    flock /tmp/gpuplace-kubelet.lock .venv/bin/python -m bench.image_install

`measure` is what the tier's smoke test reads from its own installation.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.realcluster import image, kit, pods
from tests.realcluster.image import Built
from tests.realcluster.pods import InPods


def measure(found: InPods) -> dict[str, Any]:
    """The figures of one build and install."""
    report = found.built.report
    return {
        "image": {
            "tag": found.built.tag,
            "size_mib": report["size_mib"],
            "base_size_mib": round(report["base"]["size_bytes"] / 2**20, 1),
            "archive_mib": round(report["archive"]["bytes"] / 2**20, 1),
            "debian_packages": len(report["packages"]["debian"]),
            "python_distributions": len(report["packages"]["gpuplace_venv"]),
            "seconds": report["seconds"],
            "base_made": report["base"]["made"],
        },
        "install_seconds": dict(found.seconds),
    }


def main(argv: list[str] | None = None) -> int:
    del argv
    if not kit.KIT.is_dir() or (problem := kit.kit_missing()) is not None:
        print(f"image_install: no usable kit at {kit.KIT}", file=sys.stderr)
        return 2
    if (problem := image.build_problem()) is not None:
        print(f"image_install: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpuplace-bench-install-") as scratch_dir:
        scratch = Path(scratch_dir)
        built: Built = image.build(scratch)
        cluster = kit.Cluster.up(scratch / "state")
        try:
            if cluster.node_problem is not None:
                print(f"image_install: no kubelet node: {cluster.node_problem}", file=sys.stderr)
                return 2
            with pods.installed(cluster, scratch / "pods", built) as found:
                print(json.dumps(measure(found), indent=1))
        finally:
            cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
