"""Training images/s of our ResNet-50 step against keras.applications' ResNet50 (tf_keras) and tf-models-official's
ResNet-50 (official.vision backbone + classification head), on the same synthetic batch, batch size, image size,
optimizer (momentum SGD, no weight decay) and precision, timed in alternating rounds in one run. Also our network
with LARS and batch_norm.GroupBatchNormalization, to show what they cost.

Every model is trained by the same classifier.Classifier step, so only the networks differ. Each network is built
--instances times (interleaved: ours#1, tf_models_official#1, ours#2, ...) and every copy is timed in every round;
a round's figure of a network is the mean over its copies: identical copies of one network in one process took
steps up to 5% apart, round after round (docs/benchmarks.md S34), so one copy measures its memory as much as its
network. keras.applications'
ResNet50 is v1 (stride on the first 1x1 convolution: 3.86 GMAC per 224x224 image); ours and tf-models-official's
are v1.5 (stride on the 3x3: 4.09 GMAC): besides images/s the ratios are also given per multiply-add
(GMAC-normalised), scaled by (image_size / 224)^2. Peak memory is the process's peak RSS after each model's warm-up
(models are built in order, so each figure bounds that model's addition).

The machine's peak: a float32 matrix product of --peak_size x --peak_size, on the same threads, timed after the
rounds (best of --peak_repeats); each model's achieved FLOP/s (its forward multiply-adds above, times 3 for
forward and backward, 2 FLOPs each, times images/s) is printed as a fraction of it.
The last line printed is one JSON object with all figures. tf-models-official is the `peer` extra (BUILD.md);
without it that model is skipped and said so.

    python tools/benchmarks/benchmark_step.py --image_size=128 --batch_size=32          # this CPU machine
    python tools/benchmarks/benchmark_step.py --image_size=224 --batch_size=256 --precision=mixed_bfloat16 --jit_compile
"""

import json
import resource
import statistics

from absl import app, flags

import step_timing  # pylint: disable=wrong-import-position
import turns  # pylint: disable=wrong-import-position

GMAC_224 = {'ours': 4.09, 'ours_lars_groupbn': 4.09,
            'keras_applications': 3.86,
            'tf_models_official': 4.09}


def define_flags():
    flags.DEFINE_integer('image_size', 128, 'Image side, in pixels (224 on an accelerator).')
    flags.DEFINE_integer('batch_size', 32, 'Images per step.')
    flags.DEFINE_enum('precision', 'float32', ['float32', 'mixed_bfloat16', 'mixed_float16'], 'Compute precision.')
    flags.DEFINE_bool('jit_compile', False, 'XLA-compile every train step.')
    flags.DEFINE_integer('steps', 3, 'Timed steps per round.')
    flags.DEFINE_integer('rounds', 5, 'Alternating rounds.')
    flags.DEFINE_list('models', ['ours', 'keras_applications', 'tf_models_official', 'ours_lars_groupbn'],
                      'Models to time; the first is the base of the ratios.')
    flags.DEFINE_integer('instances', 2, 'Copies of each network, each timed every round; a network\'s figure '
                         'of a round is the mean over its copies.', lower_bound=1)
    flags.DEFINE_integer('peak_size', 2048, 'Side of the square matrices of the peak measurement.')
    flags.DEFINE_integer('peak_repeats', 10, 'Timed matrix products of the peak measurement (0: no peak '
                         'measurement).', lower_bound=0)


def matmul_peak_flops(size: int, repeats: int) -> float:
    """FLOP/s of the best of ``repeats`` float32 [size, size] x [size, size] products (2 size^3 FLOPs each), in
    a tf.function on this process's threads, after one warm-up."""
    import time
    import tensorflow as tf
    a = tf.random.normal([size, size])
    b = tf.random.normal([size, size])
    product = tf.function(lambda a, b: tf.reduce_sum(tf.matmul(a, b)))
    product(a, b).numpy()
    best = float('inf')
    for _ in range(repeats):
        started = time.perf_counter()
        product(a, b).numpy()
        best = min(best, time.perf_counter() - started)
    return 2 * size ** 3 / best


def build_network(name, image_size):
    import tf_keras as keras
    from imagenet_tpu.model import batch_norm
    from imagenet_tpu.model import resnet
    if name == 'ours':
        return resnet.resnet(50, 1000, image_size=image_size)
    if name == 'ours_lars_groupbn':
        return resnet.resnet(50, 1000, image_size=image_size, norm=batch_norm.group_batch_norm_factory(1))
    if name == 'keras_applications':
        return keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3), classes=1000,
                                           classifier_activation=None)
    if name == 'tf_models_official':
        from official.vision.modeling import classification_model
        from official.vision.modeling.backbones import resnet as tfm_resnet
        inputs = keras.layers.InputSpec(shape=[None, image_size, image_size, 3])
        backbone = tfm_resnet.ResNet(model_id=50, input_specs=inputs)
        return classification_model.ClassificationModel(backbone, num_classes=1000, input_specs=inputs)
    raise ValueError(f'unknown model {name!r}')


def build_classifier(name: str, image_size: int, batch_size: int, precision: str = 'float32',
                     jit_compile: bool = False):
    """Network ``name`` (build_network, from seed 0) in the compiled classifier.Classifier step every model
    shares: momentum SGD (LARS for ours_lars_groupbn), with loss scaling under mixed_float16. ImportError when the
    network's package (tf-models-official) is missing."""
    import tf_keras as keras
    from imagenet_tpu import builders
    from imagenet_tpu.model import classifier as classifier_lib
    from imagenet_tpu.optim import lars
    keras.utils.set_random_seed(0)
    with builders.mixed_precision_policy(precision):
        network = build_network(name, image_size)
    optimizer = (lars.LARS(1.0, momentum=0.9, weight_decay=1e-4) if name == 'ours_lars_groupbn'
                 else keras.optimizers.SGD(0.1, momentum=0.9))
    if precision == 'mixed_float16':
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    classifier = classifier_lib.Classifier(network, global_batch_size=batch_size)
    classifier.compile(optimizer=optimizer, jit_compile=jit_compile)
    return classifier


def main(argv):
    del argv
    step_timing.environment()
    f = flags.FLAGS
    from imagenet_tpu.data import input_pipeline
    from imagenet_tpu.config import Config
    config = Config(image_size=f.image_size, global_batch_size=f.batch_size, num_classes=1000,
                    precision=f.precision)
    data = input_pipeline.synthetic_dataset(config)
    runners, peak_rss_mb, skipped = {}, {}, {}
    for copy in (turns.process_names(f.models, f.instances) if f.instances > 1 else f.models):
        name = turns.candidate_of(copy)
        if name in skipped:
            continue
        try:
            classifier = build_classifier(name, f.image_size, f.batch_size, f.precision, f.jit_compile)
        except ImportError as error:
            skipped[name] = f'{type(error).__name__}: {error}'
            print(f'skipping {name}: {skipped[name]} (install the peer extra)')
            continue
        iterator = iter(data)
        print(f'warming up {copy} ({classifier.network.count_params():,} parameters) ...', flush=True)
        step_timing.warm_up(classifier, iterator)
        runners[copy] = (classifier, iterator)
        peak_rss_mb.setdefault(name, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    copies = step_timing.time_rounds(runners, f.steps, f.rounds)
    times = turns.by_candidate(copies)
    if f.instances > 1:
        print('copies: ' + ', '.join(f'{copy} {1000 * statistics.median(values):.0f} ms'
                                     for copy, values in copies.items()))
    base = next(iter(times))
    summary = step_timing.summarize(times, base, f.batch_size)
    summary['instances'] = f.instances
    summary['median_step_ms_by_copy'] = {copy: round(1000 * statistics.median(values), 2)
                                         for copy, values in copies.items()}
    scale = (f.image_size / 224) ** 2
    names = list(times)
    gmac_per_second = {n: summary['images_per_second'][n] * GMAC_224[n] * scale for n in names}
    summary['gmac_per_second'] = {n: round(v, 1) for n, v in gmac_per_second.items()}
    summary[f'gmac_normalised_ratio_to_{base}'] = {n: round(v / gmac_per_second[base], 4)
                                                   for n, v in gmac_per_second.items()}
    # FLOPs of a training image: forward, input and weight gradients (3 x the forward), 2 per multiply-add.
    achieved = {n: summary['images_per_second'][n] * 6 * GMAC_224[n] * 1e9 * scale for n in names}
    summary['achieved_gflops'] = {n: round(v / 1e9, 1) for n, v in achieved.items()}
    peak = matmul_peak_flops(f.peak_size, f.peak_repeats) if f.peak_repeats else None
    if peak:
        summary['matmul_peak_gflops'] = round(peak / 1e9, 1)
        summary['fraction_of_peak'] = {n: round(v / peak, 4) for n, v in achieved.items()}
        print(f'peak: a {f.peak_size} x {f.peak_size} float32 matrix product at {peak / 1e9:.1f} GFLOP/s')
    for name in names:
        of_peak = f', {achieved[name] / peak:.1%} of the peak' if peak else ''
        print(f'{name}: {gmac_per_second[name]:.1f} GMAC/s, {gmac_per_second[name] / gmac_per_second[base]:.3f}x '
              f'{base} per multiply-add; {achieved[name] / 1e9:.1f} GFLOP/s{of_peak}; peak RSS after warm-up '
              f'{peak_rss_mb[name]:,.0f} MB')
    print(json.dumps({'image_size': f.image_size, 'batch_size': f.batch_size, 'precision': f.precision,
                      'jit_compile': f.jit_compile, **summary, 'peak_rss_mb': peak_rss_mb, 'skipped': skipped}))


if __name__ == '__main__':
    define_flags()
    app.run(main)
