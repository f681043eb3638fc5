"""Step time of a ResNet under 8-replica MirroredStrategy with per-replica batch norm against replica groups.

Same network, weights, batch and synthetic data for every variant; timed in alternating rounds in one run. The
baseline is GroupBatchNormalization with group_size=1 (the same layer without a collective); Keras's fused
per-replica BatchNormalization is timed too for reference. Last line: one JSON object with all figures.

    python tools/benchmark_batch_norm.py --depth=50 --image_size=32 --per_replica_batch=8
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import step_timing  # pylint: disable=wrong-import-position


def define_flags():
    flags.DEFINE_integer('depth', 50, 'ResNet depth.')
    flags.DEFINE_integer('image_size', 32, 'Image side, in pixels.')
    flags.DEFINE_integer('replicas', 8, 'Logical CPU devices (replicas).')
    flags.DEFINE_integer('per_replica_batch', 8, 'Images per replica per step.')
    flags.DEFINE_list('group_sizes', ['2', '4', '8'], 'Batch-norm group sizes to time against group size 1.')
    flags.DEFINE_integer('steps', 3, 'Timed steps per round.')
    flags.DEFINE_integer('rounds', 5, 'Alternating rounds.')


def main(argv):
    del argv
    f = flags.FLAGS
    from imagenet_tpu import strategy as strategy_lib
    strategy_lib.use_logical_cpus(f.replicas)
    import tf_keras as keras
    from imagenet_tpu import batch_norm, input_pipeline, resnet, train
    from imagenet_tpu.config import Config
    strategy = strategy_lib.make_strategy('cpu', num_cpu_devices=f.replicas)
    batch = f.per_replica_batch * f.replicas
    config = Config(depth=f.depth, image_size=f.image_size, global_batch_size=batch, num_classes=1000)
    data = strategy.distribute_datasets_from_function(lambda ctx: input_pipeline.synthetic_dataset(config, ctx))
    variants = {'group_1': batch_norm.group_batch_norm_factory(1),
                **{f'group_{g}': batch_norm.group_batch_norm_factory(int(g)) for g in f.group_sizes},
                'keras_fused_per_replica': resnet.batch_norm_factory()}
    keras.utils.set_random_seed(0)
    runners = {}
    for name, norm in variants.items():
        with strategy.scope():
            network = resnet.resnet(f.depth, 1000, image_size=f.image_size, norm=norm)
            classifier = train.Classifier(network, global_batch_size=batch)
            classifier.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        iterator = iter(data)
        print(f'tracing {name} ...', flush=True)
        step_timing.warm_up(classifier, iterator)
        runners[name] = (classifier, iterator)
    times = step_timing.time_rounds(runners, f.steps, f.rounds)
    result = {'depth': f.depth, 'image_size': f.image_size, 'replicas': f.replicas,
              'per_replica_batch': f.per_replica_batch, **step_timing.summarize(times, 'group_1', batch)}
    print(json.dumps(result))


if __name__ == '__main__':
    define_flags()
    app.run(main)
