"""The devices a plan is checked against: memory, dense peak, the links between them and the
calibrated efficiencies of the step-time model (planning/step_time.py), in one table.

Memory is what the driver reports; the peak is the vendor's dense bf16 figure; bandwidths are per
device in one direction (NVLink within a node; the network across nodes, one NIC per device);
latencies are per ring step. The efficiencies were fitted to published runs (docs/planning.md,
"The step-time model against published runs" says which rows were fitted and which predicted).
"""

from dataclasses import dataclass, field

from planning.step_time import Efficiency, Links

# The constants benchmarks/step_time_published.py fits (docs/planning.md: which published rows, and
# how the other rows compare).
GPU_EFFICIENCY = Efficiency(compute=0.338, compile=1.157, float8=1.280, comm=0.8, overlap=1.0)
_NVLINK4 = Links(per_node=8, intra_gb_s=450.0, inter_gb_s=50.0, intra_us=5.0, inter_us=15.0)
# What benchmarks/step_time_check.py measures of a CPU (gloo over loopback, the compute efficiency of a
# one-process run; docs/planning.md records the machine and the date); on a CPU FSDP's traffic shares
# the cores with the matmuls, so none of it hides.
CPU_LINKS = Links(per_node=1024, intra_gb_s=1.58, inter_gb_s=1.58, intra_us=1209.0, inter_us=1209.0)
CPU_EFFICIENCY = Efficiency(compute=0.69, comm=1.0, overlap=0.0)


@dataclass(frozen=True)
class Device:
    """What a plan is checked against."""

    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 (or what --peak-tflops says)
    reserve_gib: float = 2.0  # kept free: CUDA context, NCCL buffers, allocator fragmentation
    links: Links = field(default=_NVLINK4)
    efficiency: Efficiency = field(default=GPU_EFFICIENCY)


DEVICES = {
    "h100": Device("H100 SXM 80GB", 79.2, 989.0),
    "h200": Device("H200 141GB", 139.8, 989.0),
    "a100": Device("A100 80GB", 79.1, 312.0, links=Links(8, 300.0, 25.0, 6.0, 20.0)),
    "a100-40": Device("A100 40GB", 39.4, 312.0, links=Links(8, 300.0, 25.0, 6.0, 20.0)),
    "b200": Device("B200 180GB", 178.4, 2250.0, links=Links(8, 900.0, 50.0, 5.0, 15.0)),
    "mi300x": Device("MI300X 192GB", 191.5, 1307.0, links=Links(8, 448.0, 50.0, 8.0, 20.0)),
    "l40s": Device("L40S 48GB", 44.4, 362.0, links=Links(8, 28.0, 25.0, 10.0, 20.0)),
}
