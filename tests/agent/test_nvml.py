"""`nvml.Real` at the NVML library boundary, with no GPU here: the installed nvidia-ml-py
module itself, its C entry points (`_nvmlGetFunctionPointer`) answered by this test as a
driver would, and its Python wrappers left as they are (`monkeypatch`, undone after each
test). What pynvml versions differ in: a wrapper that is absent altogether."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pytest

from gpuplace.agent import nvml

pynvml: Any = pytest.importorskip("pynvml")
HANDLE = object()


def driver(monkeypatch: pytest.MonkeyPatch, functions: dict[str, Callable[..., int]]) -> None:
    """NVML initialised, one GPU; the C functions a driver has are `functions` (any other
    one: Function Not Found, as pynvml raises for a symbol the library lacks)."""

    def pointer(name: str) -> Callable[..., int]:
        if name not in functions:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return functions[name]

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: HANDLE)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", pointer)


def test_a_driver_and_a_pynvml_without_either_call_is_not_supported_never_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver lacks nvmlDeviceGetProcessUtilization and the installed pynvml lacks the
    wrapper of the newer call: an NvmlError the sampler counts, not an AttributeError that
    fails every sample."""
    driver(monkeypatch, {})
    monkeypatch.delattr(pynvml, "nvmlDeviceGetProcessesUtilizationInfo")
    with pytest.raises(nvml.NvmlError) as raised:
        nvml.Real().process_utilization(0, 0)
    assert raised.value.not_supported


def test_the_newer_call_answers_where_the_driver_lacks_the_older(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def newer(handle: object, info: Any) -> int:
        found = info._obj  # what byref() points at
        if not found.procUtilArray:  # the first call asks for the count
            found.processSamplesCount = 1
            return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        found.procUtilArray[0] = pynvml.c_nvmlProcessUtilizationInfo_v1_t(
            timeStamp=2500, pid=590, smUtil=40
        )
        return int(pynvml.NVML_SUCCESS)

    driver(monkeypatch, {"nvmlDeviceGetProcessesUtilizationInfo": newer})
    assert nvml.Real().process_utilization(0, 1000) == [nvml.ProcessSample(590, 2500, 40)]


def test_no_sample_since_is_an_empty_answer_and_other_errors_are_nvmls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = pynvml.NVML_ERROR_NOT_FOUND

    def older(handle: object, samples: Any, count: Any, since: ctypes.c_ulonglong) -> int:
        return int(answer)

    driver(monkeypatch, {"nvmlDeviceGetProcessUtilization": older})
    real = nvml.Real()
    assert real.process_utilization(0, 0) == []
    answer = pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(nvml.NvmlError, match="Not Supported"):
        real.process_utilization(0, 0)


def test_the_drivers_reservation_is_read_through_the_second_memory_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 43: `reserved` is only in nvmlDeviceGetMemoryInfo_v2 (nvidia-smi's "reserved");
    a driver without that call answers Function Not Found, which the agent takes for Not
    Supported and falls back on the idle reading (`gpuplace.agent.capacity`)."""

    def second(handle: object, memory: Any) -> int:
        found = memory._obj
        assert found.version == pynvml.nvmlMemory_v2
        found.total, found.reserved = 81559 << 20, 480 << 20
        return int(pynvml.NVML_SUCCESS)

    driver(monkeypatch, {"nvmlDeviceGetMemoryInfo_v2": second})
    assert nvml.Real().memory_reserved(0) == 480 << 20
    driver(monkeypatch, {})
    with pytest.raises(nvml.NvmlError) as raised:
        nvml.Real().memory_reserved(0)
    assert raised.value.not_supported


def test_a_followed_replay_reads_its_file_again_when_it_changes(tmp_path: Any) -> None:
    path = tmp_path / "reading.json"
    path.write_text('{"count": 1, "gpus": [{"index": 0, "uuid": "GPU-a"}]}')
    replay = nvml.Replay.load(path, follow=True)
    assert replay.uuid(0) == "GPU-a"
    written = tmp_path / "next.json"
    written.write_text('{"count": 1, "gpus": [{"index": 0, "uuid": "GPU-b"}]}')
    written.replace(path)
    assert replay.gpu_count() == 1 and replay.uuid(0) == "GPU-b"  # a pass starts with the count
    path.write_text("{half a docu")  # caught mid-write: the last reading stays
    assert replay.gpu_count() == 1 and replay.uuid(0) == "GPU-b"
    unfollowed = nvml.Replay({"count": 2, "gpus": []})
    assert unfollowed.gpu_count() == 2  # a reading given as an object is never re-read
