"""Batch norm alone, on the maps of a ResNet-50: ours (imagenet_tpu.cpu.batch_norm.BatchNormalization with its CPU kernels) against
Keras's fused BatchNormalization, timed in alternating rounds in one process.

For every distinct input shape of the network's batch-norm layers (batch --batch_size, --image_size pixels) it
times a training-mode forward pass alone, a forward and backward pass (input, gamma and beta gradients) and an
inference pass, as ns per element; the totals weight each shape by the number of layers that have it, so they are
the batch norm's share of one training step. The last line printed is one JSON object with every figure.

    python tools/benchmarks/benchmark_batch_norm.py --image_size=128 --batch_size=32
"""

import collections
import json
import statistics
import time

from absl import app, flags

import step_timing  # pylint: disable=wrong-import-position

_IMAGE_SIZE = flags.DEFINE_integer('image_size', 128, 'Image side, in pixels.')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 32, 'Images per batch.')
_DEPTH = flags.DEFINE_integer('depth', 50, 'ResNet depth whose batch-norm shapes are timed.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed calls per shape, pass and round.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Alternating rounds.')

CANDIDATES = ('keras_fused', 'ours')
PASSES = ('forward', 'forward_backward', 'inference')


def layer_shapes(depth: int, image_size: int, batch_size: int) -> collections.Counter:
    """{(batch, height, width, channels): number of batch-norm layers with that input} of a ResNet."""
    from imagenet_tpu.model import batch_norm
    from imagenet_tpu.model import resnet
    network = resnet.resnet(depth, 1000, image_size=image_size)
    return collections.Counter((batch_size,) + tuple(layer.input.shape[1:])
                               for layer in batch_norm.batch_norm_layers(network))


def passes(layer, x, upstream):
    """{pass: tf.function} for one layer and input."""
    import tensorflow as tf

    @tf.function
    def forward():
        return layer(x, training=True)

    @tf.function
    def forward_backward():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * upstream)
        return tape.gradient(loss, [x, layer.gamma, layer.beta])

    @tf.function
    def inference():
        return layer(x, training=False)
    return {'forward': forward, 'forward_backward': forward_backward, 'inference': inference}


def main(argv):
    del argv
    environment = step_timing.environment()
    import tensorflow as tf
    import tf_keras as keras
    from imagenet_tpu.cpu import batch_norm as cpu_batch_norm
    tf.get_logger().setLevel('ERROR')   # one tf.function per layer and pass: not retracing, whatever TF says
    shapes = layer_shapes(_DEPTH.value, _IMAGE_SIZE.value, _BATCH_SIZE.value)
    print(f'{sum(shapes.values())} batch-norm layers, {len(shapes)} distinct shapes', flush=True)
    functions = {}
    for shape in shapes:
        x = tf.random.normal(shape, mean=1.0)
        upstream = tf.random.normal(shape)
        layers = {'keras_fused': keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5),
                  'ours': cpu_batch_norm.BatchNormalization(cpu_kernels=True, momentum=0.9, epsilon=1e-5)}
        for name, layer in layers.items():
            for kind, function in passes(layer, x, upstream).items():
                tf.nest.map_structure(lambda t: t.numpy(), function())   # trace, warm up
                functions[shape, name, kind] = function
    seconds = collections.defaultdict(list)
    for round_index in range(_ROUNDS.value):
        for shape in shapes:
            for kind in PASSES:
                for name in CANDIDATES:
                    function = functions[shape, name, kind]
                    start = time.perf_counter()
                    for _ in range(_REPEATS.value):
                        result = function()
                    tf.nest.map_structure(lambda t: t.numpy(), result)
                    seconds[shape, name, kind].append((time.perf_counter() - start) / _REPEATS.value)
        print(f'round {round_index + 1}/{_ROUNDS.value} done', flush=True)
    rows, totals = [], {(name, kind): 0.0 for name in CANDIDATES for kind in PASSES}
    for shape, count in sorted(shapes.items(), key=lambda item: -item[0][1]):
        elements = shape[0] * shape[1] * shape[2] * shape[3]
        row = {'shape': list(shape), 'layers': count}
        for kind in PASSES:
            for name in CANDIDATES:
                median = statistics.median(seconds[shape, name, kind])
                row[f'{name}_{kind}_ns_per_element'] = round(median / elements * 1e9, 3)
                totals[name, kind] += median * count
        rows.append(row)
        print(f"{'x'.join(map(str, shape))} ({count} layers): " + ', '.join(
            f"{kind} keras {row[f'keras_fused_{kind}_ns_per_element']:.2f} / ours "
            f"{row[f'ours_{kind}_ns_per_element']:.2f} ns" for kind in PASSES))
    summary = {}
    for kind in PASSES:
        keras_ms, ours_ms = totals['keras_fused', kind] * 1000, totals['ours', kind] * 1000
        summary[kind] = {'keras_fused_ms': round(keras_ms, 1), 'ours_ms': round(ours_ms, 1),
                         'ours/keras_fused': round(ours_ms / keras_ms, 3)}
        print(f'all layers, {kind}: Keras fused {keras_ms:.1f} ms, ours {ours_ms:.1f} ms '
              f'({ours_ms / keras_ms:.3f}x)')
    print(json.dumps({'environment': environment, 'depth': _DEPTH.value, 'image_size': _IMAGE_SIZE.value,
                      'batch_size': _BATCH_SIZE.value, 'totals': summary, 'shapes': rows}))
    return 0


if __name__ == '__main__':
    app.run(main)
