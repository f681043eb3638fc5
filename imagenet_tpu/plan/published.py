"""Published MLPerf Training ResNet-50 results (closed division) of Google and NVIDIA, rounds v0.6 to v4.0, and the
planner's prediction of each: what imagenet-tpu-plan is checked against (docs/benchmarks.md, plan_vs_published).

Read from mlcommons/training_results_v0.6 ... v4.0, ``<org>/results/<system>/resnet/result_0.txt`` ... ``result_4.txt``
(each row names one) and ``<org>/systems/<system>.json``: accelerators = nodes x accelerators per node (TPU chips:
the core count in the name over 2); epochs = the epoch of the last evaluation, averaged over the converged runs;
minutes = MLPerf's score, the mean of the 5 runs' run_stop - run_start without the fastest and the slowest (a run
that did not converge counts as the slowest). Results republished unchanged in a later round (v2.1's DGX A100
rows, v3.1's and v4.0's CoreWeave row) appear once. hosts: GPU nodes (TPU rows: chips / 4, as the planner counts).
"""

import math
from typing import NamedTuple

from imagenet_tpu import hardware
from imagenet_tpu.plan import model
from imagenet_tpu.plan.costs import NetworkCosts


class PublishedRun(NamedTuple):
    round: str
    org: str
    system: str
    chip: str
    accelerators: int
    nodes: int
    global_batch: int
    epochs: float
    minutes: float
    source: str

    @property
    def kind(self) -> str:
        return 'tpu' if self.chip in ('v3', 'v4') else 'gpu'

    @property
    def hosts(self) -> int:
        return max(1, self.accelerators // 4) if self.kind == 'tpu' else self.nodes


RUNS = (
    PublishedRun('v0.6', 'Google', 'tpu-v3-32', 'v3', 16, 1, 4096, 60.8, 42.186, 'mlcommons/training_results_v0.6:Google/results/tpu-v3-32/resnet/result_0.txt'),
    PublishedRun('v0.6', 'Google', 'tpu-v3-128', 'v3', 64, 1, 16384, 64.8, 11.223, 'mlcommons/training_results_v0.6:Google/results/tpu-v3-128/resnet/result_0.txt'),
    PublishedRun('v0.6', 'Google', 'tpu-v3-256', 'v3', 128, 1, 32768, 74.4, 6.864, 'mlcommons/training_results_v0.6:Google/results/tpu-v3-256/resnet/result_0.txt'),
    PublishedRun('v0.6', 'Google', 'tpu-v3-512', 'v3', 256, 1, 32768, 72.0, 3.853, 'mlcommons/training_results_v0.6:Google/results/tpu-v3-512/resnet/result_0.txt'),
    PublishedRun('v0.6', 'Google', 'tpu-v3-1024', 'v3', 512, 1, 32768, 76.0, 2.304, 'mlcommons/training_results_v0.6:Google/results/tpu-v3-1024/resnet/result_0.txt'),
    PublishedRun('v0.6', 'Google', 'tpu-v3-2048', 'v3', 1024, 1, 32768, 72.8, 1.282, 'mlcommons/training_results_v0.6:Google/results/tpu-v3-2048/resnet/result_0.txt'),
    PublishedRun('v0.6', 'NVIDIA', 'dgx1_ngc19.05_mxnet', 'V100', 8, 1, 1664, 59.2, 115.221, 'mlcommons/training_results_v0.6:NVIDIA/results/dgx1_ngc19.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.6', 'NVIDIA', 'dgx2_ngc19.05_mxnet', 'V100', 16, 1, 3328, 60.0, 57.873, 'mlcommons/training_results_v0.6:NVIDIA/results/dgx2_ngc19.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.6', 'NVIDIA', 'dgx2h_ngc19.05_mxnet', 'V100', 16, 1, 3328, 60.8, 52.737, 'mlcommons/training_results_v0.6:NVIDIA/results/dgx2h_ngc19.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.6', 'NVIDIA', 'dgx2h_n32_ngc19.05_mxnet', 'V100', 512, 32, 33280, 72.0, 2.59, 'mlcommons/training_results_v0.6:NVIDIA/results/dgx2h_n32_ngc19.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.6', 'NVIDIA', 'dgx1_n130_ngc19.05_mxnet', 'V100', 1040, 130, 54080, 85.2, 1.691, 'mlcommons/training_results_v0.6:NVIDIA/results/dgx1_n130_ngc19.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.6', 'NVIDIA', 'dgx2h_n96_ngc19.05_mxnet', 'V100', 1536, 96, 59904, 90.0, 1.332, 'mlcommons/training_results_v0.6:NVIDIA/results/dgx2h_n96_ngc19.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.7', 'Google', 'gpu-v100-8-TF2.0', 'V100', 8, 1, 2496, 39.8, 88.556, 'mlcommons/training_results_v0.7:Google/results/gpu-v100-8-TF2.0/resnet/result_0.txt'),
    PublishedRun('v0.7', 'Google', 'tpu-v4-16-TF', 'v4', 8, 1, 2048, 38.0, 30.769, 'mlcommons/training_results_v0.7:Google/results/tpu-v4-16-TF/resnet/result_0.txt'),
    PublishedRun('v0.7', 'Google', 'tpu-v3-32-TF2.0', 'v3', 16, 2, 4096, 38.0, 28.712, 'mlcommons/training_results_v0.7:Google/results/tpu-v3-32-TF2.0/resnet/result_0.txt'),
    PublishedRun('v0.7', 'Google', 'tpu-v4-128-TF', 'v4', 64, 1, 8192, 42.8, 4.496, 'mlcommons/training_results_v0.7:Google/results/tpu-v4-128-TF/resnet/result_0.txt'),
    PublishedRun('v0.7', 'Google', 'tpu-v4-512-TF', 'v4', 256, 1, 8192, 44.0, 1.82, 'mlcommons/training_results_v0.7:Google/results/tpu-v4-512-TF/resnet/result_0.txt'),
    PublishedRun('v0.7', 'Google', 'tpu-v3-8192-JAX', 'v3', 4096, 512, 65536, 91.2, 0.472, 'mlcommons/training_results_v0.7:Google/results/tpu-v3-8192-JAX/resnet/result_0.txt'),
    PublishedRun('v0.7', 'Google', 'tpu-v3-8192-TF', 'v3', 4096, 512, 65536, 87.2, 0.481, 'mlcommons/training_results_v0.7:Google/results/tpu-v3-8192-TF/resnet/result_0.txt'),
    PublishedRun('v0.7', 'NVIDIA', 'dgx1_ngc20.06_mxnet', 'V100', 8, 1, 1664, 36.0, 71.278, 'mlcommons/training_results_v0.7:NVIDIA/results/dgx1_ngc20.06_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.7', 'NVIDIA', 'dgxa100_ngc20.06_mxnet', 'A100', 8, 1, 3264, 41.0, 39.78, 'mlcommons/training_results_v0.7:NVIDIA/results/dgxa100_ngc20.06_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.7', 'NVIDIA', 'dgx2h_ngc20.06_mxnet', 'V100', 16, 1, 3328, 41.0, 35.252, 'mlcommons/training_results_v0.7:NVIDIA/results/dgx2h_ngc20.06_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.7', 'NVIDIA', 'dgxa100_n2_ngc20.06_mxnet', 'A100', 16, 2, 3264, 41.0, 23.753, 'mlcommons/training_results_v0.7:NVIDIA/results/dgxa100_n2_ngc20.06_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.7', 'NVIDIA', 'dgx2h_n32_ngc20.06_mxnet', 'V100', 512, 32, 33280, 56.0, 2.004, 'mlcommons/training_results_v0.7:NVIDIA/results/dgx2h_n32_ngc20.06_mxnet/resnet/result_0.txt'),
    PublishedRun('v0.7', 'NVIDIA', 'dgxa100_n96_ngc20.06_mxnet', 'A100', 768, 96, 34560, 59.0, 1.059, 'mlcommons/training_results_v0.7:NVIDIA/results/dgxa100_n96_ngc20.06_mxnet/resnet/result_0.txt'),
    PublishedRun('v1.0', 'Google', 'tpu-v4-128-TF', 'v4', 64, 16, 8192, 42.0, 4.301, 'mlcommons/training_results_v1.0:Google/results/tpu-v4-128-TF/resnet/result_0.txt'),
    PublishedRun('v1.0', 'Google', 'tpu-v4-4096-TF', 'v4', 2048, 512, 32768, 60.0, 0.285, 'mlcommons/training_results_v1.0:Google/results/tpu-v4-4096-TF/resnet/result_0.txt'),
    PublishedRun('v1.0', 'Google', 'tpu-v4-6912-TF', 'v4', 3456, 864, 55296, 78.4, 0.229, 'mlcommons/training_results_v1.0:Google/results/tpu-v4-6912-TF/resnet/result_0.txt'),
    PublishedRun('v1.0', 'NVIDIA', 'dgxa100_ngc21.05_mxnet', 'A100', 8, 1, 3264, 35.0, 28.771, 'mlcommons/training_results_v1.0:NVIDIA/results/dgxa100_ngc21.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v1.0', 'NVIDIA', 'dgxa100_n8_ngc21.05_mxnet', 'A100', 64, 8, 13056, 45.0, 4.909, 'mlcommons/training_results_v1.0:NVIDIA/results/dgxa100_n8_ngc21.05_mxnet/resnet/result_0.txt'),
    PublishedRun('v1.1', 'NVIDIA', 'dgxa100_ngc21.09_mxnet', 'A100', 8, 1, 3264, 35.0, 29.147, 'mlcommons/training_results_v1.1:NVIDIA/results/dgxa100_ngc21.09_mxnet/resnet/result_0.txt'),
    PublishedRun('v1.1', 'NVIDIA', 'dgxa100_n8_ngc21.09_mxnet', 'A100', 64, 8, 3264, 35.0, 4.534, 'mlcommons/training_results_v1.1:NVIDIA/results/dgxa100_n8_ngc21.09_mxnet/resnet/result_0.txt'),
    PublishedRun('v1.1', 'NVIDIA', 'dgxa100_n128_ngc21.09_mxnet', 'A100', 1024, 128, 35840, 59.2, 0.575, 'mlcommons/training_results_v1.1:NVIDIA/results/dgxa100_n128_ngc21.09_mxnet/resnet/result_0.txt'),
    PublishedRun('v1.1', 'NVIDIA', 'dgxa100_n540_ngc21.09_mxnet', 'A100', 4320, 540, 64800, 85.0, 0.347, 'mlcommons/training_results_v1.1:NVIDIA/results/dgxa100_n540_ngc21.09_mxnet/resnet/result_0.txt'),
    PublishedRun('v2.0', 'Google', 'cloud-tpu-v4-6912-TF', 'v4', 3456, 864, 55296, 80.0, 0.23, 'mlcommons/training_results_v2.0:Google/results/cloud-tpu-v4-6912-TF/resnet/result_0.txt'),
    PublishedRun('v2.0', 'Google', 'cloud-tpu-v4-8192-TF', 'v4', 4096, 1024, 32768, 60.0, 0.191, 'mlcommons/training_results_v2.0:Google/results/cloud-tpu-v4-8192-TF/resnet/result_0.txt'),
    PublishedRun('v2.0', 'NVIDIA', '2xa30_ngc22.04_mxnet', 'A30', 2, 1, 408, 35.0, 235.574, 'mlcommons/training_results_v2.0:NVIDIA/results/2xa30_ngc22.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v2.0', 'NVIDIA', 'dgxa100_ngc22.04_mxnet', 'A100', 8, 1, 3264, 35.0, 28.685, 'mlcommons/training_results_v2.0:NVIDIA/results/dgxa100_ngc22.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v2.0', 'NVIDIA', 'dgxa100_n8_ngc22.04_mxnet', 'A100', 64, 8, 3264, 35.0, 4.503, 'mlcommons/training_results_v2.0:NVIDIA/results/dgxa100_n8_ngc22.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v2.0', 'NVIDIA', 'dgxa100_n128_ngc22.04_mxnet', 'A100', 1024, 128, 35840, 58.4, 0.555, 'mlcommons/training_results_v2.0:NVIDIA/results/dgxa100_n128_ngc22.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v2.0', 'NVIDIA', 'dgxa100_n527_ngc22.04_mxnet', 'A100', 4216, 527, 67456, 86.0, 0.319, 'mlcommons/training_results_v2.0:NVIDIA/results/dgxa100_n527_ngc22.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v2.1', 'NVIDIA', 'dgxh100_preview', 'H100', 8, 1, 3200, 35.0, 14.684, 'mlcommons/training_results_v2.1:NVIDIA/results/dgxh100_preview/resnet/result_0.txt'),
    PublishedRun('v2.1', 'NVIDIA', 'dgxh100_n4_preview', 'H100', 32, 4, 3200, 35.0, 4.489, 'mlcommons/training_results_v2.1:NVIDIA/results/dgxh100_n4_preview/resnet/result_0.txt'),
    PublishedRun('v3.0', 'NVIDIA', 'dgxh100_ngc23.04_mxnet', 'H100', 8, 1, 3200, 35.0, 13.601, 'mlcommons/training_results_v3.0:NVIDIA/results/dgxh100_ngc23.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v3.0', 'NVIDIA', 'dgxh100_n8_ngc23.04_mxnet', 'H100', 64, 8, 3200, 35.0, 2.664, 'mlcommons/training_results_v3.0:NVIDIA/results/dgxh100_n8_ngc23.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v3.0', 'NVIDIA', 'dgxh100_n64_ngc23.04_mxnet', 'H100', 512, 64, 20480, 50.0, 0.509, 'mlcommons/training_results_v3.0:NVIDIA/results/dgxh100_n64_ngc23.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v3.0', 'NVIDIA', 'dgxh100_n96_ngc23.04_mxnet', 'H100', 768, 96, 32256, 56.0, 0.369, 'mlcommons/training_results_v3.0:NVIDIA/results/dgxh100_n96_ngc23.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v3.0', 'NVIDIA_CoreWeave', 'coreweave_hgxh100_n448_ngc23.04_mxnet', 'H100', 3584, 448, 57344, 77.0, 0.183, 'mlcommons/training_results_v3.0:NVIDIA_CoreWeave/results/coreweave_hgxh100_n448_ngc23.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v3.1', 'NVIDIA', 'eos_ngc23.09_mxnet', 'H100', 8, 1, 3200, 35.0, 13.522, 'mlcommons/training_results_v3.1:NVIDIA/results/eos_ngc23.09_mxnet/resnet/result_0.txt'),
    PublishedRun('v3.1', 'NVIDIA', 'eos_n8_ngc23.09_mxnet', 'H100', 64, 8, 3200, 35.0, 2.494, 'mlcommons/training_results_v3.1:NVIDIA/results/eos_n8_ngc23.09_mxnet/resnet/result_0.txt'),
    PublishedRun('v4.0', 'NVIDIA', 'eos_ngc24.04_mxnet', 'H100', 8, 1, 3200, 35.0, 13.27, 'mlcommons/training_results_v4.0:NVIDIA/results/eos_ngc24.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v4.0', 'NVIDIA', 'h200_ngc24.04_mxnet', 'H200', 8, 1, 3200, 35.0, 12.027, 'mlcommons/training_results_v4.0:NVIDIA/results/h200_ngc24.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v4.0', 'NVIDIA', 'l40s_n2_ngc24.04_mxnet', 'L40S', 8, 2, 1600, 35.0, 50.592, 'mlcommons/training_results_v4.0:NVIDIA/results/l40s_n2_ngc24.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v4.0', 'NVIDIA', 'eos_n8_ngc24.04_mxnet', 'H100', 64, 8, 3200, 35.0, 2.506, 'mlcommons/training_results_v4.0:NVIDIA/results/eos_n8_ngc24.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v4.0', 'NVIDIA', 'l40s_n16_ngc24.04_mxnet', 'L40S', 64, 16, 3200, 35.0, 7.149, 'mlcommons/training_results_v4.0:NVIDIA/results/l40s_n16_ngc24.04_mxnet/resnet/result_0.txt'),
    PublishedRun('v4.0', 'NVIDIA', 'eos_n316_ngc24.04_mxnet', 'H100', 2528, 316, 40448, 68.4, 0.228, 'mlcommons/training_results_v4.0:NVIDIA/results/eos_n316_ngc24.04_mxnet/resnet/result_0.txt'),
)
CALIBRATION = (('v0.6', 'tpu-v3-512'), ('v2.0', 'dgxa100_n128_ngc22.04_mxnet'))
MLPERF_EVAL_EVERY_EPOCHS = 4
TPU_STEPS_PER_EXECUTION = 100


def predict_minutes(run: PublishedRun, costs: NetworkCosts, efficiency: float = model.COMPUTE_EFFICIENCY,
                    overhead: float = model.STEP_OVERHEAD_SECONDS) -> float:
    """The planner's time to train for ``run``: its chips, hosts, batch and epochs, ResNet-50 at 224 in 16-bit
    compute, gradients summed in float32 on TPUs (over the torus: 2-D on v3, 3-D on v4, with 100 steps per host
    call, this package's TPU default) and in float16 on GPUs (one step per call), an evaluation every 4 epochs
    with the training batch."""
    chip = hardware.chip(run.chip)
    tpu = run.kind == 'tpu'
    gradient_bytes = costs.parameters * (4 if tpu else 2)
    mesh = model.torus_shape(run.accelerators, 3 if run.chip == 'v4' else 2) if tpu else None
    per_call = TPU_STEPS_PER_EXECUTION if tpu else 1
    parts = model.step_parts(run.kind, chip, run.accelerators, run.hosts, run.global_batch, costs.training_flops,
                             costs.activations, costs.parameters, 2, gradient_bytes, mesh,
                             steps_per_execution=per_call, efficiency=efficiency, overhead=overhead)
    images_per_second = run.global_batch / parts.total
    evaluations = int(run.epochs // MLPERF_EVAL_EVERY_EPOCHS)
    eval_steps = math.ceil(50000 / run.global_batch)
    per_evaluation = model.evaluation_seconds(chip, run.accelerators, 50000, eval_steps, costs.training_flops,
                                              costs.activations, 2, per_call, efficiency, overhead)
    return model.minutes_to_train(run.epochs, 1281167, images_per_second, evaluations, per_evaluation)


def calibration_runs():
    return [run for run in RUNS if (run.round, run.system) in CALIBRATION]


def fit(costs: NetworkCosts):
    """(efficiency, overhead seconds) that make the two calibration runs' predictions closest to their published
    minutes (least squares of the log ratio over a grid: efficiency 0.0025 apart, overhead 0.05 ms apart)."""
    runs = calibration_runs()
    best = None
    for efficiency in (step / 400 for step in range(40, 400)):
        for overhead in (step * 5e-5 for step in range(0, 200)):
            error = sum(math.log(predict_minutes(run, costs, efficiency, overhead) / run.minutes) ** 2
                        for run in runs)
            if best is None or error < best[0]:
                best = (error, efficiency, overhead)
    return best[1], best[2]
