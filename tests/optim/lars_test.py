"""LARS against NumPy implementations of its updates, step by step."""

import os

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.optim import lars
from imagenet_tpu.optim import schedules

helpers.use_eight_cpus()


def lars_numpy(w, g, v, lr, momentum, wd, eeta, eps, nesterov, excluded, variant='mlperf'):
    """One LARS step as written in the papers/MLPerf (and tf-models-official for variant='tfm')."""
    if variant == 'mlperf_v0.6':
        # TensorFlow 1.14's tf.contrib.opt.LARSOptimizer (lars_optimizer.py compute_lr and _apply_dense):
        # scaled_lr = lr * trust, then ApplyMomentum: accum = momentum * accum + g; var -= scaled_lr * accum
        # (Nesterov: var -= scaled_lr * g + scaled_lr * momentum * accum); decay only in the denominator.
        trust = 1.0
        if not excluded:
            w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
            trust = eeta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
        v = momentum * v + g
        w = w - (lr * trust * g + lr * trust * momentum * v if nesterov else lr * trust * v)
        return w, v
    if excluded:
        scaled = lr * g
    elif variant == 'mlperf':
        w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
        trust = eeta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
        scaled = lr * trust * (g + wd * w)
    else:
        decayed = g + wd * w
        w_norm, d_norm = np.linalg.norm(w), np.linalg.norm(decayed)
        trust = eeta * w_norm / d_norm if w_norm > 0 and d_norm > 0 else 1.0
        scaled = lr * trust * decayed
    v = momentum * v + scaled
    w = w - (momentum * v + scaled if nesterov else v)
    return w, v


def gradients_for(step, shapes):
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=s).astype(np.float32) for s in shapes]


class LARSTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        ('plain', 1e-4, False, 'mlperf', 1e-5),
        ('no_weight_decay', 0.0, False, 'mlperf', 0.0),
        ('nesterov', 1e-4, True, 'mlperf', 0.0),
        ('tfm_variant', 5e-4, False, 'tfm', 0.0),
        ('tfm_nesterov', 5e-4, True, 'tfm', 0.0),
        ('mlperf_v06', 1e-4, False, 'mlperf_v0.6', 1e-5),
        ('mlperf_v06_nesterov', 2e-4, True, 'mlperf_v0.6', 0.0),
    )
    def test_five_steps_match_numpy(self, wd, nesterov, variant, eps):
        rng = np.random.default_rng(0)
        kernel0, bias0 = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)
        kernel, bias = tf.Variable(kernel0), tf.Variable(bias0)
        rate = schedules.WarmupPolynomialDecay(2.0, 2, 5)   # the rate changes every step
        optimizer = lars.LARS(rate, momentum=0.9, weight_decay=wd, eeta=0.01, epsilon=eps, nesterov=nesterov,
                              variant=variant)
        expected = [(kernel0, np.zeros_like(kernel0)), (bias0, np.zeros_like(bias0))]
        for step in range(5):
            grads = gradients_for(step, [(3, 4), (4,)])
            optimizer.apply_gradients(zip([tf.constant(g) for g in grads], [kernel, bias]))
            lr = float(rate(step))
            expected = [lars_numpy(w, g, v, lr, 0.9, wd, 0.01, eps, nesterov, excluded=(i == 1), variant=variant)
                        for i, ((w, v), g) in enumerate(zip(expected, grads))]
            self.assertAllClose(kernel, expected[0][0], rtol=1e-5, atol=1e-6)
            self.assertAllClose(bias, expected[1][0], rtol=1e-5, atol=1e-6)

    def test_trust_ratio_is_one_for_zero_weights_or_zero_gradients(self):
        zero_weights, ones = tf.Variable(tf.zeros([2, 2])), tf.ones([2, 2])
        optimizer = lars.LARS(0.5, momentum=0.0, weight_decay=0.0, eeta=0.001)
        optimizer.apply_gradients([(ones, zero_weights)])
        self.assertAllClose(zero_weights, -0.5 * np.ones((2, 2)))  # trust 1, not 0 (which would freeze it)
        weights = tf.Variable(tf.ones([2, 2]))
        lars.LARS(0.5, momentum=0.0, weight_decay=0.0).apply_gradients([(tf.zeros([2, 2]), weights)])
        self.assertAllClose(weights, np.ones((2, 2)))

    def test_default_exclusion_is_batch_norm_and_biases(self):
        model = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Conv2D(2, 3),
                                  keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(2)])
        excluded = sorted(v.name.split('/')[-1].split(':')[0] for v in model.trainable_variables
                          if lars.default_exclusion(v))
        self.assertEqual(excluded, ['beta', 'bias', 'bias', 'gamma'])

    def test_velocities_are_created_under_the_strategy_and_checkpointed(self):
        strategy = helpers.mirrored(2)
        with strategy.scope():
            kernel = tf.Variable(np.ones((2, 3), np.float32))
            optimizer = lars.LARS(0.1, momentum=0.9, eeta=0.01)
            optimizer.build([kernel])
        self.assertIsInstance(optimizer.velocities[0], tf.distribute.DistributedValues)
        strategy.run(lambda: optimizer.apply_gradients([(tf.fill([2, 3], 0.5), kernel)]))
        path = tf.train.Checkpoint(optimizer=optimizer, kernel=kernel).save(os.path.join(self.get_temp_dir(), 'c'))
        fresh_kernel = tf.Variable(np.zeros((2, 3), np.float32))
        fresh = lars.LARS(0.1, momentum=0.9, eeta=0.01)
        fresh.build([fresh_kernel])
        tf.train.Checkpoint(optimizer=fresh, kernel=fresh_kernel).restore(path).assert_consumed()
        self.assertAllClose(fresh.velocities[0], optimizer.velocities[0].values[0])
        self.assertGreater(np.abs(fresh.velocities[0].numpy()).max(), 0)
        self.assertEqual(int(fresh.iterations.numpy()), 1)

    def test_serialization_round_trip(self):
        optimizer = lars.LARS(schedules.WarmupCosineDecay(3.0, 5, 50), momentum=0.95, eeta=0.002,
                              variant='tfm', nesterov=True)
        restored = lars.LARS.from_config(optimizer.get_config())
        self.assertEqual((restored.momentum, restored.eeta, restored.variant, restored.nesterov),
                         (0.95, 0.002, 'tfm', True))

    @pytest.mark.slow
    def test_four_replicas_equal_one_device(self):
        # (Tracing costs a step's graph per replica: 4 show the replica sums as well as 8 and cost half.)
        config = helpers.tiny_config(optimizer='lars', learning_rate=2.0, lars_eeta=0.01)
        initial, (single, multi) = helpers.train_same_start(
            [(config, tf.distribute.get_strategy()), (config, helpers.mirrored(4))])
        helpers.assert_same_training(self, single, multi, initial, atol=1e-5, rtol=1e-4, min_change=1e-4)


if __name__ == '__main__':
    tf.test.main()
