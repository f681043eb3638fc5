"""Published facts of the accelerators the planner knows, per chip, and the networks of their reference systems.

TPUs: Google Cloud TPU documentation, "TPU versions" and "System architecture" pages (peak bfloat16 FLOP/s, HBM
capacity and bandwidth, inter-chip interconnect). TPU v3's all-reduce bandwidth is Ying et al. 2018's 340 TB/s over a
1,024-chip pod. GPUs: NVIDIA's V100, A100, H100, H200, L40S and A30 datasheets (dense float16/bfloat16 tensor-core
FLOP/s, memory, NVLink), and the reference systems' networks: DGX-1 (4 x 100 Gb/s EDR per 8 GPUs), DGX-2H (8 x EDR
per 16), DGX A100 (8 x 200 Gb/s HDR), DGX H100 (8 x 400 Gb/s NDR); L40S and A30 servers of 200 Gb/s per 2-4 GPUs.
Host cores (physical cores a host gives the input pipeline) are this table's assumptions for typical hosts, not
vendor figures; TPU v2's HBM bandwidth is approximate. Edit the table for the machines you rent.
"""

from typing import NamedTuple, Optional

from imagenet_tpu.errors import ConfigError


class Chip(NamedTuple):
    """One accelerator: ``peak_tflops`` (dense bfloat16/float16), ``hbm_gib`` and ``hbm_tbps`` (memory),
    ``interconnect_gbps`` (bytes/s per chip available to the gradient all-reduce across hosts, GB/s),
    ``local_gbps`` (within a host: NVLink, or the same ICI on TPUs), ``host_cores`` (physical cores per host for
    the input pipeline) and ``chips_per_host`` of the reference system."""
    name: str
    peak_tflops: float
    hbm_gib: float
    hbm_tbps: float
    interconnect_gbps: float
    local_gbps: float
    host_cores: int
    chips_per_host: int


CHIPS = {
    'v2': Chip('TPU v2', 45.0, 16.0, 0.6, 62.0, 62.0, 48, 4),
    'v3': Chip('TPU v3', 123.0, 32.0, 0.9, 332.0, 332.0, 48, 4),
    'v4': Chip('TPU v4', 275.0, 32.0, 1.2, 300.0, 300.0, 120, 4),
    'v5e': Chip('TPU v5e', 197.0, 16.0, 0.819, 200.0, 200.0, 56, 4),
    'v5litepod': Chip('TPU v5e', 197.0, 16.0, 0.819, 200.0, 200.0, 56, 4),
    'v5p': Chip('TPU v5p', 459.0, 95.0, 2.765, 600.0, 600.0, 104, 4),
    'V100': Chip('V100 SXM2', 125.0, 16.0, 0.9, 6.25, 150.0, 40, 8),
    'A100': Chip('A100 SXM4 80GB', 312.0, 80.0, 2.039, 25.0, 300.0, 128, 8),
    'H100': Chip('H100 SXM5', 989.0, 80.0, 3.35, 50.0, 450.0, 112, 8),
    'H200': Chip('H200 SXM5', 989.0, 141.0, 4.8, 50.0, 450.0, 112, 8),
    'L40S': Chip('L40S', 362.0, 48.0, 0.864, 12.5, 32.0, 64, 4),
    'A30': Chip('A30', 165.0, 24.0, 0.933, 12.5, 32.0, 32, 4),
}


def chip(name: str, cpu_peak_tflops: Optional[float] = None, cpu_cores: int = 1) -> Chip:
    """The facts of ``name`` (a TPU generation, a GPU model or 'cpu'); 'cpu' takes the measured peak of this
    machine. ConfigError for a chip the planner has no facts for."""
    if name == 'cpu':
        if cpu_peak_tflops is None:
            raise ConfigError('planning for cpu needs the measured peak of this machine')
        return Chip('CPU (this machine)', cpu_peak_tflops, 8.0, 0.02, 10.0, 10.0, cpu_cores, 1)
    if name not in CHIPS:
        raise ConfigError(f'no facts for chip {name!r}; the planner knows {", ".join(sorted(CHIPS))} and cpu')
    return CHIPS[name]
