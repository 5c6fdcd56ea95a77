"""Accelerator datasheet figures for estimates and compile targets (never measurements)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum

GIB = 2**30


class Backend(StrEnum):
    """Where a trainer's JAX runs: the platform every knob's effect is judged on."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


@dataclass(frozen=True)
class Accelerator:
    """Per-chip figures. `ici_link_bytes_per_s` is one link, one direction; `sources` says
    where each figure comes from (a datasheet page, a compiler message, or an assumption)."""

    name: str
    topology_prefix: str
    devices_per_chip: int
    peak_tflops: dict[str, float]
    hbm_bytes_per_chip: float
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float
    ici_links: int
    usable_hbm_per_device: float  # what one device offers a program (compiler limit)
    source: str
    device_kind: str = ""  # prefix of JAX's Device.device_kind for this chip
    host_link_bytes_per_s: float = 64e9  # chip <-> host, one direction
    # Pinned host memory one device may offload activations to (0: none assumed).
    host_offload_per_device: float = 0.0
    # A systolic MXU's side: a matmul holds a (contracted x columns) operand in the array in
    # tiles of this size (0: not a TPU; no tile geometry modelled)
    mxu_width: int = 0
    # Dimensions of one slice's torus (3: tpu7x:4x4x4; 2: v6e:4x4); 0: not a TPU
    torus_rank: int = 0
    # Data center network between slices, per chip, one direction (0: not known)
    dcn_bytes_per_s_per_chip: float = 0.0
    # HBM bytes a chip's SparseCores gather, scatter or relay per second (read and written
    # counted; 0: no SparseCores, their work at the HBM rate)
    sparsecore_bytes_per_s: float = 0.0
    sources: dict[str, str] | None = None

    @property
    def ici_axis_bytes_per_s(self) -> float:
        """What a ring over one torus axis gets per chip: its two links, both directions."""
        return self.ici_link_bytes_per_s * 2 * 2

    @property
    def hbm_bytes_per_device(self) -> float:
        return self.hbm_bytes_per_chip / self.devices_per_chip

    @property
    def sparsecore_bytes_per_s_per_device(self) -> float:
        """What one device's SparseCores gather and scatter a second (read and written); the
        HBM rate where the chip has none."""
        return (self.sparsecore_bytes_per_s or self.hbm_bytes_per_s) / self.devices_per_chip

    def peak_of(self, precision: str) -> float:
        """Peak TFLOP/s of one chip at `precision`; bf16's where the datasheet lists none
        (no fp8 or int8 units: such operands are multiplied at the bf16 rate)."""
        return self.peak_tflops.get(precision, self.peak_tflops["bf16"])

    def peak_flops_per_device(self, precision: str = "bf16") -> float:
        """Peak FLOP/s of one device (TensorCore) at `precision` (bf16 where fp8 is not
        listed)."""
        tflops = self.peak_of(precision)
        return tflops * 1e12 / self.devices_per_chip

    @property
    def hbm_bytes_per_s_per_device(self) -> float:
        return self.hbm_bytes_per_s / self.devices_per_chip

    @property
    def ici_axis_bytes_per_s_per_device(self) -> float:
        """A ring over one torus axis, shared by the chip's devices."""
        return self.ici_axis_bytes_per_s / self.devices_per_chip

    @property
    def host_link_bytes_per_s_per_device(self) -> float:
        return self.host_link_bytes_per_s / self.devices_per_chip

    @property
    def dcn_bytes_per_s_per_device(self) -> float:
        return self.dcn_bytes_per_s_per_chip / self.devices_per_chip

    def intensity_flops_per_ici_byte(self, precision: str = "bf16") -> float:
        """Peak FLOPs per byte over one ICI link, both directions: the guide's 'about 11.5k'
        for TPU7x."""
        return self.peak_of(precision) * 1e12 / (2 * self.ici_link_bytes_per_s)

    def intensity_flops_per_hbm_byte(self, precision: str = "bf16") -> float:
        return self.peak_of(precision) * 1e12 / self.hbm_bytes_per_s


ACCELERATORS: dict[str, Accelerator] = {
    "tpu7x": Accelerator(
        name="TPU7x",
        topology_prefix="tpu7x",
        devices_per_chip=2,
        peak_tflops={"bf16": 2307.0, "fp8": 4614.0},
        hbm_bytes_per_chip=192 * GIB,
        hbm_bytes_per_s=7.38e12,
        ici_link_bytes_per_s=100e9,  # 1200 GB/s bidirectional per chip / 6 links / 2
        ici_links=6,
        usable_hbm_per_device=94.75
        * GIB,  # libtpu: "exceeds available HBM (94.75G)"; XLA's G is GiB
        source="Ironwood datasheet; usable HBM from the TPU compiler's OOM message",
        device_kind="TPU7x",
        mxu_width=256,
        host_offload_per_device=94.5 * GIB,
        torus_rank=3,
        dcn_bytes_per_s_per_chip=100e9 / 8,
        # 2 devices x (2 GiB of rows read + 2 GiB written + 16 MiB of indices) / 4.07 ms
        sparsecore_bytes_per_s=2 * (2 * 2**31 + 2**24) / 4.07e-3,
        sources={
            "sparsecore": "docs.jax.dev/en/latest/pallas/tpu/sparsecore.html ('Benchmark "
            "against TensorCore', measured on TPU 7x): one device's SparseCores (get_tpu_info: "
            "num_cores=2) gather 4,194,304 rows of 512 bytes (2 GiB) in 4.07 ms, 1.06e12 bytes "
            "read and written per second; the TensorCore's gather takes 18.1 ms. Per chip: two "
            "devices, each with its own (assumed from num_cores=2 per device). One figure, for "
            "one row size; applied to every byte the SparseCores move (layout conversions "
            "too, assumed: no other figure is published)",
            "dcn": "docs.cloud.google.com/tpu/docs/tpu7x: data center network (DCN) bandwidth "
            "per chip 100 Gb/s; read as each direction (assumed: the page does not say)",
            "peak_tflops": "docs.cloud.google.com/tpu/docs/tpu7x: 2307 (BF16), 4614 (FP8) per chip",
            "hbm": "docs.cloud.google.com/tpu/docs/tpu7x: 192 GiB, 7380 GB/s per chip",
            "ici": "docs.cloud.google.com/tpu/docs/tpu7x: 1200 GB/s bidirectional ICI per chip; "
            "split over the 6 links of a 3D torus (assumed even)",
            "devices_per_chip": "docs.cloud.google.com/tpu/docs/tpu7x: two TensorCores, each "
            "a JAX device",
            "usable_hbm_per_device": "libtpu's OOM message: 'exceeds available HBM (94.75G)'",
            "host_link": "assumed: PCIe Gen5 x16, 64 GB/s per direction (not in the datasheet)",
            "host_offload_per_device": "assumed: what a published recipe offloads and runs "
            "(tpu-recipes llama3.1-405b 8k: its layer inputs, 94.5 GiB per device compiled "
            "here); the host's memory is not in the datasheet",
            "mxu_width": "JAX's TpuInfo for TPU7x (jax/_src/pallas/mosaic/tpu_info.py, jax "
            "0.10.2): mxu_column_size 256, 2 MXUs per TensorCore",
        },
    ),
    "v5p": Accelerator(
        name="TPU v5p",
        topology_prefix="v5p",
        devices_per_chip=1,
        peak_tflops={"bf16": 459.0, "fp8": 459.0},
        hbm_bytes_per_chip=95 * GIB,
        hbm_bytes_per_s=2.765e12,
        ici_link_bytes_per_s=100e9,
        ici_links=6,
        usable_hbm_per_device=95 * GIB,
        source="v5p datasheet (no fp8 units: fp8 peak = bf16 peak; DCN 50 Gb/s per chip); "
        "MXU width: JAX's TpuInfo",
        device_kind="TPU v5p",
        mxu_width=128,
        torus_rank=3,
        dcn_bytes_per_s_per_chip=50e9 / 8,
    ),
    "v6e": Accelerator(
        name="TPU v6e",
        topology_prefix="v6e",
        devices_per_chip=1,
        peak_tflops={"bf16": 918.0, "fp8": 918.0},
        hbm_bytes_per_chip=32 * GIB,
        hbm_bytes_per_s=1.64e12,
        ici_link_bytes_per_s=112e9,
        ici_links=4,
        usable_hbm_per_device=31.25 * GIB,
        source="v6e datasheet (fp8 peak = bf16 peak for bf16-trained weights; DCN 100 Gb/s per "
        "chip); MXU width: JAX's TpuInfo",
        device_kind="TPU v6",
        mxu_width=256,
        torus_rank=2,
        dcn_bytes_per_s_per_chip=100e9 / 8,
    ),
    "v5e": Accelerator(
        name="TPU v5e",
        topology_prefix="v5e",
        devices_per_chip=1,
        # No fp8 units: fp8 operands are converted and multiplied at the bf16 rate; int8 is
        # the MXU's native low precision.
        peak_tflops={"bf16": 197.0, "fp8": 197.0, "int8": 394.0},
        hbm_bytes_per_chip=16e9,
        hbm_bytes_per_s=819e9,
        ici_link_bytes_per_s=50e9,  # 400 GB/s bidirectional per chip / 4 links / 2
        ici_links=4,
        usable_hbm_per_device=15.75 * GIB,  # JAX on the chip: bytes_limit 15.75 GiB
        source="v5e datasheet; usable HBM as JAX shows it on the chip (docs/facts.md, v5e)",
        device_kind="TPU v5 lite",
        mxu_width=128,
        torus_rank=2,
        dcn_bytes_per_s_per_chip=2 * 100e9 / 8 / 8,
        sources={
            "peak_tflops": "docs.cloud.google.com/tpu/docs/v5e: 197 TFLOPs (bf16), 393 TOPs "
            "(int8; 394 elsewhere on the page's versions) per chip. No fp8 MXU: fp8 is "
            "converted (measured on the chip: fp8 operands 155 TFLOP/s, bf16 169-170)",
            "hbm": "docs.cloud.google.com/tpu/docs/v5e: HBM2 16 GB, 819 GBps per chip",
            "ici": "docs.cloud.google.com/tpu/docs/v5e: 400 GBps bidirectional ICI per chip, "
            "4 ports, 2D torus; split evenly over the ports (assumed)",
            "dcn": "docs.cloud.google.com/tpu/docs/v5e: 2 x 100 Gbps NICs per host of 8 chips",
            "usable_hbm_per_device": "jax.devices()[0].memory_stats()['bytes_limit'] on the "
            "lent chip: 15.75 GiB (shared/docs/V5E.md)",
            "mxu_width": "docs.cloud.google.com/tpu/docs/v5e: four 128x128 MXUs per TensorCore",
        },
    ),
    # GPUs: measured runs only, never compile targets. No fp8 peak until the trainer's fp8
    # path on GPU is measured (docs/facts.md, H200); MFU of an fp8 step there is then unknown.
    "h100": Accelerator(
        name="H100",
        topology_prefix="",
        devices_per_chip=1,
        peak_tflops={"bf16": 989.0},
        hbm_bytes_per_chip=80 * GIB,
        hbm_bytes_per_s=3.35e12,
        ici_link_bytes_per_s=450e9,  # NVLink 4: 900 GB/s both directions
        ici_links=1,
        usable_hbm_per_device=80 * GIB,
        source="H100 SXM datasheet (bf16 dense)",
        device_kind="NVIDIA H100",
    ),
    "h200": Accelerator(
        name="H200",
        topology_prefix="",
        devices_per_chip=1,
        peak_tflops={"bf16": 989.0},
        hbm_bytes_per_chip=141e9,
        hbm_bytes_per_s=4.8e12,
        ici_link_bytes_per_s=450e9,
        ici_links=1,
        usable_hbm_per_device=139 * GIB,  # docs/facts.md, H200: about 139 GiB visible
        source="H200 SXM datasheet (bf16 dense)",
        device_kind="NVIDIA H200",
    ),
}


@dataclass(frozen=True)
class Topology:
    """A TPU compile or run target, `PREFIX:SHAPE` such as `tpu7x:4x4x4`: one slice of
    `accelerator` chips on a torus of `dims`; or `PREFIX:SHAPExN` (`tpu7x:4x4x4x2`: one more
    factor than the accelerator's torus has dimensions), N such slices joined by the data
    center network (multi-slice). The one reader of a target string."""

    target: str
    accelerator: Accelerator
    dims: tuple[int, ...]
    slices: int = 1

    @classmethod
    def parse(cls, target: str) -> Topology:
        """Raises ValueError naming what is wrong and what is known. MaxText's names of a
        slice by its devices (`v5e-16`, `tpu7x-128`) are read as the standard slice of that
        size (`v5e:4x4`, `tpu7x:4x4x4`): the topology libtpu compiles for."""
        named = re.fullmatch(r"([a-z0-9]+)-(\d+)", target)
        if named:
            return cls.parse(standard_slice(named[1], int(named[2])))
        prefix, _, shape = target.partition(":")
        known = {a.topology_prefix: a for a in ACCELERATORS.values() if a.topology_prefix}
        if prefix not in known:
            raise ValueError(
                f"unknown accelerator {prefix!r} in target {target!r}; known: {', '.join(known)}"
            )
        if not shape:
            raise ValueError(f"target {target!r} has no topology (e.g. tpu7x:2x2x1)")
        parts = shape.split("x")
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"target {target!r}: topology {shape!r} must be like 2x2x1")
        sizes = tuple(int(p) for p in parts)
        rank = known[prefix].torus_rank
        if rank and len(sizes) == rank + 1:
            return cls(target, known[prefix], sizes[:-1], sizes[-1])
        if rank and len(sizes) != rank:
            example = "x".join(["2"] * (rank - 1) + ["1"])
            raise ValueError(
                f"target {target!r}: a {known[prefix].name} slice is a {rank}-D torus "
                f"({prefix}:{example}); one more factor counts slices ({prefix}:{example}x2)"
            )
        return cls(target, known[prefix], sizes)

    @property
    def prefix(self) -> str:
        return self.accelerator.topology_prefix

    @property
    def shape(self) -> str:
        """One slice's torus as Ray's `ray.io/tpu-topology` label and libtpu write it: `4x4x4`."""
        return "x".join(map(str, self.dims))

    @property
    def slice_chips(self) -> int:
        return math.prod(self.dims)

    @property
    def chips(self) -> int:
        """Every slice's chips."""
        return self.slice_chips * self.slices

    @property
    def slice_devices(self) -> int:
        return self.slice_chips * self.accelerator.devices_per_chip

    @property
    def devices(self) -> int:
        """JAX devices of every slice: TensorCores, 2 per TPU7x chip."""
        return self.chips * self.accelerator.devices_per_chip


# Standard TPU slice shapes, as libtpu and MaxText's topology table name them: by the rank of
# the accelerator's torus (TPU7x and v5p: 3D; v5e and v6e: 2D).
STANDARD_SHAPES = {
    3: ("1x1x1", "2x1x1", "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
        "8x8x8", "8x8x16", "8x16x16", "16x16x16"),
    2: ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
}  # fmt: skip


def standard_slice(prefix: str, devices: int) -> str:
    """MaxText's `PREFIX-DEVICES` (`tpu7x-128`, `v5e-16`) as our target (`tpu7x:4x4x4`,
    `v5e:4x4`); ValueError when no standard slice has that many devices."""
    known = {a.topology_prefix: a for a in ACCELERATORS.values() if a.topology_prefix}
    if prefix not in known:
        raise ValueError(f"unknown accelerator {prefix!r} in {prefix}-{devices}; known: "
                         f"{', '.join(known)}")  # fmt: skip
    accelerator = known[prefix]
    chips, extra = divmod(devices, accelerator.devices_per_chip)
    shapes = STANDARD_SHAPES[accelerator.torus_rank]
    shape = next((s for s in shapes if math.prod(map(int, s.split("x"))) == chips), None)
    if shape is None or extra or not devices:
        sizes = ", ".join(
            f"{prefix}-{math.prod(map(int, s.split('x'))) * accelerator.devices_per_chip}"
            for s in shapes
        )
        raise ValueError(f"{prefix}-{devices}: no standard {accelerator.name} slice of "
                         f"{devices} devices; standard: {sizes}")  # fmt: skip
    return f"{prefix}:{shape}"


# GPUs a `gpu:N` target may ask for on one host.
MAX_GPUS_PER_HOST = 64


@dataclass(frozen=True)
class Target:
    """Where a space's trials run, as its `target:` says: `local` (the driver host's own
    devices), `gpu:N` (N GPUs of one host of the Ray cluster), or a TPU topology (`topology`,
    e.g. tpu7x:4x4x4). The one reader of a target string; `str()` gives it back."""

    text: str = "local"
    gpus: int | None = None
    topology: Topology | None = None

    @classmethod
    def parse(cls, text: str) -> Target:
        """Raises ValueError naming what is wrong and the forms a target takes."""
        if text == "local":
            return cls()
        prefix, _, count = text.partition(":")
        if prefix == "gpu":
            if not count.isdigit() or not 0 < int(count) <= MAX_GPUS_PER_HOST:
                raise ValueError(f"{text!r}: a GPU target is gpu:N, N GPUs per trial on one host")
            return cls(text, gpus=int(count))
        topology = Topology.parse(text)
        return cls(topology.target, topology=topology)  # MaxText's name, as libtpu's

    def __str__(self) -> str:
        return self.text

    @property
    def is_local(self) -> bool:
        return self.gpus is None and self.topology is None

    @property
    def is_gpu(self) -> bool:
        return self.gpus is not None

    @property
    def is_tpu(self) -> bool:
        return self.topology is not None

    @property
    def tpu(self) -> Topology:
        """The TPU topology of a TPU target (ValueError for local and GPU targets)."""
        if self.topology is None:
            raise ValueError(f"target {self.text!r} is not a TPU topology (e.g. tpu7x:2x2x1)")
        return self.topology

    @property
    def is_multi_slice(self) -> bool:
        return self.topology is not None and self.topology.slices > 1
