"""The gradient noise scale (McCandlish et al. 2018) against the closed form of linear regression with Gaussian
data, and in the training step: reported when asked for, training unchanged."""

import dataclasses

import numpy as np
import tensorflow as tf

import helpers
from imagenet_tpu import builders
from imagenet_tpu.config import ConfigError
from imagenet_tpu.optim import noise_scale

helpers.use_eight_cpus()


class ClosedFormTest(tf.test.TestCase):
    """Per-example loss (x . w - y)^2 / 2 with x ~ N(0, I_d), y = x . w* + e, e ~ N(0, s^2), at w = w* + delta:
    the per-example gradient is g = x (x . delta - e), so G = E[g] = delta and, by Isserlis' theorem,
    E[g g^T] = (|delta|^2 + s^2) I + 2 delta delta^T: Sigma = (|delta|^2 + s^2) I + delta delta^T,
    tr(Sigma) = d (|delta|^2 + s^2) + |delta|^2 and B_simple = tr(Sigma) / |delta|^2."""

    def test_the_estimates_converge_to_the_closed_form(self):
        dimension, noise, replicas, per_replica = 8, 0.5, 8, 4
        delta = np.random.default_rng(0).normal(size=dimension).astype(np.float32)
        delta /= np.linalg.norm(delta)                      # |delta|^2 = 1
        trace = dimension * (1 + noise ** 2) + 1
        strategy = helpers.mirrored(replicas)
        with strategy.scope():
            estimator = noise_scale.GradientNoiseScale(decay=0.998)

        @tf.function
        def run(steps):
            def replica(step):
                context = tf.distribute.get_replica_context()
                seed = tf.stack([step, tf.cast(context.replica_id_in_sync_group, tf.int64)])
                x = tf.random.stateless_normal([per_replica, dimension], seed)
                e = noise * tf.random.stateless_normal([per_replica], seed + [0, 1000])
                residual = tf.linalg.matvec(x, tf.constant(delta)) - e
                gradient = tf.reduce_mean(residual[:, None] * x, axis=0)     # of this replica's mean loss
                overall = context.all_reduce(tf.distribute.ReduceOp.MEAN, gradient)
                estimator.update([gradient], [overall], per_replica, replicas * per_replica)

            for step in tf.range(steps, dtype=tf.int64):
                strategy.run(replica, args=(step,))

        run(tf.constant(3000, tf.int64))
        result = {name: float(value) for name, value in estimator.result().items()}
        print(f"estimated |G|^2 {result['squared_gradient']:.3f} (exact 1), tr(Sigma) {result['trace']:.2f} "
              f"(exact {trace:.2f}), B_simple {result['noise_scale']:.2f} (exact {trace:.2f})")
        self.assertAllClose(result['squared_gradient'], 1.0, rtol=0.15)
        self.assertAllClose(result['trace'], trace, rtol=0.05)
        self.assertAllClose(result['noise_scale'], trace, rtol=0.15)

    def test_no_resolved_gradient_is_nan_not_a_negative_batch(self):
        # Two replicas whose gradients cancel: the global gradient is 0, the |G|^2 estimate negative.
        strategy = helpers.mirrored(2)
        with strategy.scope():
            estimator = noise_scale.GradientNoiseScale()

        def step():
            context = tf.distribute.get_replica_context()
            sign = tf.cast(2 * context.replica_id_in_sync_group - 1, tf.float32)
            return estimator.update([sign * tf.ones([3])], [tf.zeros([3])], 4, 8)

        result = strategy.experimental_local_results(strategy.run(tf.function(step)))[0]
        self.assertLess(float(result['squared_gradient']), 0.0)
        self.assertAllClose(result['trace'], (1.0 * 3 - 0.0) / (1 / 4 - 1 / 8))     # |G_b|^2 = 3, |G_B|^2 = 0
        self.assertTrue(np.isnan(float(result['noise_scale'])))

    def test_one_batch_size_is_refused(self):
        estimator = noise_scale.GradientNoiseScale()
        with self.assertRaisesRegex(ValueError, 'at least two replicas'):
            estimator.update([tf.ones([2])], [tf.ones([2])], 16, 16)


    def test_an_overflowed_step_is_left_out(self):
        # Two steps of finite gradients, one of infinite ones (a mixed_float16 overflow) between them: the
        # estimates equal those of the two finite steps alone.
        strategy = helpers.mirrored(2)
        with strategy.scope():
            with_overflow, without = noise_scale.GradientNoiseScale(), noise_scale.GradientNoiseScale()

        def step(estimator, scale):
            context = tf.distribute.get_replica_context()
            own = tf.cast(context.replica_id_in_sync_group + 1, tf.float32) * tf.ones([3]) * scale
            return estimator.update([own], [1.5 * tf.ones([3]) * scale], 4, 8)

        for estimator, scales in ((with_overflow, (1.0, float('inf'), 2.0)), (without, (1.0, 2.0))):
            for scale in scales:
                result = strategy.experimental_local_results(
                    strategy.run(tf.function(step), args=(estimator, tf.constant(scale))))[0]
        self.assertEqual(float(with_overflow.steps.numpy()), 2.0)
        for name, value in with_overflow.result().items():
            self.assertAllClose(value, without.result()[name], msg=name)
            self.assertTrue(np.isfinite(float(value)), name)
        del result


class TrainingStepTest(tf.test.TestCase):

    def test_reported_by_the_step_and_training_unchanged(self):
        config = helpers.tiny_config(norm='batch_norm')
        with_noise = dataclasses.replace(config, gradient_noise_scale=True)
        initial, (plain, measured) = helpers.train_same_start([(config, helpers.mirrored(2)),
                                                               (with_noise, helpers.mirrored(2))])
        # The explicit all-reduce the estimate needs sums what the optimizer's own does.
        helpers.assert_same_training(self, plain, measured, initial, atol=1e-6, rtol=1e-5)
        with helpers.mirrored(2).scope():
            classifier = builders.build_classifier(with_noise)
        history = classifier.fit(helpers.equivalence_batches(3), epochs=1, steps_per_epoch=3, verbose=0)
        scale = history.history['noise_scale'][-1]
        # The step's output is the estimator's ratio after the last step (NaN where its |G|^2 is not positive: three
        # steps of random labels on 2 replicas may not resolve it).
        estimate = {name: float(value) for name, value in classifier.noise_scale.result().items()}
        self.assertEqual(classifier.noise_scale.steps.numpy(), 3.0)
        if estimate['squared_gradient'] > 0:
            self.assertAllClose(scale, estimate['trace'] / estimate['squared_gradient'], rtol=1e-5)
        else:
            self.assertTrue(np.isnan(scale), scale)
        with self.assertRaisesRegex(ConfigError, 'needs 2 or more replicas'):
            with helpers.mirrored(1).scope():
                builders.build_classifier(with_noise)
        with self.assertRaisesRegex(ConfigError, 'batch norm over groups of replicas couples them'):
            with helpers.mirrored(2).scope():
                builders.build_classifier(dataclasses.replace(with_noise, bn_group_size=2))
