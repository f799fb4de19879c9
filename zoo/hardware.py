"""Accelerators the planner prices a step on: memory, bf16 peak, the link to host memory.

Figures are per device (one GPU, or one TPU chip), from the vendors' published specifications
(``source``). Where a vendor publishes no figure the entry says what was assumed (``note``).
``host_link`` is the bandwidth one device gets to host memory **in one direction** when every
device of its host transfers at once: offloaded activations go to host in the forward pass and
come back in the backward pass, one direction at a time.

The network (``zoo.plan.collectives`` prices collectives on it): devices come in fast domains of
``domain`` devices (an NVLink domain, a TPU slice's ICI), each device with ``domain_link`` bytes/s
per direction into it, and ``cross_link`` per device out of it (InfiniBand / RoCE per GPU, TPU
DCN per chip). A ring all-gather, reduce-scatter or all-reduce whose group spans domains, m of
its devices in each, crosses on the m devices' links together (NCCL: a ring per channel, each
crossing on another GPU's NIC), up to ``domain_link``; on TPUs (``hierarchical``) XLA runs it in
two stages, the slice-local part on ICI and only a 1/(devices in the slice) share over DCN. An
all-to-all sends each device's bytes for other domains on its own ``cross_link``.
``link_source`` says where each figure comes from.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
    # Fraction of the bf16 peak a training step's matmuls reach: the model's time unit. What is
    # compared (a map against full remat) depends on it only through how much transfer a
    # layer's compute hides. 0.6 where uncalibrated; CALIBRATED_EFFICIENCY below where fitted.
    efficiency: float = 0.6
    # Host and device are one memory (XLA:CPU): offloading saves nothing.
    unified: bool = False
    # The network, per device and per direction (0: not published, the planner refuses meshes
    # that need it). ``domain``: devices per fast domain.
    domain: int = 1
    domain_link: float = 0.0
    cross_link: float = 0.0
    link_source: str = ""
    # A collective spanning domains runs in two stages (XLA on TPU multislice: within the slice,
    # then across slices on 1/(devices in the slice) of the bytes); False: one ring at cross_link.
    hierarchical: bool = False
    # float32 matmuls run at this fraction of the bf16 peak (TF32 on NVIDIA, bf16 passes on TPU).
    f32_ratio: float = 0.5
    # FP8 matmuls (E4M3/E5M2 operands, float32 accumulation) run at this multiple of the bf16 peak
    # (dense, as the datasheet gives it; 1: no FP8 matmul unit, an FP8 product runs as bf16).
    fp8_ratio: float = 1.0
    fp8_source: str = ""
    # Block-scaled FP8 products (MXFP8: E4M3 codes with an E8M0 scale per 32 elements, XLA's
    # block-scaled dot) run at the FP8 peak too: tensor cores that take the block scales (Blackwell).
    # False: XLA's GPU compiler expands them to a dequantization and a dot (Hopper), priced as such.
    block_scaled_fp8: bool = False
    # The devices of a mesh are simulated in one process (XLA:CPU's forced device count): they
    # share ``hbm_bytes``, the machine's memory, rather than each having it.
    simulated: bool = False

    @property
    def platform(self) -> str:
        """The JAX platform the step runs on: ``"cpu"`` (one memory), ``"tpu"`` (a ``tpu-`` name),
        else ``"gpu"``. It decides what the program does where backends differ (the MoE dispatch's
        transport, :mod:`zoo.layers.moe_dispatch`)."""
        return "cpu" if self.unified else "tpu" if self.name.startswith("tpu") else "gpu"

    def memory_per_device(self, devices: int) -> float:
        """Device memory per device of a mesh of ``devices``: ``hbm_bytes``, or (``simulated``)
        the machine's memory divided among them."""
        return self.hbm_bytes / max(int(devices), 1) if self.simulated else self.hbm_bytes

    def peak_for(self, dtype: Any) -> float:
        """Dense matmul peak, FLOP/s, in the compute dtype ``dtype`` (bf16, float32, or an FP8
        format for a product of FP8 operands)."""
        size = np.dtype(dtype).itemsize
        return self.peak_flops * (self.f32_ratio if size >= 4 else self.fp8_ratio if size == 1 else 1.0)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.hbm_bytes / GB:.0f} GB HBM at {self.hbm_bandwidth / 1e12:.2f} TB/s, "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16, host link {self.host_link / GB:.0f} GB/s per direction, "
            f"{self.host_bytes / GB:.0f} GB host memory per device; {self.domain}-device fast domains at "
            f"{self.domain_link / GB:.0f} GB/s, {self.cross_link / GB:.1f} GB/s across, per device per direction"
        )


_PCIE5 = 64 * GB  # PCIe Gen5 x16, one direction
_IB400 = 400e9 / 8  # one 400 Gb/s ConnectX-7 port per GPU (NDR InfiniBand), one direction
_BLACKWELL_MX = (
    "block-scaled (MXFP8) products at the FP8 rate: Blackwell's fifth-generation tensor cores take E8M0 "
    "block scales (the NVIDIA Blackwell architecture technical brief's microscaling formats); Hopper has none"
)
_HGX_LINKS = (
    "NVLink within the 8-GPU HGX baseboard; InfiniBand across: DGX H100/H200/B200 datasheets "
    "(eight 400 Gb/s ConnectX-7 ports, one per GPU)"
)

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
            domain=8, domain_link=900 * GB / 2, cross_link=_IB400,
            link_source="H100 SXM5 datasheet: NVLink 900 GB/s per GPU (both directions); " + _HGX_LINKS,
            fp8_ratio=2.0, fp8_source="H100 SXM5 datasheet: FP8 Tensor Core 3,958 TFLOPS with sparsity, 1,979 dense",
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
            domain=8, domain_link=900 * GB / 2, cross_link=_IB400,
            link_source="H200 SXM datasheet: NVLink 900 GB/s per GPU (both directions); " + _HGX_LINKS,
            fp8_ratio=2.0, fp8_source="H200 SXM datasheet: FP8 Tensor Core 3,958 TFLOPS with sparsity, 1,979 dense",
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
            domain=8, domain_link=1800 * GB / 2, cross_link=_IB400,
            link_source="DGX B200 datasheet: fifth-generation NVLink 1.8 TB/s per GPU (both directions), 14.4 TB/s "
            "for the 8; " + _HGX_LINKS,
            fp8_ratio=2.0, fp8_source="DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs (with sparsity): "
            "4.5 PFLOPS dense per GPU, twice BF16; " + _BLACKWELL_MX,
            block_scaled_fp8=True,
        ),
        Hardware(
            "gb200",
            186 * GB,
            8e12,
            2.5e15,
            170 * GB,
            480 * GB / 2,
            source="NVIDIA GB200 NVL72 datasheet (72 GPUs: 13.4 TB HBM3e, 576 TB/s, 180 PFLOPS dense BF16; "
            "NVLink-C2C 900 GB/s bidirectional between each Grace CPU and its two Blackwell GPUs; "
            "up to 480 GB LPDDR5X per Grace)",
            note="host link measured, not the specification: nvbandwidth on 4 Grace-Blackwell GPUs (GB300, the "
            "same Grace and NVLink-C2C) copying at once, host_to_all 168.6-175.4 GB/s and all_to_host "
            "181.9-183.9 GB/s per GPU (NVIDIA/Megatron-LM issue 6491), against the 900 GB/s C2C figure "
            "(both directions, shared by the Grace's two GPUs: 225 GB/s per GPU per direction)",
            domain=72, domain_link=1800 * GB / 2, cross_link=_IB400,
            link_source="GB200 NVL72 datasheet: one NVLink domain of 72 GPUs, 1.8 TB/s per GPU (both directions), "
            "130 TB/s in all; DGX GB200: one 400 Gb/s ConnectX-7 per GPU across racks",
            fp8_ratio=2.0, fp8_source="GB200 NVL72 datasheet: FP8/FP6 Tensor Core 720 PFLOPS with sparsity for 72 "
            "GPUs (360 dense: 5 PFLOPS per GPU), twice the 180 PFLOPS dense BF16; " + _BLACKWELL_MX,
            block_scaled_fp8=True,
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
            domain=6144, domain_link=1200 * GB / 2, cross_link=50e9 / 8,
            link_source="Cloud TPU v5p documentation: ICI 1,200 GB/s per chip (both directions, 3D torus), the "
            "largest slice 6,144 chips; data center network (DCN) 50 Gbps per chip between slices",
            hierarchical=True,
            fp8_source="Cloud TPU v5p documentation: BF16 and INT8 (918 TOPS) peaks, no FP8 one: FP8 products priced "
            "as BF16",
        ),
        Hardware(
            "tpu-v5e",
            16 * GB,
            819e9,
            197e12,
            32 * GB,
            512 * 2**30 / 8,
            source="Google Cloud TPU v5e documentation (197 TFLOPS BF16, 16 GB HBM2 at 819 GB/s; 512 GiB DRAM per "
            "8-chip host)",
            note="host link not published: PCIe Gen4 x16 (32 GB/s per direction) assumed, as for v5p "
            "(benchmarks/tpu.py measures one chip's)",
            domain=256, domain_link=400 * GB / 2, cross_link=2 * 100e9 / 8 / 8,
            link_source="Cloud TPU v5e documentation: ICI 400 GB/s per chip (both directions, 4 ports, 2D torus), "
            "256-chip pods; 2 x 100 Gbps NICs per 8-chip host",
            hierarchical=True,
            fp8_source="Cloud TPU v5e documentation: BF16 and INT8 (393 TOPS) peaks, no FP8 one: FP8 products priced "
            "as BF16",
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
            note="host link width not published: PCIe Gen5 x16 assumed; DCN per chip not published: "
            "100 Gbps assumed (v5e's hosts have 2 x 100 Gbps for 8 chips, v5p 50 Gbps per chip)",
            domain=256, domain_link=800 * GB / 2, cross_link=100e9 / 8,
            link_source="Cloud TPU v6e documentation: ICI 800 GB/s per chip (both directions, 4 ports, 2D torus), "
            "256-chip pods",
            hierarchical=True,
            fp8_source="Cloud TPU v6e documentation: BF16 and INT8 (1,836 TOPS) peaks, no FP8 one: FP8 products "
            "priced as BF16",
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
            domain=1 << 20, domain_link=20e9, cross_link=20e9,
            link_source="simulated devices of one process: a collective is a copy in RAM",
            f32_ratio=1.0,
            simulated=True,
            fp8_source="XLA:CPU emulates FP8 products: priced as float32",
        ),
    )
}


# bf16 matmul efficiency per hardware, fitted by benchmarks/published_runs.py on the calibration
# half of zoo.plan.published.RUNS only (MaxText's measured steps; one constant per hardware, none
# per run) and checked on the held-out half: docs/planning.md, "Against published runs". H200
# keeps 0.6: no published H200 run was fitted, though it is the same Hopper chip as the H100.
CALIBRATED_EFFICIENCY: dict[str, float] = {"h100": 0.56, "tpu-v5p": 0.765, "tpu-v6e": 0.49}
HARDWARE.update({n: dataclasses.replace(HARDWARE[n], efficiency=e) for n, e in CALIBRATED_EFFICIENCY.items()})


def hardware(name: str | Hardware, *, domain: int | None = None) -> Hardware:
    """The table's entry ``name`` (case-insensitive); an unknown name is a :class:`ConfigError`
    listing the table. ``domain``: the job's devices in each fast domain, where it holds fewer
    than the domain has (NVIDIA places jobs of 128 GB200s or more 16 four-GPU trays, 64 GPUs, to
    an NVL72 rack: Slurm's ``--segment 16``); the planner numbers the job's devices in domains of
    that many."""
    if domain is not None:
        hw = hardware(name)
        if not isinstance(domain, int) or isinstance(domain, bool) or not 1 <= domain <= hw.domain:
            raise ConfigError(f"domain must be a device count from 1 to {hw.name}'s {hw.domain}, got {domain!r}")
        return dataclasses.replace(hw, domain=domain)
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower().replace("_", "-")
    if key not in HARDWARE:  # a TPU entry by its version alone ("v5p") or unhyphenated ("tpuv5p")
        key = next((n for n in HARDWARE if n.startswith("tpu-") and key in (n[4:], n.replace("-", ""))), key)
    if key not in HARDWARE:
        close = difflib.get_close_matches(key, list(HARDWARE), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown hardware {name!r}{hint}; known: {', '.join(HARDWARE)}")
    return HARDWARE[key]


# Device kinds JAX reports that name a table entry differently, and those that contain an
# entry's name without being it (a GH200 is not an H200).
_KIND_ALIASES = {"tpuv6lite": "tpu-v6e", "tpuv5lite": "tpu-v5e", "tpuv5": "tpu-v5p"}
_NOT_IN_TABLE = ("gh200",)


def for_device(device: Any) -> str | None:
    """The table's name for a JAX device: ``"cpu"`` on CPU, else the longest table name within
    its device kind (``"NVIDIA H200"`` -> ``"h200"``, GB200 before B200, ``"TPU v6 lite"`` ->
    ``"tpu-v6e"``, ``"TPU v5 lite"`` -> ``"tpu-v5e"``); None if none is (``"NVIDIA GH200 480GB"``)."""
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
    device = device or jax.devices()[0]
    on_device = jax.sharding.make_single_device_sharding(device)
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
