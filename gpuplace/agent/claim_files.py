"""The DRA kubelet plugin's files: the checkpoint of prepared claims and their CDI specs.

- `<plugin dir>/checkpoint.json`: every claim prepared and not yet unprepared, with the
  answer given for it and its CDI spec (version 1, written whole: a temporary file,
  fsync, rename), so that an agent restarted answers the kubelet's retries as before,
  unprepares what it prepared before, and writes back a spec that is gone (`/var/run` is
  a tmpfs: after a reboot the kubelet's own checkpoint still says "prepared", and the
  runtime reads the spec at each container start);
- `<CDI dir>/gpu.gpuplace.io-claim_<claim UID>.json`: one CDI spec per prepared claim,
  written the same way (a runtime never reads half a spec).

`load` tolerates a checkpoint that does not parse: it is moved aside
(`checkpoint.json.unreadable`), logged, and the agent starts with none; `orphans` then
names no spec for removal (a spec of a claim the kubelet still holds must not go), and
unprepare removes a claim's spec by its UID whether it is recorded or not. Blocking file
I/O: call it from a worker thread. O(prepared claims) per write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuplace.agent import preparing

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.json"
VERSION = 1


class _Device(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request: str
    pool: str
    device: str
    share_id: str | None
    cdi_ids: list[str]
    uuid: str
    milli: int
    memory_mib: int


class _Claim(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str
    name: str
    uid: str
    devices: list[_Device]
    spec: dict[str, Any]


class _Checkpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(VERSION, ge=VERSION, le=VERSION)
    claims: list[_Claim] = Field(default_factory=list)


def _record(prepared: preparing.Prepared) -> _Claim:
    return _Claim(
        namespace=prepared.claim.namespace,
        name=prepared.claim.name,
        uid=prepared.claim.uid,
        devices=[
            _Device.model_validate({**dataclasses.asdict(item), "cdi_ids": list(item.cdi_ids)})
            for item in prepared.devices
        ],
        spec=prepared.spec,
    )


def _prepared(record: _Claim) -> preparing.Prepared:
    return preparing.Prepared(
        preparing.ClaimRef(record.namespace, record.name, record.uid),
        tuple(
            preparing.PreparedDevice(**{**item.model_dump(), "cdi_ids": tuple(item.cdi_ids)})
            for item in record.devices
        ),
        record.spec,
    )


def _write(path: Path, text: str) -> None:
    """`text` into `path`, atomically (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


class ClaimFiles:
    """The checkpoint in `plugin_dir` and the specs in `cdi_dir`; see the module docstring."""

    def __init__(self, plugin_dir: Path, cdi_dir: Path) -> None:
        self.path = plugin_dir / CHECKPOINT
        self.cdi_dir = cdi_dir
        self.trusted = True
        """The checkpoint read back (or there was none): `orphans` may name specs."""

    def load(self) -> dict[str, preparing.Prepared]:
        """The prepared claims by UID (none when there is no checkpoint yet)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            checkpoint = _Checkpoint.model_validate_json(text)
        except ValidationError as error:
            self.trusted = False
            aside = self.path.with_name(CHECKPOINT + ".unreadable")
            os.replace(self.path, aside)
            log.error(
                "DRA checkpoint unreadable: moved aside, starting with no prepared claim",
                extra={"path": str(aside), "error": str(error)[:300]},
            )
            return {}
        return {record.uid: _prepared(record) for record in checkpoint.claims}

    def save(self, prepared: Iterable[preparing.Prepared]) -> None:
        body = _Checkpoint(claims=[_record(item) for item in prepared])
        _write(self.path, body.model_dump_json(indent=1))
        self.trusted = True

    def spec_path(self, uid: str) -> Path:
        return self.cdi_dir / preparing.spec_file(uid)

    def has_spec(self, uid: str) -> bool:
        return self.spec_path(uid).is_file()

    def write_spec(self, prepared: preparing.Prepared) -> None:
        _write(self.spec_path(prepared.claim.uid), json.dumps(prepared.spec, indent=1))

    def remove_spec(self, uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.spec_path(uid).unlink()

    def orphans(self, prepared: Mapping[str, preparing.Prepared]) -> list[str]:
        """UIDs of our specs in the CDI directory that no prepared claim holds (a spec
        written just before a crash, whose checkpoint entry never was): none when the
        checkpoint was unreadable."""
        if not self.trusted:
            return []
        try:
            names = [entry.name for entry in self.cdi_dir.iterdir()]
        except FileNotFoundError:
            return []
        found = (preparing.uid_of_spec(name) for name in names)
        return sorted(uid for uid in found if uid is not None and uid not in prepared)
