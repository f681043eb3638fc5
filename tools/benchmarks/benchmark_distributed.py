"""Step time of a ResNet under N-replica MirroredStrategy (logical CPU devices, or GPUs) for distributed
variants, timed in alternating rounds in one run and printed as ratios to the first variant.

Variants:
  bn_group_G            replica-group batch norm (batch_norm.GroupBatchNormalization) over groups of G replicas;
                        bn_group_1 is the same layer without a collective, the baseline for groups
  bn_keras              Keras's fused per-replica BatchNormalization
  allreduce_default     the strategy's own gradient all-reduce (with Keras batch norm)
  allreduce_2d          collectives.all_reduce_2d on the --mesh mesh; allreduce_2d_bf16 sums in bfloat16
Same network, weights, batch and synthetic data for every variant. Last line: one JSON object with all figures.

    python tools/benchmarks/benchmark_distributed.py --variants=bn_group_1,bn_group_2,bn_group_4,bn_group_8,bn_keras
    python tools/benchmarks/benchmark_distributed.py --variants=allreduce_default,allreduce_2d,allreduce_2d_bf16
"""

import json

from absl import app, flags, logging

import step_timing  # pylint: disable=wrong-import-position


def define_flags():
    flags.DEFINE_integer('depth', 50, 'ResNet depth.')
    flags.DEFINE_integer('image_size', 32, 'Image side, in pixels.')
    flags.DEFINE_integer('replicas', 8, 'Logical CPU devices (replicas).')
    flags.DEFINE_integer('per_replica_batch', 8, 'Images per replica per step.')
    flags.DEFINE_list('variants', ['bn_group_1', 'bn_group_2', 'bn_group_4', 'bn_group_8', 'bn_keras'],
                      'What to time; the first is the base of the ratios.')
    flags.DEFINE_string('mesh', '4x2', 'Replica mesh XxY for allreduce_2d.')
    flags.DEFINE_integer('steps', 3, 'Timed steps per round.')
    flags.DEFINE_integer('rounds', 5, 'Alternating rounds.')


def build(variant: str, depth: int, image_size: int, batch: int, mesh):
    """(network, gradient_all_reduce) of one variant; call under the strategy's scope."""
    import tensorflow as tf
    from imagenet_tpu.model import batch_norm
    from imagenet_tpu.distribute import collectives
    from imagenet_tpu.model import resnet
    all_reduce = None
    if variant.startswith('bn_group_'):
        norm = batch_norm.group_batch_norm_factory(int(variant[len('bn_group_'):]))
    elif variant in ('bn_keras', 'allreduce_default', 'allreduce_2d', 'allreduce_2d_bf16'):
        norm = resnet.batch_norm_factory()
        if variant.startswith('allreduce_2d'):
            dtype = tf.bfloat16 if variant.endswith('bf16') else None
            all_reduce = lambda grads: collectives.all_reduce_2d(grads, mesh, dtype=dtype)
    else:
        raise ValueError(f'unknown variant {variant!r}')
    return resnet.resnet(depth, 1000, image_size=image_size, norm=norm), all_reduce


def main(argv):
    del argv
    step_timing.environment()
    logging.set_verbosity(logging.WARNING)   # ReductionToOneDevice logs every reduction it builds at INFO
    f = flags.FLAGS
    from imagenet_tpu.distribute import strategy as strategy_lib
    strategy_lib.use_logical_cpus(f.replicas)
    import tf_keras as keras
    from imagenet_tpu.model import classifier as classifier_lib
    from imagenet_tpu.data import input_pipeline
    from imagenet_tpu.config import Config
    strategy = strategy_lib.make_strategy('cpu', num_cpu_devices=f.replicas)
    batch = f.per_replica_batch * f.replicas
    mesh = tuple(int(v) for v in f.mesh.split('x'))
    config = Config(depth=f.depth, image_size=f.image_size, global_batch_size=batch, num_classes=1000)
    data = strategy.distribute_datasets_from_function(lambda ctx: input_pipeline.synthetic_dataset(config, ctx))
    runners = {}
    for variant in f.variants:
        keras.utils.set_random_seed(0)
        with strategy.scope():
            network, all_reduce = build(variant, f.depth, f.image_size, batch, mesh)
            classifier = classifier_lib.Classifier(network, global_batch_size=batch, gradient_all_reduce=all_reduce)
            classifier.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        iterator = iter(data)
        print(f'tracing {variant} ...', flush=True)
        step_timing.warm_up(classifier, iterator)
        runners[variant] = (classifier, iterator)
    times = step_timing.time_rounds(runners, f.steps, f.rounds)
    result = {'depth': f.depth, 'image_size': f.image_size, 'replicas': f.replicas,
              'per_replica_batch': f.per_replica_batch, **step_timing.summarize(times, f.variants[0], batch)}
    print(json.dumps(result))


if __name__ == '__main__':
    define_flags()
    app.run(main)
