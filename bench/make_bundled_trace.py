"""Regenerates gpuplace/data/nodes.csv and pods.csv: the small cluster and workload
`gpuplace simulate` replays when given no files. Our own synthetic data (openb
format, not derived from the openb trace): mixed models, 1-8 GPUs per node, sharing,
whole-GPU, multi-GPU and CPU-only pods. Deterministic (seed 7).

    .venv/bin/python bench/make_bundled_trace.py
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "gpuplace" / "data"

NODE_TYPES = (
    # model, GPUs, cores, memory MiB, how many
    ("A100", 8, 128_000, 1_048_576, 6),
    ("V100", 8, 96_000, 393_216, 8),
    ("V100", 4, 64_000, 262_144, 8),
    ("T4", 2, 96_000, 393_216, 14),
    ("A10", 1, 32_000, 131_072, 8),
)

POD_MIX = (
    # weight, num_gpu, gpu_milli choices, cpu choices (milli), memory MiB, spec
    (32, 1, (810, 810, 650, 470, 470, 320, 230, 160), (3_000, 8_000, 12_000), (8_192, 16_384), ""),
    (26, 1, (1000,), (8_000, 11_000, 12_000), (32_768, 49_152), ""),
    (5, 1, (500, 1000), (4_000, 8_000), (16_384,), "V100|A100"),
    (5, 2, (1000,), (16_000, 24_000), (65_536,), ""),
    (3, 4, (1000,), (32_000, 44_000), (131_072,), ""),
    (1, 8, (1000,), (64_000, 88_000), (262_144,), ""),
    (16, 0, (0,), (8_000, 12_000, 24_000), (16_384, 32_768), ""),
)


def main() -> None:
    rng = random.Random(7)
    DATA.mkdir(parents=True, exist_ok=True)
    with (DATA / "nodes.csv").open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        number = 0
        for model, gpus, cpu, memory, count in NODE_TYPES:
            for _ in range(count):
                writer.writerow([f"node-{number:03d}", cpu, memory, gpus, model])
                number += 1
    weights = [entry[0] for entry in POD_MIX]
    with (DATA / "pods.csv").open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"])
        for number in range(200):
            _, num_gpu, millis, cpus, memories, spec = rng.choices(POD_MIX, weights)[0]
            writer.writerow(
                [
                    f"pod-{number:04d}",
                    rng.choice(cpus),
                    rng.choice(memories),
                    num_gpu,
                    rng.choice(millis),
                    spec,
                ]
            )


if __name__ == "__main__":
    main()
