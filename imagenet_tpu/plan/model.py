"""The cost model of a training run on a topology: one step's parts, memory per replica, images/s, time to train.

Per chip, one step of ``b`` images takes (nothing assumed to overlap, so the sum is an upper bound that the
calibration absorbs):

    compute      b * (training FLOPs / (peak * COMPUTE_EFFICIENCY)  +  activation bytes moved / HBM bandwidth)
    weights      parameters * WEIGHT_BYTES_PER_PARAMETER / HBM bandwidth   (read, update and write every step)
    all-reduce   the gradients' bytes over the interconnect: the 2-D torus or the ring on TPUs (alpha-beta model,
                 ALLREDUCE_HOP_SECONDS per hop), NVLink within a GPU host and the network plus a tree's latency
                 across GPU hosts
    host         STEP_OVERHEAD_SECONDS per host call (launching, round trips, synchronization), shared by the
                 steps_per_execution steps of a call
    input        each host decodes its images at DECODE_IMAGES_PER_SECOND_PER_CORE on its cores; a step waits for
                 the input only where the host cannot keep up (the bound is then the input)

Evaluation runs every eval_every_epochs at a third of the training compute per image, plus the host overhead per
evaluation step. Compilation and start-up are outside the time to train, as MLPerf's run_start/run_stop are.

Two efficiency terms are calibrated on two published runs (COMPUTE_EFFICIENCY, STEP_OVERHEAD_SECONDS:
tools/benchmarks/plan_vs_published.py --fit); everything else is counted from the network or taken from the
chips' published facts (hardware.py). docs/benchmarks.md holds the prediction table against every published run.
"""

import math
from typing import NamedTuple, Optional, Sequence, Tuple

from imagenet_tpu.hardware import Chip

# Calibrated on MLPerf v0.6 Google TPU v3-512 (batch 32,768, 72.0 epochs, 3.853 min) and MLPerf v2.0 NVIDIA
# DGX A100 x 128 (1,024 A100, batch 35,840, 58.4 epochs, 0.555 min): the fit of plan_vs_published.py --fit.
COMPUTE_EFFICIENCY = 0.6825
STEP_OVERHEAD_SECONDS = 0.0022

ACTIVATION_PASSES = 4              # a kept activation: written forward, read backward, its gradient written, read
WEIGHT_BYTES_PER_PARAMETER = 24    # float32 weight read+write (8), momentum read+write (8), gradient (4), copy (4)
ALLREDUCE_HOP_SECONDS = 1e-6       # per hop of a TPU ring or torus (tools/benchmarks/allreduce_cost.py)
GPU_TREE_HOP_SECONDS = 5e-6        # per level of the tree across GPU hosts
BUCKET_BYTES = 32 * 2 ** 20        # collectives.DEFAULT_BUCKET_BYTES
DECODE_IMAGES_PER_SECOND_PER_CORE = 1100.0   # decode_and_crop_jpeg of ImageNet-like JPEGs (docs/benchmarks.md)
EVAL_COMPUTE_SHARE = 1 / 3         # inference is the forward pass of training's three

# Epochs to 75.9% top-1 by global batch: MLPerf's reference convergence points, the mean over 10-28 seeds each,
# mlcommons/logging mlperf_logging/rcp_checker/training_4.0.0/rcps_resnet.json.
REFERENCE_EPOCHS = ((1632, 35.0), (3264, 35.2), (4096, 40.0), (8192, 42.0), (13056, 45.4), (32768, 56.0),
                    (49152, 68.0), (58880, 79.9), (65536, 84.5), (67840, 85.857))
REFERENCE_ACCURACY = 0.759


def ring_seconds(chips: int, message_bytes: float, buckets: int, hop_seconds: float, bandwidth: float) -> float:
    """Ring all-reduce of ``message_bytes`` over ``chips`` in ``buckets``: latency 2 (N - 1) hops per bucket plus
    the bandwidth term 2 (N - 1) / N * S / B (``bandwidth`` bytes/s per chip)."""
    return buckets * 2 * (chips - 1) * hop_seconds + 2 * (chips - 1) / chips * message_bytes / bandwidth


def torus_seconds(mesh: Sequence[int], message_bytes: float, buckets: int, hop_seconds: float,
                  bandwidth: float) -> float:
    """All-reduce on a torus of ``mesh`` chips (X x Y, or X x Y x Z), one dimension after the other (Ying et
    al.'s 2-D algorithm, and its 3-D form): 2 (X - 1 + Y - 1 [+ Z - 1]) hops per bucket, the ring's bandwidth
    term."""
    chips = math.prod(mesh)
    hops = 2 * sum(side - 1 for side in mesh)
    return buckets * hops * hop_seconds + 2 * (chips - 1) / chips * message_bytes / bandwidth


def torus_shape(chips: int, dimensions: int) -> Tuple[int, ...]:
    """The most even ``dimensions``-dimensional torus of ``chips`` (largest side first): 4096, 3 -> (16, 16, 16)."""
    best = None
    for shape in _factorizations(chips, dimensions):
        spread = max(shape) - min(shape)
        if best is None or spread < best[0]:
            best = (spread, tuple(sorted(shape, reverse=True)))
    return best[1]


def _factorizations(number: int, parts: int):
    if parts == 1:
        yield (number,)
        return
    for first in range(1, number + 1):
        if number % first == 0:
            for rest in _factorizations(number // first, parts - 1):
                yield (first,) + rest


def epochs_to_accuracy(global_batch: int) -> Tuple[float, bool]:
    """(epochs to 75.9% top-1 at ``global_batch``, whether the batch lies within the reference points): linear
    between the two nearest points; outside them the nearest point's epochs."""
    batches = [batch for batch, _ in REFERENCE_EPOCHS]
    if global_batch <= batches[0]:
        return REFERENCE_EPOCHS[0][1], global_batch == batches[0]
    if global_batch >= batches[-1]:
        return REFERENCE_EPOCHS[-1][1], global_batch == batches[-1]
    for (low, low_epochs), (high, high_epochs) in zip(REFERENCE_EPOCHS, REFERENCE_EPOCHS[1:]):
        if low <= global_batch <= high:
            return low_epochs + (global_batch - low) / (high - low) * (high_epochs - low_epochs), True
    raise AssertionError('unreachable')


class StepParts(NamedTuple):
    """Seconds of one training step, by part (StepParts.total adds them; ``input`` counts only as a bound)."""
    compute: float
    weights: float
    allreduce: float
    host: float
    input: float

    @property
    def total(self) -> float:
        return max(self.compute + self.weights + self.allreduce + self.host, self.input)

    @property
    def bound(self) -> str:
        """The part that dominates: 'input' when the hosts cannot keep up, else the largest of the others."""
        if self.input > self.compute + self.weights + self.allreduce + self.host:
            return 'input'
        parts = {'compute': self.compute, 'weights (memory)': self.weights, 'all-reduce': self.allreduce,
                 'host round trips': self.host}
        return max(parts, key=parts.get)


def seconds_per_image(chip: Chip, training_flops: float, activations: int, element_bytes: int,
                      efficiency: float = COMPUTE_EFFICIENCY) -> float:
    """Compute time of one training image on ``chip``: its FLOPs at the calibrated share of the peak plus its
    activations' traffic through HBM."""
    return (training_flops / (chip.peak_tflops * 1e12 * efficiency)
            + activations * element_bytes * ACTIVATION_PASSES / (chip.hbm_tbps * 1e12))


def allreduce_seconds(kind: str, chip: Chip, chips: int, hosts: int, gradient_bytes: float,
                      mesh: Optional[Sequence[int]] = None) -> float:
    """The gradient all-reduce of one step: TPUs over the 2-D torus ``mesh`` (chips) or a ring; GPUs over NVLink
    within a host, then the network and a tree's latency across hosts; one chip: none."""
    if chips <= 1:
        return 0.0
    if kind == 'tpu':
        buckets = max(1, math.ceil(gradient_bytes / BUCKET_BYTES))
        bandwidth = chip.interconnect_gbps * 1e9
        if mesh:
            return torus_seconds(mesh, gradient_bytes, buckets, ALLREDUCE_HOP_SECONDS, bandwidth)
        return ring_seconds(chips, gradient_bytes, buckets, ALLREDUCE_HOP_SECONDS, bandwidth)
    if hosts <= 1:
        return 2 * (chips - 1) / chips * gradient_bytes / (chip.local_gbps * 1e9)
    return 2 * gradient_bytes / (chip.interconnect_gbps * 1e9) + 2 * math.log2(hosts) * GPU_TREE_HOP_SECONDS


def step_parts(kind: str, chip: Chip, chips: int, hosts: int, global_batch: int, training_flops: float,
               activations: int, parameters: int, element_bytes: int, gradient_bytes: float,
               mesh: Optional[Sequence[int]] = None, host_cores: Optional[int] = None, steps_per_execution: int = 1,
               efficiency: float = COMPUTE_EFFICIENCY, overhead: float = STEP_OVERHEAD_SECONDS) -> StepParts:
    """One step of ``global_batch`` images over ``chips`` chips on ``hosts`` hosts (see the module docstring)."""
    per_chip = global_batch / chips
    compute = per_chip * seconds_per_image(chip, training_flops, activations, element_bytes, efficiency)
    weights = parameters * WEIGHT_BYTES_PER_PARAMETER / (chip.hbm_tbps * 1e12)
    allreduce = allreduce_seconds(kind, chip, chips, hosts, gradient_bytes, mesh)
    cores = host_cores or chip.host_cores
    input_seconds = global_batch / hosts / (cores * DECODE_IMAGES_PER_SECOND_PER_CORE)
    return StepParts(compute, weights, allreduce, overhead / steps_per_execution, input_seconds)


def evaluation_seconds(chip: Chip, chips: int, eval_images: int, eval_steps: int, training_flops: float,
                       activations: int, element_bytes: int, steps_per_execution: int = 1,
                       efficiency: float = COMPUTE_EFFICIENCY, overhead: float = STEP_OVERHEAD_SECONDS) -> float:
    """One pass over the validation images: the forward pass's share of the compute, and the host overhead of
    each evaluation call."""
    per_image = seconds_per_image(chip, training_flops, activations, element_bytes, efficiency) * EVAL_COMPUTE_SHARE
    return eval_images / chips * per_image + math.ceil(eval_steps / steps_per_execution) * overhead


def minutes_to_train(epochs: float, train_images: int, images_per_second: float, evaluations: int,
                     seconds_per_evaluation: float) -> float:
    return (epochs * train_images / images_per_second + evaluations * seconds_per_evaluation) / 60
