"""The narrow seam between the node agent and NVML: just the calls discovery, health and
usage make, behind one Protocol, `Nvml`.

`Real` is that seam over the NVIDIA driver (`pynvml`, from the nvidia-ml-py package);
`Replay` answers the same calls from readings captured on a real machine, in the
format of `../shared/fixtures/gpu/nvml-*.json` (one object per GPU; a field recorded as
`{"nvml_error": "Not Supported"}` means that call raised NVMLError with that message
there, and replaying it raises `NvmlError` with the same message); a replay loaded with
`follow` reads its file again when it changes, as a GPU changing under a running agent
would (tests of the whole agent write the processes of a pod there). The captures hold NVML's
first memory call (total, used, free): the driver's reservation alone (the second call's
`reserved`) answers Not Supported unless a reading adds `memory.reserved`. Per-process SM samples
(`process_utilization`) are not in the captures: a reading without the optional key
`process_utilization` answers Not Supported there, as a driver without the call would.
`derived` builds
larger replays for tests and benchmarks from one captured GPU: the copies are marked
`"derived": true` with what was varied, so that nothing derived passes for a capture.

Every call may raise `NvmlError`; callers decide what an answer NVML could not give
means (discovery records it as unknown, never guesses). GPUs are addressed by NVML
index. This module does no I/O of its own beyond the driver calls (Real) or reading
one JSON document (Replay.load, and again when a followed file changes), and keeps no
state but the NVML handles.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

NVLINK_LINKS = 18
"""Links probed per GPU: the most any GPU has (an H100 SXM has 18; NVML's maximum,
`NVML_NVLINK_MAX_LINKS`, is larger and answers Invalid Argument past the real ones)."""


class NvmlError(Exception):
    """An NVML call failed; `str(error)` is NVML's own message ("Not Supported", "GPU is
    lost", ...)."""

    @property
    def not_supported(self) -> bool:
        return str(self) in {"Not Supported", "Invalid Argument", "Function Not Found"}


@dataclass(frozen=True, slots=True)
class Process:
    """A process NVML reports on a GPU: its host PID and the GPU memory it holds (bytes;
    None when NVML does not know, e.g. without permission)."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One of NVML's per-process utilisation samples on a GPU: the share of the GPU's SMs
    the process kept busy over the driver's sample period (percent, 0-100), stamped with
    the driver's CPU time in microseconds."""

    pid: int
    timestamp_us: int
    sm_percent: int


@dataclass(frozen=True, slots=True)
class Xid:
    """A critical XID event NVML delivered for GPU `index`."""

    index: int
    xid: int


class Nvml(Protocol):
    """The NVML calls the agent makes. Each raises `NvmlError` where NVML does."""

    def gpu_count(self) -> int: ...
    def driver(self) -> str: ...
    def uuid(self, index: int) -> str: ...
    def name(self, index: int) -> str: ...
    def memory_total(self, index: int) -> int:
        """Bytes."""
        ...

    def memory_used(self, index: int) -> int:
        """Bytes (NVML's first memory call: the driver's reservation included)."""
        ...

    def memory_reserved(self, index: int) -> int:
        """Bytes the driver keeps for itself (nvmlDeviceGetMemoryInfo_v2's `reserved`;
        Not Supported where the driver has no v2 call)."""
        ...

    def pci_bus_id(self, index: int) -> str: ...
    def numa_node(self, index: int) -> int: ...
    def mig_mode(self, index: int) -> tuple[int, int]:
        """(current, pending): 1 enabled, 0 disabled."""
        ...

    def ecc_uncorrected(self, index: int) -> int:
        """Uncorrectable ECC errors since the driver loaded (volatile)."""
        ...

    def nvlink_links(self, index: int) -> int:
        """How many link numbers to probe (0..n-1)."""
        ...

    def nvlink_remote(self, index: int, link: int) -> str | None:
        """The PCI bus id at the far end of an active link; None when the link is down."""
        ...

    def compute_processes(self, index: int) -> Sequence[Process]: ...
    def mps_processes(self, index: int) -> Sequence[Process]: ...
    def utilization(self, index: int) -> int:
        """Percent of the last sample period (1/6 s to 1 s by GPU) during which a kernel
        ran on the GPU (nvmlDeviceGetUtilizationRates().gpu)."""
        ...

    def process_utilization(self, index: int, since_us: int) -> Sequence[ProcessSample]:
        """The per-process samples the driver holds that are newer than `since_us` (its
        timestamps; 0: all it holds). Empty when no process ran a kernel since (NVML's
        Not Found). Raises `NvmlError` (Not Supported) where the driver cannot say."""
        ...

    def xid_events(self) -> Sequence[Xid]:
        """Critical XID events since the last call (never blocks). Raises `NvmlError`
        (Not Supported) where the GPUs cannot deliver them."""
        ...


def bus_id(raw: str | bytes) -> str:
    """NVML's PCI bus id in one spelling: text, upper case ("00000000:00:06.0")."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return text.strip().upper()


# --- Real ----------------------------------------------------------------------------


class Real:
    """`Nvml` over the driver. `Real()` initialises NVML (raises `NvmlError` where no
    driver is loaded); `close()` shuts it down. NVML itself is thread-safe; the XID
    event set kept here is not: one caller of `xid_events` (the publisher)."""

    def __init__(self) -> None:
        import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types

        self._nvml: Any = pynvml
        self._events: Any = None
        self._events_error: str = ""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise NvmlError(str(error)) from error

    def _call(self, name: str, *args: object) -> Any:
        try:
            return getattr(self._nvml, name)(*args)
        except self._nvml.NVMLError as error:
            raise NvmlError(str(error)) from error

    def _handle(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def _text(self, value: str | bytes) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def close(self) -> None:
        if self._events is not None:
            self._call("nvmlEventSetFree", self._events)
            self._events = None
        self._call("nvmlShutdown")

    def gpu_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def driver(self) -> str:
        return self._text(self._call("nvmlSystemGetDriverVersion"))

    def uuid(self, index: int) -> str:
        return self._text(self._call("nvmlDeviceGetUUID", self._handle(index)))

    def name(self, index: int) -> str:
        return self._text(self._call("nvmlDeviceGetName", self._handle(index)))

    def memory_total(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetMemoryInfo", self._handle(index)).total)

    def memory_used(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetMemoryInfo", self._handle(index)).used)

    def memory_reserved(self, index: int) -> int:
        version = self._nvml.nvmlMemory_v2
        return int(self._call("nvmlDeviceGetMemoryInfo", self._handle(index), version).reserved)

    def pci_bus_id(self, index: int) -> str:
        return bus_id(self._call("nvmlDeviceGetPciInfo", self._handle(index)).busId)

    def numa_node(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetNumaNodeId", self._handle(index)))

    def mig_mode(self, index: int) -> tuple[int, int]:
        current, pending = self._call("nvmlDeviceGetMigMode", self._handle(index))
        return int(current), int(pending)

    def ecc_uncorrected(self, index: int) -> int:
        nvml = self._nvml
        return int(
            self._call(
                "nvmlDeviceGetTotalEccErrors",
                self._handle(index),
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
        )

    def nvlink_links(self, index: int) -> int:
        return NVLINK_LINKS

    def nvlink_remote(self, index: int, link: int) -> str | None:
        handle = self._handle(index)
        if not int(self._call("nvmlDeviceGetNvLinkState", handle, link)):
            return None
        return bus_id(self._call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link).busId)

    def _processes(self, call: str, index: int) -> list[Process]:
        found = self._call(call, self._handle(index))
        return [
            Process(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in found
        ]

    def compute_processes(self, index: int) -> Sequence[Process]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses", index)

    def mps_processes(self, index: int) -> Sequence[Process]:
        return self._processes("nvmlDeviceGetMPSComputeRunningProcesses", index)

    def utilization(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetUtilizationRates", self._handle(index)).gpu)

    def process_utilization(self, index: int, since_us: int) -> Sequence[ProcessSample]:
        nvml, handle = self._nvml, self._handle(index)
        # The older call first (every driver since Maxwell); the newer one, where a driver
        # drops the older. An older nvidia-ml-py has no wrapper for the newer: as if the
        # driver lacked it (Function Not Found, which callers take for Not Supported).
        for call in ("nvmlDeviceGetProcessUtilization", "nvmlDeviceGetProcessesUtilizationInfo"):
            wrapper = getattr(nvml, call, None)
            if wrapper is None:
                continue
            try:
                found = wrapper(handle, since_us)
            except nvml.NVMLError as error:
                # NVML says Not Found when it holds no sample newer than `since_us`; the
                # wrapper raises Success when the count it asked for first was 0.
                if error.value in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_SUCCESS):
                    return []
                if error.value == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                raise NvmlError(str(error)) from error
            return [ProcessSample(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in found]
        raise NvmlError("Function Not Found")

    def xid_events(self) -> Sequence[Xid]:
        nvml = self._nvml
        if self._events_error:
            raise NvmlError(self._events_error)
        if self._events is None:
            events = self._call("nvmlEventSetCreate")
            registered = 0
            for index in range(self.gpu_count()):
                try:
                    self._call(
                        "nvmlDeviceRegisterEvents",
                        self._handle(index),
                        nvml.nvmlEventTypeXidCriticalError,
                        events,
                    )
                    registered += 1
                except NvmlError as error:
                    self._events_error = str(error)
            if not registered:
                self._call("nvmlEventSetFree", events)
                raise NvmlError(self._events_error or "Not Supported")
            self._events_error = ""
            self._events = events
        found: list[Xid] = []
        while True:
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError as error:
                if error.value == nvml.NVML_ERROR_TIMEOUT:
                    return found
                raise NvmlError(str(error)) from error
            if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                index = int(self._call("nvmlDeviceGetIndex", data.device))
                found.append(Xid(index, int(data.eventData)))


# --- Replay --------------------------------------------------------------------------


def _answer(value: Any) -> Any:
    if isinstance(value, Mapping) and "nvml_error" in value:
        raise NvmlError(str(value["nvml_error"]))
    return value


class Replay:
    """`Nvml` answered from one captured reading (the fixtures' JSON). Optional keys a
    capture may lack: `nvlink` entries `{"state": 0|1, "remote_pci_bus_id": "..."}`
    (the fixtures only hold errors there), top-level `xid_events` `[{"index", "xid"}]`
    delivered once each (absent: none happened while capturing), and per GPU
    `process_utilization` `[{"pid", "timeStamp", "smUtil"}]` (NVML's sample fields; absent:
    Not Supported, as in every capture; tests that add it say so). `replace` swaps the
    reading, as a GPU changing under a running agent would."""

    def __init__(self, reading: Mapping[str, Any], *, follow: Path | None = None) -> None:
        self.reading: Mapping[str, Any] = reading
        self._delivered = 0
        self.calls = 0
        """NVML calls answered (benchmarks count them)."""
        self._follow = follow
        self._stamp = follow.stat().st_mtime_ns if follow is not None else 0

    @classmethod
    def load(cls, path: Path, *, follow: bool = False) -> Replay:
        """The reading in `path`; with `follow`, read again whenever the file changes (each
        pass of its caller starts with `gpu_count`, which looks): write a new reading to a
        temporary file and rename it over `path`. A file that does not read as JSON keeps
        the last reading."""
        return cls(json.loads(path.read_text()), follow=path if follow else None)

    def _look(self) -> None:
        if self._follow is None:
            return
        try:
            stamp = self._follow.stat().st_mtime_ns
            if stamp == self._stamp:
                return
            reading = json.loads(self._follow.read_text())
        except (OSError, ValueError):
            return
        self._stamp = stamp
        if reading != self.reading:
            self.replace(reading)

    def replace(self, reading: Mapping[str, Any]) -> None:
        self.reading = reading
        self._delivered = 0

    def _gpu(self, index: int) -> Mapping[str, Any]:
        self.calls += 1
        gpus = self.reading.get("gpus") or []
        if not 0 <= index < len(gpus):
            raise NvmlError("Invalid Argument")
        gpu: Mapping[str, Any] = _answer(gpus[index])
        return gpu

    def _field(self, index: int, key: str) -> Any:
        gpu = self._gpu(index)
        if key not in gpu:
            raise NvmlError("Not Supported")
        return _answer(gpu[key])

    def gpu_count(self) -> int:
        self._look()
        self.calls += 1
        return int(_answer(self.reading.get("count", len(self.reading.get("gpus") or []))))

    def driver(self) -> str:
        self.calls += 1
        return str(_answer(self.reading.get("driver", {"nvml_error": "Not Supported"})))

    def uuid(self, index: int) -> str:
        return str(self._field(index, "uuid"))

    def name(self, index: int) -> str:
        return str(self._field(index, "name"))

    def memory_total(self, index: int) -> int:
        return int(_answer(self._field(index, "memory")["total"]))

    def memory_used(self, index: int) -> int:
        return int(_answer(self._field(index, "memory")["used"]))

    def memory_reserved(self, index: int) -> int:
        memory = self._field(index, "memory")
        if "reserved" not in memory:
            raise NvmlError("Not Supported")  # the captures read NVML's first call only
        return int(_answer(memory["reserved"]))

    def pci_bus_id(self, index: int) -> str:
        return bus_id(str(self._field(index, "pci_bus_id")))

    def numa_node(self, index: int) -> int:
        return int(self._field(index, "numa_node"))

    def mig_mode(self, index: int) -> tuple[int, int]:
        current, pending = self._field(index, "mig_mode")
        return int(current), int(pending)

    def ecc_uncorrected(self, index: int) -> int:
        return int(self._field(index, "ecc_uncorrected_volatile"))

    def nvlink_links(self, index: int) -> int:
        return len(self._field(index, "nvlink"))

    def nvlink_remote(self, index: int, link: int) -> str | None:
        links = self._field(index, "nvlink")
        if not 0 <= link < len(links):
            raise NvmlError("Invalid Argument")
        entry = _answer(links[link])
        if not int(entry.get("state", 0)):
            return None
        return bus_id(str(entry["remote_pci_bus_id"]))

    def _processes(self, index: int, key: str) -> list[Process]:
        found = self._field(index, key)
        return [Process(int(p["pid"]), p.get("usedGpuMemory")) for p in found]

    def compute_processes(self, index: int) -> Sequence[Process]:
        return self._processes(index, "compute_processes")

    def mps_processes(self, index: int) -> Sequence[Process]:
        return self._processes(index, "mps_processes")

    def utilization(self, index: int) -> int:
        return int(_answer(self._field(index, "utilization")["gpu"]))

    def process_utilization(self, index: int, since_us: int) -> Sequence[ProcessSample]:
        samples = self._field(index, "process_utilization")
        return [
            ProcessSample(int(s["pid"]), int(s["timeStamp"]), int(s["smUtil"]))
            for s in samples
            if int(s["timeStamp"]) > since_us
        ]

    def xid_events(self) -> Sequence[Xid]:
        self.calls += 1
        events = _answer(self.reading.get("xid_events", []))
        fresh = events[self._delivered :]
        self._delivered = len(events)
        return [Xid(int(event["index"]), int(event["xid"])) for event in fresh]


# --- derived readings (tests, benchmarks) ----------------------------------------------


def derived(
    reading: Mapping[str, Any],
    count: int,
    *,
    nvlink_domains: Iterable[Sequence[int]] = (),
    numa: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A `count`-GPU reading made from the first GPU of a captured one: indices, minor
    numbers, UUIDs (last group replaced by the index) and PCI bus ids (device number
    = index) varied; each group of `nvlink_domains` fully connected by NVLink (one link
    per peer, the others down); NUMA set per GPU from `numa` where given (else the
    captured answer, e.g. Not Supported). Marked `"derived"`: not a capture."""
    source = reading["gpus"][0]
    peers: dict[int, list[int]] = {}
    for group in nvlink_domains:
        for member in group:
            peers[member] = [other for other in group if other != member]
    gpus = []
    for index in range(count):
        gpu = copy.deepcopy(dict(source))
        gpu["index"] = index
        gpu["minor"] = index
        uuid = str(source["uuid"])
        gpu["uuid"] = f"{uuid.rsplit('-', 1)[0]}-{index:012x}"
        gpu["pci_bus_id"] = _derived_bus(index)
        if numa is not None:
            gpu["numa_node"] = numa[index]
        if index in peers:
            links = [{"state": 1, "remote_pci_bus_id": _derived_bus(peer)} for peer in peers[index]]
            links += [{"state": 0}] * max(0, NVLINK_LINKS - len(links))
            gpu["nvlink"] = links
        gpus.append(gpu)
    made = {key: value for key, value in reading.items() if key != "gpus"}
    made.update(
        count=count,
        gpus=gpus,
        label=f"{reading.get('label', 'reading')}-derived-{count}",
        derived=(
            f"{count} copies of GPU 0 of {reading.get('label', 'a capture')}: index, minor, "
            "uuid, pci_bus_id varied"
            + ("; nvlink set" if peers else "")
            + ("; numa_node set" if numa is not None else "")
        ),
    )
    return made


def _derived_bus(index: int) -> str:
    return f"00000000:{0x10 + index:02X}:00.0"
