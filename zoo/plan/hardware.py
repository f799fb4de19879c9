"""Accelerators the planner prices a step on: memory, bf16 peak, the link to host memory.

Figures are per device (one GPU, or one TPU chip), from the vendors' published specifications
(``source``). Where a vendor publishes no figure the entry says what was assumed (``note``).
``host_link`` is the bandwidth one device gets to host memory **in one direction** when every
device of its host transfers at once: offloaded activations go to host in the forward pass and
come back in the backward pass, one direction at a time.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from zoo.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator as the cost model sees it (bytes, bytes/s, FLOP/s; per device)."""

    name: str
    hbm_bytes: float  # device memory
    hbm_bandwidth: float  # bytes/s
    peak_flops: float  # dense bf16 matmul peak, FLOP/s
    host_link: float  # bytes/s to or from host memory, one direction, every device busy (0: no offloading)
    host_bytes: float  # host memory per device
    source: str
    note: str = ""
    # Fraction of the peak a training step's matmuls reach: the model's time unit. What is
    # compared (a map against full remat) depends on it only through how much transfer a
    # layer's compute hides.
    efficiency: float = 0.6
    # Host and device are one memory (XLA:CPU): offloading saves nothing.
    unified: bool = False

    def describe(self) -> str:
        return (
            f"{self.name}: {self.hbm_bytes / GB:.0f} GB HBM at {self.hbm_bandwidth / 1e12:.2f} TB/s, "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16, host link {self.host_link / GB:.0f} GB/s per direction, "
            f"{self.host_bytes / GB:.0f} GB host memory per device"
        )


_PCIE5 = 64 * GB  # PCIe Gen5 x16, one direction

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100",
            80 * GB,
            3.35e12,
            989e12,
            _PCIE5,
            2048 * GB / 8,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense "
            "BF16, PCIe Gen5 128 GB/s bidirectional); DGX H100: 2 TB system memory for 8 GPUs",
        ),
        Hardware(
            "h200",
            141 * GB,
            4.8e12,
            989e12,
            _PCIE5,
            2048 * GB / 8,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16, "
            "PCIe Gen5); DGX H200: 2 TB system memory for 8 GPUs",
        ),
        Hardware(
            "b200",
            180 * GB,
            8e12,
            2.25e15,
            _PCIE5,
            2048 * GB / 8,
            source="NVIDIA DGX B200 datasheet (8 GPUs: 1,440 GB HBM3e, 64 TB/s, 72 PFLOPS FP8 training; "
            "BF16 dense half of FP8: 2.25 PFLOPS per GPU; 2 TB system memory, PCIe Gen5 hosts)",
        ),
        Hardware(
            "gb200",
            186 * GB,
            8e12,
            2.5e15,
            900 * GB / 2 / 2,
            480 * GB / 2,
            source="NVIDIA GB200 NVL72 datasheet (72 GPUs: 13.4 TB HBM3e, 576 TB/s, 180 PFLOPS dense BF16; "
            "NVLink-C2C 900 GB/s bidirectional between each Grace CPU and its two Blackwell GPUs; "
            "up to 480 GB LPDDR5X per Grace)",
            note="host link: NVLink-C2C's 900 GB/s is both directions of one Grace shared by two GPUs: "
            "225 GB/s per GPU per direction when both offload",
        ),
        Hardware(
            "tpu-v5p",
            95 * GB,
            2.765e12,
            459e12,
            32 * GB,
            448 * GB / 4,
            source="Google Cloud TPU v5p documentation (459 TFLOPS BF16, 95 GB HBM2e at 2,765 GB/s; "
            "a 4-chip host VM has 448 GB of RAM)",
            note="host link not published: PCIe Gen4 x16 (32 GB/s per direction) assumed",
        ),
        Hardware(
            "tpu-v6e",
            32 * GB,
            1.638e12,
            918e12,
            _PCIE5,
            1536 * 2**30 / 8,
            source="Google Cloud TPU v6e (Trillium) documentation (918 TFLOPS BF16, 32 GB HBM at 1,638 GB/s, "
            "each chip on PCIe Gen5 to its host; 1,536 GiB DRAM per 8-chip host)",
            note="host link width not published: PCIe Gen5 x16 assumed",
        ),
        Hardware(
            "cpu",
            24 * GB,
            20e9,
            166.3e9,
            0.0,
            0.0,
            source="the 2-core CI machine of benchmarks/README.md (float32 matmul peak 166.3 GFLOP/s measured, "
            "24 GiB RAM)",
            note="one memory for host and device: nothing to offload to",
            unified=True,
        ),
    )
}


def hardware(name: str | Hardware) -> Hardware:
    """The table's entry ``name`` (case-insensitive); an unknown name is a :class:`ConfigError`
    listing the table."""
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower().replace("_", "-")
    key = {"v5p": "tpu-v5p", "v6e": "tpu-v6e", "tpuv5p": "tpu-v5p", "tpuv6e": "tpu-v6e"}.get(key, key)
    if key not in HARDWARE:
        close = difflib.get_close_matches(key, list(HARDWARE), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown hardware {name!r}{hint}; known: {', '.join(HARDWARE)}")
    return HARDWARE[key]


# Device kinds JAX reports that name a table entry differently, and those that contain an
# entry's name without being it (a GH200 is not an H200).
_KIND_ALIASES = {"tpuv6lite": "tpu-v6e", "tpuv5": "tpu-v5p"}
_NOT_IN_TABLE = ("gh200", "tpuv5lite")


def for_device(device: Any) -> str | None:
    """The table's name for a JAX device: ``"cpu"`` on CPU, else the longest table name within
    its device kind (``"NVIDIA H200"`` -> ``"h200"``, GB200 before B200, ``"TPU v6 lite"`` ->
    ``"tpu-v6e"``); None if none is (``"NVIDIA GH200 480GB"``, ``"TPU v5 lite"``)."""
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower().replace(" ", "").replace("-", "")
    if any(other in kind for other in _NOT_IN_TABLE):
        return None
    for alias in sorted(_KIND_ALIASES, key=len, reverse=True):
        if kind.startswith(alias):
            return _KIND_ALIASES[alias]
    for name in sorted(HARDWARE, key=len, reverse=True):
        if name.replace("-", "") in kind:
            return name
    return None


def measure_host_link(device: Any = None, nbytes: int = 256 * 2**20, repeats: int = 3) -> tuple[float, float]:
    """``(to host, to device)`` bytes/s of ``nbytes`` moved between ``device`` (default the first)
    and its pinned host memory, the best of ``repeats`` timed transfers each way after a warm-up
    (a few hundred MB: about a second). One device transferring alone: with every device of the
    host transferring at once, as the table's ``host_link`` assumes, each gets less."""
    import time

    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    on_host = on_device.with_memory_kind("pinned_host")
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), on_device).block_until_ready()
    host = jax.device_put(x, on_host).block_until_ready()
    jax.device_put(host, on_device).block_until_ready()  # warm-up both ways
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, (src, dst) in enumerate(((x, on_host), (host, on_device))):
            start = time.perf_counter()
            jax.device_put(src, dst).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - start)
    return x.nbytes / best[0], x.nbytes / best[1]
