"""Replica-group batch norm against NumPy batch norm over each group's concatenated batch, on 8 replicas; our
CPU batch norm against Keras's fused layer and NumPy."""

import os

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.model import batch_norm
from imagenet_tpu.cpu import batch_norm as cpu_batch_norm
from imagenet_tpu.distribute import collectives

helpers.use_eight_cpus()

REPLICAS, PER_REPLICA, CHANNELS, EPSILON, MOMENTUM = 8, 4, 5, 1e-3, 0.9


def numpy_batch_norm(x, upstream, gamma, beta, epsilon):
    """Output, input gradient of sum(y * upstream), batch mean and (biased) variance over axes 0..2."""
    axes = (0, 1, 2)
    n = np.prod([x.shape[a] for a in axes])
    mean, variance = x.mean(axes), x.var(axes)
    normalized = (x - mean) / np.sqrt(variance + epsilon)
    y = gamma * normalized + beta
    dnormalized = upstream * gamma
    dx = (dnormalized - dnormalized.sum(axes) / n - normalized * (dnormalized * normalized).sum(axes) / n)
    return y, dx / np.sqrt(variance + epsilon), mean, variance


def run_layer(layer, x, upstream, strategy):
    """One training-mode call on each replica: (outputs, input gradients, local moving mean, moving variance)."""
    distributed = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.constant(x[ctx.replica_id_in_sync_group]), tf.constant(upstream[ctx.replica_id_in_sync_group])))

    @tf.function
    def step(inputs):
        def replica_fn(batch, weights):
            with tf.GradientTape() as tape:
                tape.watch(batch)
                y = layer(batch, training=True)
                loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
            return y, tape.gradient(loss, batch)
        return strategy.run(replica_fn, args=inputs)

    y, dx = step(distributed)
    local = lambda v: np.stack([np.asarray(t, np.float32) for t in strategy.experimental_local_results(v)])
    return local(y), local(dx), local(layer.moving_mean), local(layer.moving_variance)


class GroupBatchNormalizationTest(tf.test.TestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(0)
        self.x = (rng.normal(size=(REPLICAS, PER_REPLICA, 3, 3, CHANNELS)) * 2 + 1).astype(np.float32)
        # Different replicas see different data, so per-replica, group and global statistics all differ.
        self.x += np.arange(REPLICAS, dtype=np.float32)[:, None, None, None, None]
        self.upstream = rng.normal(size=self.x.shape).astype(np.float32)
        self.gamma = rng.uniform(0.5, 1.5, CHANNELS).astype(np.float32)
        self.beta = rng.normal(size=CHANNELS).astype(np.float32)

    def make_layer(self, strategy, dtype=None, **kwargs):
        with strategy.scope():
            layer = batch_norm.GroupBatchNormalization(momentum=MOMENTUM, epsilon=EPSILON, dtype=dtype, **kwargs)
            layer.build((None, 3, 3, CHANNELS))
            layer.gamma.assign(self.gamma)
            layer.beta.assign(self.beta)
        return layer

    @parameterized.parameters((1, False), (2, False), (4, False), (8, False), (2, True), (8, True))
    def test_matches_numpy_over_each_group(self, group_size, collective_ops):
        # collective_ops: TensorFlow's ring collectives (multi-worker's) instead of reductions on one device.
        strategy = helpers.mirrored(REPLICAS, collective_ops)
        layer = self.make_layer(strategy, group_size=group_size)
        y, dx, moving_mean, moving_variance = run_layer(layer, self.x, self.upstream, strategy)
        for group in collectives.group_assignment(REPLICAS, group_size):
            x = np.concatenate(self.x[group])
            up = np.concatenate(self.upstream[group])
            ey, edx, mean, variance = numpy_batch_norm(x, up, self.gamma, self.beta, EPSILON)
            self.assertAllClose(np.concatenate(y[group]), ey, atol=1e-4, rtol=1e-4)
            self.assertAllClose(np.concatenate(dx[group]), edx, atol=1e-4, rtol=1e-4)
            for replica in group:
                self.assertAllClose(moving_mean[replica], MOMENTUM * 0 + (1 - MOMENTUM) * mean, atol=1e-5)
                self.assertAllClose(moving_variance[replica], MOMENTUM * 1 + (1 - MOMENTUM) * variance, rtol=1e-4)

    @parameterized.parameters(2, 8)
    def test_matches_numpy_under_mixed_bfloat16(self, group_size):
        strategy = helpers.mirrored(REPLICAS)
        layer = self.make_layer(strategy, dtype='mixed_bfloat16', group_size=group_size)
        x = self.x.astype(tf.bfloat16.as_numpy_dtype)
        y, dx, moving_mean, _ = run_layer(layer, x, self.upstream, strategy)
        x32 = x.astype(np.float32)
        for group in collectives.group_assignment(REPLICAS, group_size):
            ey, edx, mean, _ = numpy_batch_norm(np.concatenate(x32[group]), np.concatenate(self.upstream[group]),
                                                self.gamma, self.beta, EPSILON)
            # Outputs and gradients are bfloat16 (8 bits of mantissa); the statistics are float32.
            self.assertAllClose(np.concatenate(y[group]), ey, atol=0.05, rtol=0.02)
            self.assertAllClose(np.concatenate(dx[group]), edx, atol=0.05, rtol=0.05)
            self.assertAllClose(moving_mean[group[0]], (1 - MOMENTUM) * mean, atol=1e-5, rtol=1e-5)

    def compare_with_keras(self, group_size, **keras_arguments):
        strategy = helpers.mirrored(REPLICAS)
        ours = run_layer(self.make_layer(strategy, group_size=group_size), self.x, self.upstream, strategy)
        with strategy.scope():
            keras_layer = keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON, **keras_arguments)
            keras_layer.build((None, 3, 3, CHANNELS))
            keras_layer.gamma.assign(self.gamma)
            keras_layer.beta.assign(self.beta)
        theirs = run_layer(keras_layer, self.x, self.upstream, strategy)
        for a, b in zip(ours, theirs):   # outputs, input gradients, moving mean, moving variance
            self.assertAllClose(a, b, atol=1e-4, rtol=1e-4)

    def test_group_of_one_equals_keras_batch_norm_on_each_replica(self):
        # fused=False: Keras's fused kernel updates the moving variance with the unbiased (n / (n - 1)) batch
        # variance, its unfused and synchronized paths (and ours, and MLPerf's) with the biased one.
        self.compare_with_keras(1, fused=False)

    def test_group_of_all_equals_keras_synchronized_batch_norm(self):
        self.compare_with_keras(REPLICAS, synchronized=True)

    def test_last_batch_statistics_are_those_of_the_global_batch(self):
        strategy = helpers.mirrored(REPLICAS)
        layer = self.make_layer(strategy, group_size=2, inference_statistics='last_batch')
        y, _, moving_mean, moving_variance = run_layer(layer, self.x, self.upstream, strategy)
        everything = self.x.reshape(-1, 3, 3, CHANNELS)
        for replica in range(REPLICAS):   # no momentum: replaced by the whole batch's statistics
            self.assertAllClose(moving_mean[replica], everything.mean((0, 1, 2)), rtol=1e-5)
            self.assertAllClose(moving_variance[replica], everything.var((0, 1, 2)), rtol=1e-4)
        # ... while training still normalized with the group's statistics.
        ey, _, _, _ = numpy_batch_norm(np.concatenate(self.x[:2]), np.concatenate(self.upstream[:2]),
                                       self.gamma, self.beta, EPSILON)
        self.assertAllClose(np.concatenate(y[:2]), ey, atol=1e-4, rtol=1e-4)
        # Inference uses those statistics.
        with strategy.scope():
            inferred = layer(tf.constant(everything[:4]), training=False)
        expected = (self.gamma * (everything[:4] - everything.mean((0, 1, 2)))
                    / np.sqrt(everything.var((0, 1, 2)) + EPSILON) + self.beta)
        self.assertAllClose(inferred, expected, atol=1e-4, rtol=1e-4)

    def test_reestimated_statistics_pool_k_batches_over_all_replicas(self):
        strategy = helpers.mirrored(REPLICAS)
        with strategy.scope():
            inputs = keras.Input((3, 3, 2))
            hidden = keras.layers.Conv2D(CHANNELS, 1, use_bias=False, name='conv')(inputs)
            outputs = batch_norm.GroupBatchNormalization(group_size=4, inference_statistics='reestimate',
                                                         name='bn')(hidden)
            network = keras.Model(inputs, outputs)
        rng = np.random.default_rng(3)
        batches = rng.normal(size=(3, 16, 3, 3, 2)).astype(np.float32) + np.arange(3)[:, None, None, None, None]
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((batches.reshape(-1, 3, 3, 2), np.zeros(48, np.int32))).batch(16))
        batch_norm.reestimate_statistics(network, iter(dataset), steps=3, strategy=strategy)
        kernel = network.get_layer('conv').kernel.numpy()[0, 0]
        features = batches.reshape(-1, 2) @ kernel            # the BN layer's inputs over all 3 batches
        bn = network.get_layer('bn')
        self.assertAllClose(bn.moving_mean, features.mean(0), rtol=1e-4, atol=1e-5)
        self.assertAllClose(bn.moving_variance, features.var(0), rtol=1e-4, atol=1e-5)

    def test_outside_a_strategy_it_is_plain_batch_norm(self):
        layer = batch_norm.GroupBatchNormalization(group_size=4, momentum=MOMENTUM, epsilon=EPSILON)
        x = self.x[0]
        reference = keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON)
        self.assertAllClose(layer(x, training=True), reference(x, training=True), atol=1e-5)


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
        ours, theirs = [run_layer(layer, self.x, self.upstream, strategy) for layer in self.make_layers(strategy)]
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
        ey, edx, mean, variance = numpy_batch_norm(x, upstream, self.gamma, self.beta, EPSILON)
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


if __name__ == '__main__':
    tf.test.main()
