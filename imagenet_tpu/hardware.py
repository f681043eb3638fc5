"""The one catalogue of hardware: TPU generations and how their slices are named, chips per host, GPU models, and
each chip's published facts. config.py checks --topology against it and plan/ plans from it, so a name is either
known to both or refused by both.

TPUs: Google Cloud TPU documentation, "TPU versions" and "System architecture" pages (peak bfloat16 FLOP/s, HBM
capacity and bandwidth, inter-chip interconnect). TPU v3's all-reduce bandwidth is Ying et al. 2018's 340 TB/s over a
1,024-chip pod. GPUs: NVIDIA's V100, A100, H100, H200, L40S and A30 datasheets (dense float16/bfloat16 tensor-core
FLOP/s, memory, NVLink), and the reference systems' networks: DGX-1 (4 x 100 Gb/s EDR per 8 GPUs), DGX-2H (8 x EDR
per 16), DGX A100 (8 x 200 Gb/s HDR), DGX H100 (8 x 400 Gb/s NDR); L40S and A30 servers of 200 Gb/s per 2-4 GPUs.
Host cores (physical cores a host gives the input pipeline) are this table's assumptions for typical hosts, not
vendor figures; TPU v2's HBM bandwidth is approximate. Edit the table for the machines you rent.
"""

import typing
from typing import NamedTuple, Optional, Tuple

from imagenet_tpu.errors import ConfigError


class Chip(NamedTuple):
    """One accelerator: ``peak_tflops`` (dense bfloat16/float16), ``hbm_gib`` and ``hbm_tbps`` (memory),
    ``interconnect_gbps`` (bytes/s per chip available to the gradient all-reduce across hosts, GB/s),
    ``local_gbps`` (within a host: NVLink, or the same ICI on TPUs), ``host_cores`` (physical cores per host for
    the input pipeline) and ``chips_per_host`` of the reference system (TPU slices: of multi-host slices)."""
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
    'v6e': Chip('TPU v6e', 918.0, 32.0, 1.64, 448.0, 448.0, 90, 4),
    'V100': Chip('V100 SXM2', 125.0, 16.0, 0.9, 6.25, 150.0, 40, 8),
    'A100': Chip('A100 SXM4 80GB', 312.0, 80.0, 2.039, 25.0, 300.0, 128, 8),
    'H100': Chip('H100 SXM5', 989.0, 80.0, 3.35, 50.0, 450.0, 112, 8),
    'H200': Chip('H200 SXM5', 989.0, 141.0, 4.8, 50.0, 450.0, 112, 8),
    'L40S': Chip('L40S', 362.0, 48.0, 0.864, 12.5, 32.0, 64, 4),
    'A30': Chip('A30', 165.0, 24.0, 0.933, 12.5, 32.0, 32, 4),
}

# TPU slice names: cores in the name for v2, v3, v4 and v5p (2 TensorCores per chip; v4 and v5p show a chip as one
# device), chips for v5e and v6e (one core each). Multi-host slices hold CHIPS[generation].chips_per_host chips per
# host; v5e and v6e slices of up to 8 chips are one host. (Cloud TPU's system architecture pages.)
TPU_GENERATIONS = {'v2': ('cores', 2), 'v3': ('cores', 2), 'v4': ('cores', 2), 'v5p': ('cores', 2),
                   'v5e': ('chips', 1), 'v5litepod': ('chips', 1), 'v6e': ('chips', 1)}
GPU_MODELS = tuple(name for name in CHIPS if name not in TPU_GENERATIONS)     # --topology=[NODESx]GPUSxMODEL


class Topology(typing.NamedTuple):
    """What --topology names: ``chip`` ('v3', 'A100', 'cpu', ...), ``chips``, ``hosts``, and ``replicas`` (TPU
    devices: 2 per chip on v2/v3, 1 on later TPUs; one per GPU; one per logical CPU device)."""
    kind: str          # 'tpu', 'gpu' or 'cpu'
    chip: str
    chips: int
    hosts: int
    replicas: int


def tpu_slice(name: str) -> Tuple[str, int, int]:
    """'v3-1024' -> ('v3', 512 chips, 128 hosts). ConfigError for a name it does not know."""
    generation, _, count = name.strip().lower().partition('-')
    if generation not in TPU_GENERATIONS or not count.isdigit() or int(count) < 1:
        raise ConfigError(f'--topology must name a TPU slice such as v3-1024 or v4-128 (generations: '
                          f'{", ".join(TPU_GENERATIONS)}), or GPUs as 8xH100 or 32x8xA100 (models: '
                          f'{", ".join(GPU_MODELS)}), or cpu; got {name!r}')
    unit, cores_per_chip = TPU_GENERATIONS[generation]
    chips = int(count) // cores_per_chip if unit == 'cores' else int(count)
    if chips < 1 or (unit == 'cores' and int(count) % cores_per_chip):
        raise ConfigError(f'--topology={name}: {generation} slices are named by cores, {cores_per_chip} per chip')
    chips_per_host = CHIPS[generation].chips_per_host
    single_host_chips = 8 if unit == 'chips' else chips_per_host
    hosts = 1 if chips <= single_host_chips else -(-chips // chips_per_host)
    return generation, chips, hosts


def fewest_hosts(name: str) -> int:
    """The fewest hosts the slice or cluster ``name`` can have: what a run checks the hosts it sees against. v5e and
    v6e slices of more than 8 chips come in hosts of 4 chips or of 8 (Cloud TPU's machine types list both), so
    such a slice may show half the hosts tpu_slice plans for."""
    topology = parse_topology(name)
    if topology.kind == 'tpu' and TPU_GENERATIONS[topology.chip][0] == 'chips' and topology.chips > 8:
        return -(-topology.chips // 8)
    return topology.hosts


def parse_topology(name: str) -> Topology:
    """A TPU slice ('v3-1024'), GPUs ('8xH100': one host; '32x8xA100': 32 hosts of 8), or logical CPU devices
    ('cpu': one; '4xcpu', '2x2xcpu': 2 hosts of 2). ConfigError for anything else."""
    parts = name.strip().split('x')
    model = parts[-1]
    counts = parts[:-1]
    if model.lower() == 'cpu' or model.upper() in GPU_MODELS:
        if len(counts) > 2 or not all(count.isdigit() and int(count) > 0 for count in counts):
            raise ConfigError(f'--topology={name}: write GPUs as 8xH100 or 32x8xA100 (hosts x per host x model)')
        hosts, per_host = (1, int(counts[0]) if counts else 1) if len(counts) < 2 else (int(counts[0]), int(counts[1]))
        kind = 'cpu' if model.lower() == 'cpu' else 'gpu'
        chip = 'cpu' if kind == 'cpu' else model.upper()
        return Topology(kind, chip, hosts * per_host, hosts, hosts * per_host)
    generation, chips, hosts = tpu_slice(name)
    replicas = chips * (TPU_GENERATIONS[generation][1] if generation in ('v2', 'v3') else 1)
    return Topology('tpu', generation, chips, hosts, replicas)


def chip(name: str, cpu_peak_tflops: Optional[float] = None, cpu_cores: int = 1) -> Chip:
    """The facts of ``name`` (a TPU generation, a GPU model or 'cpu'); 'cpu' takes the measured peak of this
    machine. ConfigError for a chip the catalogue has no facts for."""
    if name == 'cpu':
        if cpu_peak_tflops is None:
            raise ConfigError('planning for cpu needs the measured peak of this machine')
        return Chip('CPU (this machine)', cpu_peak_tflops, 8.0, 0.02, 10.0, 10.0, cpu_cores, 1)
    if name not in CHIPS:
        raise ConfigError(f'no facts for chip {name!r}; the catalogue knows {", ".join(sorted(CHIPS))} and cpu')
    return CHIPS[name]
