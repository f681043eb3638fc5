"""Our CPU batch norm (imagenet_tpu.cpu.batch_norm) against Keras's fused layer and NumPy."""

import contextlib
import io
import json
import os
import tempfile
import unittest
from unittest import mock

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.cpu import batch_norm as cpu_batch_norm
from imagenet_tpu.cpu import native, tuning
from imagenet_tpu.model import resnet

helpers.use_eight_cpus()

REPLICAS, PER_REPLICA, CHANNELS, EPSILON, MOMENTUM = 8, 4, 5, 1e-3, 0.9


class BatchNormalizationTest(tf.test.TestCase, parameterized.TestCase):
    """cpu_batch_norm.BatchNormalization (its own kernels on CPU) against Keras's fused BatchNormalization."""

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(1)
        # Channel means far from 0 (up to 8 standard deviations), as after a convolution: the variance is a
        # difference of sums of squares.
        self.x = (rng.normal(size=(REPLICAS, PER_REPLICA, 3, 3, CHANNELS)) * 0.5 + np.arange(CHANNELS)).astype(
            np.float32)
        self.upstream = rng.normal(size=self.x.shape).astype(np.float32)
        self.gamma = rng.uniform(0.5, 1.5, CHANNELS).astype(np.float32)
        self.beta = rng.normal(size=CHANNELS).astype(np.float32)

    def make_layers(self, strategy=None, **kwargs):
        """Ours with its kernels, and Keras's, with the same gamma and beta."""
        layers = []
        with (strategy or tf.distribute.get_strategy()).scope():
            for layer in (cpu_batch_norm.BatchNormalization(cpu_kernels=True, momentum=MOMENTUM, epsilon=EPSILON, **kwargs),
                          keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON, **kwargs)):
                layer.build((None, 3, 3, CHANNELS))
                layer.gamma.assign(self.gamma)
                layer.beta.assign(self.beta)
                layers.append(layer)
        return layers

    def test_equals_keras_fused_batch_norm_on_each_replica(self):
        strategy = helpers.mirrored(REPLICAS)
        ours, theirs = [helpers.run_layer(layer, self.x, self.upstream, strategy) for layer in self.make_layers(strategy)]
        for a, b in zip(ours, theirs):   # outputs, input gradients, moving mean, moving variance
            self.assertAllClose(a, b, atol=1e-5, rtol=1e-5)

    def test_matches_numpy_with_keras_moving_statistics(self):
        ours, _ = self.make_layers()
        x, upstream = self.x[0], self.upstream[0]
        with tf.GradientTape() as tape:
            tape.watch(ours.trainable_variables)
            inputs = tf.constant(x)
            tape.watch(inputs)
            y = ours(inputs, training=True)
            loss = tf.reduce_sum(y * upstream)
        dx, dgamma, dbeta = tape.gradient(loss, [inputs, ours.gamma, ours.beta])
        ey, edx, mean, variance = helpers.numpy_batch_norm(x, upstream, self.gamma, self.beta, EPSILON)
        normalized = (x - mean) / np.sqrt(variance + EPSILON)
        self.assertAllClose(y, ey, atol=1e-5, rtol=1e-5)
        self.assertAllClose(dx, edx, atol=1e-5, rtol=1e-5)
        self.assertAllClose(dgamma, (upstream * normalized).sum((0, 1, 2)), atol=1e-4, rtol=1e-5)
        self.assertAllClose(dbeta, upstream.sum((0, 1, 2)), atol=1e-5, rtol=1e-5)
        n = x.size // CHANNELS   # the moving variance averages the unbiased batch variance, as Keras's fused layer
        self.assertAllClose(ours.moving_mean, (1 - MOMENTUM) * mean, atol=1e-6, rtol=1e-5)
        self.assertAllClose(ours.moving_variance, MOMENTUM + (1 - MOMENTUM) * variance * n / (n - 1), rtol=1e-5)
        # Inference normalizes with the moving statistics.
        expected = (x - ours.moving_mean.numpy()) / np.sqrt(ours.moving_variance.numpy() + EPSILON)
        self.assertAllClose(ours(inputs, training=False), self.gamma * expected + self.beta, atol=1e-5, rtol=1e-5)

    def test_gamma_and_beta_gradients_equal_keras(self):
        gradients = []
        for layer in self.make_layers():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(tf.constant(self.x[1]), training=True) * self.upstream[1])
            gradients.append(tape.gradient(loss, [layer.gamma, layer.beta]))
        self.assertAllClose(gradients[0], gradients[1], atol=1e-5, rtol=1e-5)

    @parameterized.parameters(False, True)
    def test_its_kernels_run_on_cpu_and_keras_elsewhere(self, jit_compile):
        ours, theirs = self.make_layers()

        def step(layer):
            @tf.function(jit_compile=jit_compile)
            def train(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = layer(x, training=True)
                    loss = tf.reduce_sum(y * self.upstream[2])
                return y, tape.gradient(loss, x)
            return train

        x = tf.constant(self.x[2])
        ops = lambda layer: {op.type for op in step(layer).get_concrete_function(x).graph.get_operations()}
        self.assertNotIn('FusedBatchNormV3', ops(ours))
        self.assertIn('MatMul', ops(ours))
        self.assertIn('FusedBatchNormV3', ops(theirs))
        self.assertIn('FusedBatchNormV3', ops(cpu_batch_norm.BatchNormalization(cpu_kernels=False)))
        self.assertAllClose(step(ours)(x), step(theirs)(x), atol=1e-5, rtol=1e-5)

    def test_cpu_kernels_by_default_on_a_cpu_machine(self):
        layer = cpu_batch_norm.BatchNormalization()
        layer.build((None, 3, 3, CHANNELS))
        self.assertEqual(layer._use_cpu_kernels, not tf.config.list_physical_devices('GPU'))
        self.assertIsNone(layer.get_config()['cpu_kernels'])   # decided where the layer is built
        with helpers.mirrored(REPLICAS).scope():       # 8 replicas on logical CPU devices
            self.assertEqual(cpu_batch_norm.cpu_only(), not tf.config.list_physical_devices('GPU'))

    def test_replicas_on_accelerators_keep_keras_kernels(self):
        self.assertTrue(cpu_batch_norm.places_on_accelerator(['/job:worker/replica:0/task:0/device:TPU:3']))
        self.assertTrue(cpu_batch_norm.places_on_accelerator(['/device:CPU:0', '/device:GPU:0']))
        self.assertFalse(cpu_batch_norm.places_on_accelerator(['/job:localhost/replica:0/task:0/device:CPU:0',
                                                           '/job:tpu_worker/replica:0/task:1/device:CPU:0']))

    def test_an_empty_replica_batch_leaves_the_moving_statistics_as_keras_does(self):
        strategy = helpers.mirrored(REPLICAS)
        results = []
        for layer in self.make_layers(strategy):
            # Replica 3's batch is empty (the end of a data set split over replicas).
            inputs = strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(self.x[ctx.replica_id_in_sync_group][
                    :0 if ctx.replica_id_in_sync_group == 3 else None]))
            tf.function(lambda batch, layer=layer: strategy.run(
                lambda images: layer(images, training=True), args=(batch,)))(inputs)
            local = lambda v: np.stack([np.asarray(t) for t in strategy.experimental_local_results(v)])
            results.append((local(layer.moving_mean), local(layer.moving_variance)))
        (ours_mean, ours_variance), (keras_mean, keras_variance) = results
        self.assertAllClose(ours_mean, keras_mean, atol=1e-5, rtol=1e-5)
        self.assertAllClose(ours_variance, keras_variance, atol=1e-5, rtol=1e-5)
        self.assertAllEqual(ours_mean[3], np.zeros(CHANNELS))     # untouched
        self.assertAllEqual(ours_variance[3], np.ones(CHANNELS))

    def test_not_trainable_is_inference_as_in_keras(self):
        layers = self.make_layers()
        for layer in layers:
            layer.moving_mean.assign(self.x[4].mean((0, 1, 2)) + 0.5)
            layer.trainable = False
        x = tf.constant(self.x[4])
        self.assertAllClose(layers[0](x, training=True), layers[1](x, training=True), atol=1e-5, rtol=1e-5)
        self.assertAllClose(layers[0].moving_mean, layers[1].moving_mean)   # no update either

    @parameterized.named_parameters(
        ('two_dimensional', dict(), (6, CHANNELS)),   # Keras's unfused path: biased moving variance
        ('mixed_bfloat16', dict(dtype='mixed_bfloat16'), (4, 3, 3, CHANNELS)),
        ('not_scaled', dict(scale=False), (4, 3, 3, CHANNELS)))
    def test_everything_else_is_keras(self, arguments, shape):
        layers = [cpu_batch_norm.BatchNormalization(cpu_kernels=True, **arguments),
                  keras.layers.BatchNormalization(**arguments)]
        x = tf.constant(self.x.reshape(-1, CHANNELS)[:np.prod(shape[:-1])].reshape(shape))
        outputs = [layer(x, training=True) for layer in layers]
        self.assertEqual(outputs[0].dtype, outputs[1].dtype)
        self.assertAllClose(outputs[0], outputs[1], atol=1e-6)
        self.assertAllClose(layers[0].moving_variance, layers[1].moving_variance, atol=1e-6)

    def test_a_keras_checkpoint_loads(self):
        from imagenet_tpu.model import resnet
        keras_norm = lambda name, zero: keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=name)
        networks = [resnet.resnet(10, 10, image_size=32, norm=norm)
                    for norm in (keras_norm, resnet.batch_norm_factory())]
        images = tf.constant(np.random.default_rng(2).uniform(size=(2, 32, 32, 3)).astype(np.float32))
        networks[0](images, training=True)   # moving statistics away from their initial values
        path = tf.train.Checkpoint(network=networks[0]).write(os.path.join(self.get_temp_dir(), 'keras'))
        tf.train.Checkpoint(network=networks[1]).read(path).assert_consumed()
        self.assertAllClose(networks[1](images, training=False), networks[0](images, training=False),
                            atol=1e-5, rtol=1e-5)


def skip_unless_available(formulation):
    if formulation not in cpu_batch_norm.formulations():
        raise unittest.SkipTest(f'{formulation!r} does not run on this machine (no C++ compiler)')


class FormulationTest(tf.test.TestCase, parameterized.TestCase):
    """The batch norm's training formulations, each against NumPy, and the choice between them by measurement."""

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(4)
        self.x = (rng.normal(size=(4, 6, 6, CHANNELS)) * 0.5 + np.arange(CHANNELS)).astype(np.float32)
        self.upstream = rng.normal(size=self.x.shape).astype(np.float32)
        self.gamma = rng.uniform(0.5, 1.5, CHANNELS).astype(np.float32)
        self.beta = rng.normal(size=CHANNELS).astype(np.float32)

    @parameterized.product(formulation=cpu_batch_norm.FORMULATIONS, relu=cpu_batch_norm.RELUS)
    def test_each_formulation_equals_numpy(self, formulation, relu):
        skip_unless_available(formulation)
        x, gamma, beta = (tf.constant(value) for value in (self.x, self.gamma, self.beta))
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y = cpu_batch_norm.training_output(formulation, x, gamma, beta, EPSILON)
        dx, dgamma, dbeta = tape.gradient(y, [x, gamma, beta], output_gradients=tf.constant(self.upstream))
        ey, edx, mean, variance = helpers.numpy_batch_norm(self.x, self.upstream, self.gamma, self.beta, EPSILON)
        normalized = (self.x - mean) / np.sqrt(variance + EPSILON)
        self.assertAllClose(y, ey, atol=1e-5, rtol=1e-5)
        self.assertAllClose(dx, edx, atol=1e-5, rtol=1e-5)
        self.assertAllClose(dgamma, (self.upstream * normalized).sum((0, 1, 2)), atol=1e-4, rtol=1e-5)
        self.assertAllClose(dbeta, self.upstream.sum((0, 1, 2)), atol=1e-4, rtol=1e-5)
        # What the tuner times: the same forward pass and gradient kernels, called directly; with a ReLU after
        # the batch norm (in our kernel or an op of its own), relu(y) and the gradients of the whole through it.
        timed = cpu_batch_norm.training_step(formulation, x, gamma, beta, tf.constant(self.upstream), EPSILON,
                                             relu=relu)
        if relu:
            positive = ey > 0
            upstream = np.where(positive, self.upstream, 0.0)
            _, edx, _, _ = helpers.numpy_batch_norm(self.x, upstream, self.gamma, self.beta, EPSILON)
            expected = (np.where(positive, ey, 0.0), edx, (upstream * normalized).sum((0, 1, 2)),
                        upstream.sum((0, 1, 2)))
        else:
            expected = (y, dx, dgamma, dbeta)
        for got, want in zip(timed, expected):
            self.assertAllClose(got, want, atol=1e-4, rtol=1e-5)

    def test_measure_times_every_formulation(self):
        seconds = cpu_batch_norm.measure((2, 4, 4, CHANNELS), repeats=1)
        self.assertEqual(tuple(seconds), cpu_batch_norm.formulations())
        self.assertTrue(all(0 < value < 10 for value in seconds.values()), seconds)

    def test_the_choice_follows_the_timings_beyond_the_margin_and_is_kept_per_machine(self):
        # Keras's fused kernel is the one to beat, by the margin.
        self.assertEqual(cpu_batch_norm.fastest({'matmul': 1.0, 'reduce': 0.99, 'fused': 2.0}), 'reduce')
        self.assertEqual(cpu_batch_norm.fastest({'matmul': 1.0, 'reduce': 0.9, 'fused': 0.5}), 'fused')
        self.assertEqual(cpu_batch_norm.fastest({'matmul': 0.98, 'reduce': 2.0, 'fused': 1.0}), 'fused')
        self.assertEqual(cpu_batch_norm.fastest({'matmul': 0.9, 'reduce': 2.0, 'fused': 1.0}), 'matmul')
        self.assertEqual(cpu_batch_norm.fastest({'matmul': 1.0, 'reduce': 0.99, 'fused': 2.0}, 'matmul'), 'matmul')
        shape = (3, 100, 100, 111)          # a shape no other test uses, over MIN_ELEMENTS
        calls = []

        def fake(timings):
            def measure(measured_shape, relu):
                calls.append(measured_shape + ((relu,) if relu else ()))
                return timings
            return measure

        folder = tempfile.mkdtemp(dir=self.get_temp_dir())
        with mock.patch.object(tuning, 'CACHE', tuning.Cache()), \
                mock.patch.dict(os.environ, {tuning.ENVIRONMENT: folder}), \
                mock.patch.dict(cpu_batch_norm._choices, clear=True):
            self.assertEqual(cpu_batch_norm.choose((2, 3, 3, 4), fake({'fused': 0.0, 'matmul': 1.0})), 'matmul')
            self.assertEqual(calls, [])     # too small to time
            self.assertEqual(cpu_batch_norm.choose(shape, fake({'matmul': 1.0, 'reduce': 0.8, 'fused': 0.9}),
                                                   may_measure=False), 'matmul')
            for _ in range(2):
                self.assertEqual(cpu_batch_norm.choose(shape, fake({'matmul': 1.0, 'reduce': 0.8, 'fused': 0.9})),
                                 'reduce')
            self.assertEqual(calls, [shape])
            # Another process of this machine: from the cache, not timed again.
            cpu_batch_norm._choices.clear()
            tuning.CACHE.reset()
            self.assertEqual(cpu_batch_norm.choose(shape, fake({'matmul': 1.0, 'reduce': 2.0, 'fused': 3.0})),
                             'reduce')
            self.assertEqual(calls, [shape])
            # The same maps followed by a ReLU (ours, or Keras's) are choices of their own; Keras's fused kernel
            # stays where the others are not faster by the margin.
            self.assertEqual(cpu_batch_norm.choose(shape, fake({'matmul': 0.98, 'reduce': 0.99, 'fused': 1.0}),
                                                   relu='relu'), 'fused')
            self.assertEqual(cpu_batch_norm.choose(shape, fake({'matmul': 0.9, 'reduce': 0.99, 'fused': 1.0}),
                                                   relu='keras_relu'), 'matmul')
            self.assertEqual(cpu_batch_norm.choose(shape, fake({}), relu=''), 'reduce')
            self.assertEqual(calls, [shape, shape + ('relu',), shape + ('keras_relu',)])
            with open(tuning.CACHE.path) as f:
                self.assertEqual(json.load(f)['entries']['batch_norm'],
                                 {'3,100,100,111': 'reduce', '3,100,100,111,relu': 'fused',
                                  '3,100,100,111,keras_relu': 'matmul'})

    def test_layers_that_feed_only_a_relu_are_timed_with_it(self):
        network = resnet.resnet(50, 10, image_size=32)
        norms = [layer for layer in network.layers if isinstance(layer, cpu_batch_norm.BatchNormalization)]
        followed = {layer.name for layer in norms if cpu_batch_norm.feeds_only_relu(layer)}
        # ResNet-50: the stem's and the first two of each of the 16 bottlenecks' (the third and the projections'
        # go to the residual sum).
        self.assertLen(norms, 53)
        self.assertEqual(followed, {layer.name for layer in norms
                                    if layer.name == 'stem_bn' or layer.name.endswith(('_bn1', '_bn2'))})
        self.assertLen(followed, 33)
        # A ReLU with a ceiling (ReLU6), another activation, or a second consumer: not the fusable ReLU.
        def feeds_only_relu(*consumers):
            inputs = keras.Input((4, 4, 8))
            norm = cpu_batch_norm.BatchNormalization(cpu_kernels=True)
            y = norm(inputs)
            keras.Model(inputs, [consumer(y) for consumer in consumers])
            return cpu_batch_norm.feeds_only_relu(norm)

        self.assertTrue(feeds_only_relu(keras.layers.Activation('relu')))
        self.assertTrue(feeds_only_relu(keras.layers.ReLU(), keras.layers.ReLU()))
        # A ReLU with a ceiling (ReLU6), another activation, or a second consumer: not the fusable ReLU.
        self.assertFalse(feeds_only_relu(keras.layers.ReLU(max_value=6.0)))
        self.assertFalse(feeds_only_relu(keras.layers.Activation('tanh')))
        self.assertFalse(feeds_only_relu(keras.layers.ReLU(), keras.layers.Flatten()))

    def test_the_cache_is_named_by_whether_onednn_runs_not_by_how_it_was_asked_for(self):
        from imagenet_tpu import runtime   # pylint: disable=import-outside-toplevel
        folder = tempfile.mkdtemp(dir=self.get_temp_dir())
        paths = []
        for value in ('1', 'true', ''):
            with mock.patch.dict(os.environ, {tuning.ENVIRONMENT: folder, runtime.ONEDNN_VARIABLE: value}):
                cache = tuning.Cache()
                cache.put('batch_norm', '1,2,3,4', 'fused')
                self.assertIs(cache._machine['onednn'], runtime.onednn_enabled())
                paths.append(cache.path)
        self.assertLen(set(paths), 1)

    def test_a_corrupt_or_foreign_cache_is_ignored_with_one_line(self):
        folder = tempfile.mkdtemp(dir=self.get_temp_dir())
        with mock.patch.dict(os.environ, {tuning.ENVIRONMENT: folder}):
            cache = tuning.Cache()
            cache.put('batch_norm', '1,2,3,4', 'fused')
            path = cache.path
            for content in ('{"format": 1, "machine": {"cpu": "another"}, "entries": {}}', 'not json', '[1, 2]'):
                with open(path, 'w') as f:
                    f.write(content)
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr):
                    self.assertIsNone(tuning.Cache().get('batch_norm', '1,2,3,4'))
                self.assertLen(stderr.getvalue().strip().splitlines(), 1)
                self.assertIn(f'ignoring the tuning cache {path}', stderr.getvalue())
        with mock.patch.dict(os.environ, {tuning.ENVIRONMENT: 'off'}):
            cache = tuning.Cache()
            cache.put('batch_norm', '1,2,3,4', 'fused')
            self.assertIsNone(cache.path)
            self.assertEqual(cache.get('batch_norm', '1,2,3,4'), 'fused')    # kept in this process only

    @parameterized.parameters(*cpu_batch_norm.FORMULATIONS)
    def test_the_layer_with_each_formulation_equals_keras(self, formulation):
        skip_unless_available(formulation)
        layers = [cpu_batch_norm.BatchNormalization(cpu_kernels=True, momentum=MOMENTUM, epsilon=EPSILON),
                  keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON)]
        x = tf.constant(self.x)
        with mock.patch.object(cpu_batch_norm.BatchNormalization, 'formulation', lambda self, shape: formulation):
            results = []
            for layer in layers:
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = layer(x, training=True)
                results.append((y, tape.gradient(y, x, output_gradients=tf.constant(self.upstream)),
                                layer.moving_mean, layer.moving_variance))
        for ours, theirs in zip(*results):
            self.assertAllClose(ours, theirs, atol=1e-5, rtol=1e-5)


class NativeKernelTest(tf.test.TestCase, parameterized.TestCase):
    """Our own kernels (native.py, kernels/batch_norm.cc): the ReLU they apply, the layers around them, what they
    do with bad input, and what happens where they cannot be built."""

    def setUp(self):
        super().setUp()
        skip_unless_available('native')
        rng = np.random.default_rng(7)
        # 300 rows: shards and blocks of rows (64) that do not divide them; channel means far from 0.
        self.x = (rng.normal(size=(3, 10, 10, CHANNELS)) * 0.5 + np.arange(CHANNELS) * 2.0).astype(np.float32)
        self.upstream = rng.normal(size=self.x.shape).astype(np.float32)
        self.gamma = rng.uniform(0.5, 1.5, CHANNELS).astype(np.float32)
        self.beta = rng.normal(size=CHANNELS).astype(np.float32)

    def test_the_relu_and_its_gradient_equal_numpy(self):
        x, gamma, beta = (tf.constant(value) for value in (self.x, self.gamma, self.beta))
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y, mean, variance = cpu_batch_norm.normalize_native(x, gamma, beta, EPSILON, relu=True)
        dx, dgamma, dbeta = tape.gradient(y, [x, gamma, beta], output_gradients=tf.constant(self.upstream))
        ey, _, emean, evariance = helpers.numpy_batch_norm(self.x, self.upstream, self.gamma, self.beta, EPSILON)
        self.assertAllClose(mean, emean, atol=1e-5, rtol=1e-5)
        self.assertAllClose(variance, evariance, atol=1e-5, rtol=1e-5)
        self.assertAllClose(y, np.maximum(ey, 0.0), atol=1e-5, rtol=1e-5)
        # The ReLU's mask is the one of the output the kernel returned (elements at 0 pass no gradient).
        upstream = np.where(y.numpy() > 0, self.upstream, 0.0)
        _, edx, _, _ = helpers.numpy_batch_norm(self.x, upstream, self.gamma, self.beta, EPSILON)
        normalized = (self.x - emean) / np.sqrt(evariance + EPSILON)
        self.assertAllClose(dx, edx, atol=1e-4, rtol=1e-5)
        self.assertAllClose(dgamma, (upstream * normalized).sum((0, 1, 2)), atol=1e-4, rtol=1e-5)
        self.assertAllClose(dbeta, upstream.sum((0, 1, 2)), atol=1e-4, rtol=1e-5)

    def test_resnet_with_our_kernels_equals_keras(self):
        """A whole ResNet-50's loss and gradients with 'native' everywhere (the ReLU after 2 of 3 batch norms in
        each bottleneck applied in our kernel, our ReLU layers passing it on) against Keras's fused batch norm, in
        a tf.function as training runs it. (At batch 2 and 32 px the last stage normalizes 2 values a channel, and
        Keras's formulations differ among themselves by 3%: batch 8 at 64 px.)"""
        network = resnet.resnet(50, 10, image_size=64)
        images = tf.constant(np.random.default_rng(3).normal(size=(8, 64, 64, 3)).astype(np.float32))

        def loss_and_gradients():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(network(images, training=True) ** 2)
            return loss, tape.gradient(loss, network.trainable_variables)

        results, graphs = [], []
        for formulation in ('native', 'fused'):
            with mock.patch.object(cpu_batch_norm.BatchNormalization, 'formulation',
                                   lambda self, shape, formulation=formulation: formulation):
                step = tf.function(loss_and_gradients)
                results.append(step())
                graphs.append([op.type for op in step.get_concrete_function().graph.get_operations()])
        (loss, gradients), (keras_loss, keras_gradients) = results
        self.assertAllClose(loss, keras_loss, rtol=1e-5)
        for ours, theirs in zip(gradients, keras_gradients):     # (zero where a zero gamma stops them)
            self.assertLessEqual(float(tf.norm(ours - theirs)), 1e-3 * float(tf.norm(theirs)) + 1e-6)
        # ResNet-50's 33 ReLUs after a batch norm ran in our kernels: only the 16 bottlenecks' outputs are ReLU
        # ops, forward and backward.
        self.assertEqual(graphs[0].count('ImagenetTpuBatchNorm'), 53)
        self.assertEqual(graphs[0].count('ImagenetTpuBatchNormGrad'), 53)
        self.assertEqual((graphs[0].count('Relu'), graphs[0].count('ReluGrad')), (16, 16))
        self.assertEqual((graphs[1].count('Relu'), graphs[1].count('ReluGrad')), (49, 49))

    def test_a_relu_of_keras_after_our_kernels_still_applies(self):
        inputs = keras.Input((10, 10, CHANNELS))
        norm = cpu_batch_norm.BatchNormalization(cpu_kernels=True, epsilon=EPSILON)
        model = keras.Model(inputs, keras.layers.ReLU()(norm(inputs)))
        self.assertFalse(cpu_batch_norm.feeds_only_relu(norm, cpu_batch_norm.ReLU))
        # The tuner times it with the ReLU op after our kernels, not as if they applied it.
        self.assertEqual(cpu_batch_norm.relu_after(norm), 'keras_relu')
        ours_norm = cpu_batch_norm.BatchNormalization(cpu_kernels=True, epsilon=EPSILON)
        ours = keras.Model(inputs, cpu_batch_norm.ReLU()(ours_norm(inputs)))
        self.assertTrue(cpu_batch_norm.feeds_only_relu(ours_norm, cpu_batch_norm.ReLU))
        self.assertEqual(cpu_batch_norm.relu_after(ours_norm), 'relu')
        for layer in (norm, ours_norm):
            layer.gamma.assign(self.gamma)
            layer.beta.assign(self.beta)
        ey, _, _, _ = helpers.numpy_batch_norm(self.x, self.upstream, self.gamma, self.beta, EPSILON)
        x = tf.constant(self.x)
        with mock.patch.object(cpu_batch_norm.BatchNormalization, 'formulation', lambda self, shape: 'native'):
            # Where a plain ReLU of Keras's takes the output, it is applied twice: the same values.
            self.assertAllClose(tf.function(lambda x: model(x, training=True))(x), np.maximum(ey, 0.0),
                                atol=1e-5, rtol=1e-5)
            # Our ReLU passes on what our kernel rectified, eagerly and in a function.
            self.assertAllClose(ours(x, training=True), np.maximum(ey, 0.0), atol=1e-5, rtol=1e-5)
            self.assertAllClose(tf.function(lambda x: ours(x, training=True))(x), np.maximum(ey, 0.0),
                                atol=1e-5, rtol=1e-5)

    def test_an_empty_batch_gives_nan_statistics_as_keras(self):
        kernels = native.library()
        empty = tf.zeros([0, 4, 4, CHANNELS])
        y, mean, variance = kernels.imagenet_tpu_batch_norm(empty, self.gamma, self.beta, epsilon=EPSILON,
                                                            relu=True)
        _, keras_mean, keras_variance = tf.compat.v1.nn.fused_batch_norm(empty, self.gamma, self.beta,
                                                                          epsilon=EPSILON, is_training=True)
        self.assertEqual(y.shape, empty.shape)
        self.assertAllEqual(np.isnan(mean), np.isnan(keras_mean))
        self.assertTrue(np.isnan(variance).all())
        dx, dgamma, dbeta = kernels.imagenet_tpu_batch_norm_grad(empty, empty, self.gamma, self.beta, mean,
                                                                 variance, epsilon=EPSILON, relu=True)
        self.assertEqual(dx.shape, empty.shape)
        self.assertAllEqual(dgamma, np.zeros(CHANNELS))
        self.assertAllEqual(dbeta, np.zeros(CHANNELS))

    def test_vectors_of_another_size_are_an_error(self):
        kernels = native.library()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r'input 1 must have shape \[5\]'):
            kernels.imagenet_tpu_batch_norm(self.x, self.gamma[:3], self.beta, epsilon=EPSILON, relu=False)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'dy and x must have one shape'):
            kernels.imagenet_tpu_batch_norm_grad(self.x[:1], self.x, self.gamma, self.beta, self.gamma,
                                                 self.gamma, epsilon=EPSILON, relu=False)

    def test_without_a_compiler_one_line_and_tensorflows_formulations(self):
        folder = tempfile.mkdtemp(dir=self.get_temp_dir())
        for environment, message in (({'CXX': 'no-such-compiler-here'}, 'no C++ compiler (no-such-compiler-here)'),
                                     ({native.ENVIRONMENT: 'off'}, None)):
            stderr = io.StringIO()
            with mock.patch.dict(native._state, clear=True), \
                    mock.patch.dict(os.environ, {tuning.ENVIRONMENT: folder, **environment}), \
                    contextlib.redirect_stderr(stderr):
                self.assertIsNone(native.library())
                self.assertIsNone(native.library())       # said once
                self.assertEqual(cpu_batch_norm.formulations(), ('matmul', 'reduce', 'fused'))
            lines = stderr.getvalue().strip().splitlines()
            if message:
                self.assertLen(lines, 1)
                self.assertIn(message, lines[0])
            else:
                self.assertEqual(lines, [])

    def test_a_broken_build_is_one_line_and_a_cached_binary_is_reused(self):
        folder = tempfile.mkdtemp(dir=self.get_temp_dir())
        stderr = io.StringIO()
        with mock.patch.dict(native._state, clear=True), mock.patch.dict(os.environ, {tuning.ENVIRONMENT: folder}), \
                mock.patch.object(native, 'FLAGS', native.FLAGS + ('-DIMAGENET_TPU_NO_SUCH_HEADER',
                                                                   '-include', 'no_such_header.h')), \
                contextlib.redirect_stderr(stderr):
            self.assertIsNone(native.library())
        self.assertIn('failed', stderr.getvalue().strip().splitlines()[-1])
        self.assertEqual([name for name in os.listdir(folder) if name.endswith('.so')], [])   # nothing half-built
        # A binary already in the folder under the machine's name is loaded, not compiled again.
        # (setUp built it into the suite's folder.)
        name = f'native-{native._identity(native._compiler())}.so'
        self.assertTrue(os.path.exists(os.path.join(tuning.folder(), name)))
        with mock.patch.dict(native._state, clear=True), mock.patch.object(native, '_build') as build:
            self.assertIsNotNone(native.library())
        build.assert_not_called()
        # One that does not load (cut short) is built again, once. (The build here writes another file that does
        # not load either: a second copy of the real library in one process would register its kernels twice.)
        with open(os.path.join(folder, name), 'wb') as f:
            f.write(b'not a shared library')
        builds, stderr = [], io.StringIO()

        def build(compiler, path):
            builds.append(path)
            with open(path, 'wb') as f:
                f.write(b'still not a shared library')

        with mock.patch.dict(native._state, clear=True), mock.patch.dict(os.environ, {tuning.ENVIRONMENT: folder}), \
                mock.patch.object(native, '_build', build), contextlib.redirect_stderr(stderr):
            self.assertIsNone(native.library())
        self.assertEqual(builds, [os.path.join(folder, name)])
        lines = stderr.getvalue().strip().splitlines()
        self.assertLen(lines, 2)
        self.assertIn(f'cannot load {os.path.join(folder, name)}', lines[0])
        self.assertIn('compiling it again', lines[0])
        self.assertIn('our CPU kernels are not available (cannot load', lines[1])

    def test_a_cached_native_choice_where_the_kernels_do_not_run_is_timed_again(self):
        shape, calls = (3, 100, 100, 113), []

        def measure(measured_shape, relu):
            calls.append(measured_shape)
            return {'matmul': 0.5, 'reduce': 1.0, 'fused': 1.0}

        folder = tempfile.mkdtemp(dir=self.get_temp_dir())
        with mock.patch.object(tuning, 'CACHE', tuning.Cache()), \
                mock.patch.dict(os.environ, {tuning.ENVIRONMENT: folder}), \
                mock.patch.dict(cpu_batch_norm._choices, clear=True):
            tuning.CACHE.put('batch_norm', '3,100,100,113', 'native')
            self.assertEqual(cpu_batch_norm.choose(shape, measure), 'native')
            self.assertEqual(calls, [])
            cpu_batch_norm._choices.clear()
            with mock.patch.object(native, 'available', lambda: False):
                self.assertEqual(cpu_batch_norm.choose(shape, measure), 'matmul')
            self.assertEqual(calls, [shape])


if __name__ == '__main__':
    tf.test.main()
