"""Replica-group batch norm against NumPy batch norm over each group's concatenated batch, on 8 replicas."""


from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.model import batch_norm
from imagenet_tpu.distribute import collectives

helpers.use_eight_cpus()

REPLICAS, PER_REPLICA, CHANNELS, EPSILON, MOMENTUM = 8, 4, 5, 1e-3, 0.9


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
        y, dx, moving_mean, moving_variance = helpers.run_layer(layer, self.x, self.upstream, strategy)
        for group in collectives.group_assignment(REPLICAS, group_size):
            x = np.concatenate(self.x[group])
            up = np.concatenate(self.upstream[group])
            ey, edx, mean, variance = helpers.numpy_batch_norm(x, up, self.gamma, self.beta, EPSILON)
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
        y, dx, moving_mean, _ = helpers.run_layer(layer, x, self.upstream, strategy)
        x32 = x.astype(np.float32)
        for group in collectives.group_assignment(REPLICAS, group_size):
            ey, edx, mean, _ = helpers.numpy_batch_norm(np.concatenate(x32[group]), np.concatenate(self.upstream[group]),
                                                self.gamma, self.beta, EPSILON)
            # Outputs and gradients are bfloat16 (8 bits of mantissa); the statistics are float32.
            self.assertAllClose(np.concatenate(y[group]), ey, atol=0.05, rtol=0.02)
            self.assertAllClose(np.concatenate(dx[group]), edx, atol=0.05, rtol=0.05)
            self.assertAllClose(moving_mean[group[0]], (1 - MOMENTUM) * mean, atol=1e-5, rtol=1e-5)

    def compare_with_keras(self, group_size, **keras_arguments):
        strategy = helpers.mirrored(REPLICAS)
        ours = helpers.run_layer(self.make_layer(strategy, group_size=group_size), self.x, self.upstream, strategy)
        with strategy.scope():
            keras_layer = keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON, **keras_arguments)
            keras_layer.build((None, 3, 3, CHANNELS))
            keras_layer.gamma.assign(self.gamma)
            keras_layer.beta.assign(self.beta)
        theirs = helpers.run_layer(keras_layer, self.x, self.upstream, strategy)
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
        y, _, moving_mean, moving_variance = helpers.run_layer(layer, self.x, self.upstream, strategy)
        everything = self.x.reshape(-1, 3, 3, CHANNELS)
        for replica in range(REPLICAS):   # no momentum: replaced by the whole batch's statistics
            self.assertAllClose(moving_mean[replica], everything.mean((0, 1, 2)), rtol=1e-5)
            self.assertAllClose(moving_variance[replica], everything.var((0, 1, 2)), rtol=1e-4)
        # ... while training still normalized with the group's statistics.
        ey, _, _, _ = helpers.numpy_batch_norm(np.concatenate(self.x[:2]), np.concatenate(self.upstream[:2]),
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
        # Every replica's own copy holds them (not only their mean as read from the host) ...
        for copy in strategy.experimental_local_results(bn.moving_mean):
            self.assertAllClose(copy, features.mean(0), rtol=1e-4, atol=1e-5)
        # ... assigned in one replicated step, traced once: a second evaluation reuses it.
        batch_norm.reestimate_statistics(network, iter(dataset), steps=3, strategy=strategy)
        assign = batch_norm._assign_function(network, strategy)  # pylint: disable=protected-access
        self.assertEqual(assign.experimental_get_tracing_count(), 1)

    def test_outside_a_strategy_it_is_plain_batch_norm(self):
        layer = batch_norm.GroupBatchNormalization(group_size=4, momentum=MOMENTUM, epsilon=EPSILON)
        x = self.x[0]
        reference = keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON)
        self.assertAllClose(layer(x, training=True), reference(x, training=True), atol=1e-5)


if __name__ == '__main__':
    tf.test.main()
