"""One worker of the simulated pod in multi_worker_test.SimulatedPodTest: run by the test with TF_CONFIG, with 2
logical CPU replicas in this process (so 2 workers make 4 replicas on 2 hosts). It writes a JSON report:
  batch_norm  per group size: the largest difference between this worker's GroupBatchNormalization outputs and
              NumPy's batch norm over the replicas of each one's group (all 4 replicas' inputs are known here);
  train       SHA-1 of every training image this worker's replicas received in the first steps;
  eval        SHA-1 of every evaluation image of weight 1 this worker's replicas received, and the weight sum.

    python tests/multiprocess/pod_worker.py REPORT.json DATA_DIR   (with TF_CONFIG set)
"""

import hashlib
import json
import sys

from imagenet_tpu import runtime

tf = runtime.import_tensorflow()
import numpy as np  # noqa: E402

from imagenet_tpu.model import batch_norm
from imagenet_tpu.distribute import strategy as strategy_lib
from imagenet_tpu import builders
from imagenet_tpu.config import Config  # noqa: E402

DEVICES_PER_WORKER = 2
BN_SHAPE = (3, 2, 2, 5)      # per replica: batch 3, 2x2, 5 channels
EPSILON = 1e-3


def replica_input(replica) -> tf.Tensor:
    """Replica r's batch: normal values scaled by r + 1 and shifted by 3r, so every group has its own moments."""
    scale = tf.cast(replica, tf.float32)
    return tf.random.stateless_normal(BN_SHAPE, seed=tf.stack([tf.cast(replica, tf.int64), 7])) * (1 + scale) + 3 * scale


def batch_norm_errors(strategy) -> dict:
    replicas = strategy.num_replicas_in_sync
    inputs = np.stack([replica_input(r).numpy() for r in range(replicas)])
    errors = {}
    for group_size in (2, replicas):
        with strategy.scope():
            layer = batch_norm.GroupBatchNormalization(group_size=group_size, epsilon=EPSILON)
            layer.build((None,) + BN_SHAPE[1:])

        @tf.function
        def step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return replica, layer(replica_input(replica), training=True)

        ids, outputs = strategy.run(step)
        worst = 0.0
        for replica, output in zip(strategy.experimental_local_results(ids), strategy.experimental_local_results(outputs)):
            replica = int(replica)
            first = replica // group_size * group_size
            group = inputs[first:first + group_size].reshape(-1, BN_SHAPE[-1]).astype(np.float64)
            expected = (inputs[replica] - group.mean(0)) / np.sqrt(group.var(0) + EPSILON)
            worst = max(worst, float(np.max(np.abs(output.numpy() - expected))))
        errors[str(group_size)] = worst
    return errors


def digests(tensors) -> list:
    return [hashlib.sha1(image.tobytes()).hexdigest() for tensor in tensors for image in tensor.numpy()]


def main(report_path: str, data_dir: str) -> None:
    strategy = strategy_lib.make_strategy('multi_worker', cpu_devices_per_worker=DEVICES_PER_WORKER)
    config = Config(data_dir=data_dir, num_classes=4, label_offset=1, image_size=16, global_batch_size=8,
                    eval_batch_size=8, num_train_images=48, num_eval_images=20, shuffle_buffer=16, seed=0,
                    deterministic=True)
    report = {'replicas': strategy.num_replicas_in_sync, 'batch_norm': batch_norm_errors(strategy)}
    iterator = iter(builders.build_train_dataset(config, strategy))
    report['train'] = []
    for _ in range(6):                                  # a data epoch of this worker's pipeline
        images, _ = next(iterator)
        report['train'] += digests(strategy.experimental_local_results(images))
    report['eval'], report['eval_weight'] = [], 0.0
    for images, _, weights in builders.build_eval_dataset(config, strategy):
        for local_images, local_weights in zip(strategy.experimental_local_results(images),
                                               strategy.experimental_local_results(weights)):
            kept = local_images.numpy()[local_weights.numpy() == 1]
            report['eval'] += [hashlib.sha1(image.tobytes()).hexdigest() for image in kept]
            report['eval_weight'] += float(local_weights.numpy().sum())
    with open(report_path, 'w') as f:
        json.dump(report, f)


if __name__ == '__main__':
    main(*sys.argv[1:])
