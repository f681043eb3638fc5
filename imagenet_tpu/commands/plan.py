"""Plans a run before it is paid for: the counts, memory, step time, throughput and time to train of a recipe on a
topology, from the same Config and code as training (imagenet_tpu/plan/).

    imagenet-tpu-plan --flagfile=flags/tpu_v3_4096_bs64k.cfg --topology=v3-8192
    imagenet-tpu-plan --flagfile=flags/tpu_v3_8.cfg --topology=v4-128 --to_accuracy=0.759 --json
    imagenet-tpu-plan --flagfile=flags/gpu_8.cfg --topology=8xH100 --scaling=scaling.png

--topology: a TPU slice (v3-8, v3-1024, v4-128, v5p-256, v5litepod-256), GPUs (8xH100: one host of 8;
32x8xA100: 32 hosts of 8; V100, A100, H100, H200, L40S, A30) or cpu ('cpu', '2x2xcpu': logical devices of this
machine). Besides every training flag:
  --json               print the plan as one JSON object
  --to_accuracy=0.759  also the epochs (MLPerf's reference points) and minutes to 75.9% top-1 at this batch
  --scaling=PATH.png   images/s and time to train against chips for this chip, with the published runs
The model and its calibration against published MLPerf runs: docs/design.md, docs/benchmarks.md.
"""

import json
import sys

if __name__ == '__main__':   # python -m: SIGTERM taken over before TensorFlow starts threads (preemption.py)
    from imagenet_tpu.training import preemption
    preemption.listen()

from imagenet_tpu.commands import common  # first: a quiet TensorFlow start (common.py)
from absl import flags

from imagenet_tpu.errors import RunError
from imagenet_tpu.plan import planner, scaling

common.define_flags()
_JSON = flags.DEFINE_bool('json', False, 'Print the plan as one JSON object.')
_TO_ACCURACY = flags.DEFINE_float('to_accuracy', None, "Also the epochs and minutes to reach this top-1 at the "
                                  "recipe's global batch, from MLPerf's reference convergence points (0.759).")
_SCALING = flags.DEFINE_string('scaling', None, 'Write a PNG here: images/s and time to train against chips for '
                               "this topology's chip, with the published runs on it.")


def describe(result: dict) -> str:
    """The plan as lines for a person."""
    parts = ', '.join(f'{name} {value:.2f}' for name, value in result['step_parts_ms'].items())
    lines = [
        f"{result['topology']}: {result['chips']} x {result['chip']}, {result['replicas']} replicas on "
        f"{result['hosts']} hosts ({result['input_pipelines']} input pipelines)",
        f"batch {result['global_batch']}: {result['per_replica_batch']} per replica; batch norm over "
        f"{result['bn_group_replicas']} replicas = {result['bn_group_images']} images"
        + (f", tiles of {result['bn_group_tile_chips'][0]}x{result['bn_group_tile_chips'][1]} chips"
           if result['bn_group_tile_chips'] else ''),
        f"{result['steps']} steps = {result['epochs']:.1f} epochs, {result['evaluations']} evaluations of "
        f"{result['eval_steps']} steps, {result['steps_per_execution']} steps per host call",
        f"memory per replica {result['memory_gib_per_replica']:.1f} GiB of {result['hbm_gib']:.1f} GiB: "
        f"{'fits' if result['fits'] else 'DOES NOT FIT'} (largest per-replica batch {result['largest_per_replica_batch']})",
        f"step {1e3 * result['step_seconds']:.2f} ms ({parts} ms; all-reduce ring {result['allreduce_ring_ms']:.2f}"
        + (f", torus {result['allreduce_torus_ms']:.2f}" if result['allreduce_torus_ms'] is not None else '')
        + f" ms); bound: {result['bound']}",
        f"{result['images_per_second']:,.0f} images/s, {result['images_per_second_per_chip']:,.0f} per chip; each "
        f"host decodes {result['input_images_per_second_per_host']:,.0f} images/s on "
        f"{result['decode_cores_per_host']:.1f} of its {result['host_cores']} cores",
        f"time to train: {result['minutes_to_train']:.2f} min for the recipe's {result['epochs']:.1f} epochs "
        f"(evaluations {result['evaluation_seconds']:.2f} s each; compilation not counted)",
    ]
    if 'minutes_to_accuracy' in result:
        flag = '' if result['within_reference_points'] else ' (batch outside the reference points: nearest used)'
        lines.append(f"to {100 * result['to_accuracy']:.1f}% top-1: {result['epochs_to_accuracy']:.1f} epochs "
                     f"(MLPerf reference points){flag}, {result['minutes_to_accuracy']:.2f} min")
    return '\n'.join(lines)


def main(argv):
    common.quiet_logs()
    if len(argv) > 1:
        common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
    try:
        config = common.config_from_flags()
        result = planner.plan(config, _TO_ACCURACY.value)
        print(json.dumps(result, indent=2) if _JSON.value else describe(result), flush=True)   # before any write
        if _SCALING.value:
            scaling.draw(config, _SCALING.value, _TO_ACCURACY.value)
    except RunError as error:
        common.fail(str(error), common.exit_status(error))
    if _SCALING.value:
        print(f'wrote {_SCALING.value}', file=sys.stderr)


def run(argv=None):
    """The console script imagenet-tpu-plan."""
    common.run_with_help(main, __doc__, argv)


if __name__ == '__main__':
    run()
