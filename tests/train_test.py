"""Training: the step against a hand-written reference, 1 device vs 8 replicas, schedules, resume."""

import dataclasses
import os
from unittest import mock

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu import input_pipeline, regularization, schedules, train
from imagenet_tpu.config import Config, ConfigError

helpers.use_eight_cpus()

TINY = helpers.tiny_config()


def _batches(count=3, batch=16, size=16, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(count * batch, size, size, 3)).astype(np.float32)
    labels = rng.integers(0, classes, size=count * batch).astype(np.int32)
    return images, labels


class LossTest(tf.test.TestCase):

    def test_smoothed_cross_entropy_matches_keras_builtin(self):
        rng = np.random.default_rng(0)
        logits = rng.normal(size=(6, 10)).astype(np.float32)
        labels = rng.integers(0, 10, size=6)
        reference = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1,
                                                         reduction='none')(tf.one_hot(labels, 10), logits)
        self.assertAllClose(train.smoothed_cross_entropy(labels, logits, 0.1), reference, atol=1e-6)

    def test_weight_decay_skips_batch_norm_and_biases(self):
        model = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Conv2D(2, 3, use_bias=True),
                                  keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(3)])
        decayed = {v.name for v in model.trainable_variables if regularization.is_decayed(v)}
        self.assertEqual({name.split('/')[-1].split(':')[0] for name in decayed}, {'kernel'})
        self.assertLen(decayed, 2)
        expected = 1e-3 / 2 * sum(np.sum(v.numpy() ** 2) for v in model.trainable_variables if 'kernel' in v.name)
        self.assertAllClose(regularization.l2_penalty(model.trainable_variables, 1e-3), expected, rtol=1e-6)


class TrainStepTest(tf.test.TestCase, parameterized.TestCase):

    def test_one_step_equals_hand_computed_sgd(self):
        # Reference: the gradient of mean(smoothed CE) + wd/2 * sum(kernel^2), then one momentum-SGD step
        # (v = g on the first step, w <- w - lr * v), written independently of Classifier.
        network = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, use_bias=True),
                                    keras.layers.BatchNormalization(), keras.layers.GlobalAveragePooling2D(),
                                    keras.layers.Dense(5)])
        images, labels = _batches(1, 8, 8, 5)
        initial = [v.numpy() for v in network.trainable_variables]
        with tf.GradientTape() as tape:
            logits = network(images, training=True)
            targets = tf.one_hot(labels, 5) * 0.8 + 0.2 / 5
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(targets, logits))
            loss += 1e-2 / 2 * sum(tf.reduce_sum(v ** 2) for v in network.trainable_variables if 'kernel' in v.name)
        gradients = tape.gradient(loss, network.trainable_variables)
        expected = [w - 0.5 * g.numpy() for w, g in zip(initial, gradients)]
        for variable, value in zip(network.trainable_variables, initial):
            variable.assign(value)

        classifier = train.Classifier(network, global_batch_size=8, weight_decay=1e-2, label_smoothing=0.2)
        classifier.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9))
        classifier.fit(images, labels, batch_size=8, epochs=1, verbose=0, shuffle=False)
        for variable, value in zip(network.trainable_variables, expected):
            self.assertAllClose(variable, value, atol=1e-5)

    @pytest.mark.slow
    def test_eight_replicas_end_with_the_same_weights_as_one_device(self):
        # No batch norm (norm='none'): plain BN normalizes per replica, so with BN the two runs would differ
        # by design. Everything else of the step (loss scaling by the global batch, weight decay scaled per
        # replica, label smoothing, gradient summation, momentum, schedule) must agree.
        initial, (single, multi) = helpers.train_same_start(
            [(TINY, tf.distribute.get_strategy()), (TINY, helpers.mirrored(8))])
        helpers.assert_same_training(self, single, multi, initial, atol=1e-5, rtol=1e-4, min_change=1e-3)


class ScheduleTest(tf.test.TestCase):

    def test_step_decay_against_closed_form(self):
        rate = schedules.WarmupStepDecay(3.2, 10, [30, 60, 80])
        for step, expected in ((0, 0.0), (5, 1.6), (10, 3.2), (29, 3.2), (30, 0.32), (60, 0.032), (85, 0.0032)):
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_polynomial_decay_against_closed_form(self):
        rate = schedules.WarmupPolynomialDecay(31.2, 100, 1100, end=1e-4, power=2)
        for step in (0, 50, 100, 350, 600, 1099, 1100, 2000):
            if step < 100:
                expected = 31.2 * step / 100
            else:
                t = min(1.0, (step - 100) / 1000)
                expected = 1e-4 + (31.2 - 1e-4) * (1 - t) ** 2
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_mlperf_v06_recipe_schedule(self):
        # Batch 32768: 25 warm-up epochs = 25 * 1281167 / 32768 = 977.4 -> 977 steps; 2983 steps in all.
        config = Config(global_batch_size=32768, total_steps=2983, learning_rate=31.2, warmup_epochs=25,
                        lr_decay='polynomial', end_learning_rate=1e-4, polynomial_power=2)
        rate = train.build_learning_rate(config)
        table = {0: 0.0, 488: 31.2 * 488 / 977, 977: 31.2, 1980: 1e-4 + (31.2 - 1e-4) * (1 - 1003 / 2006) ** 2,
                 2983: 1e-4}
        for step, expected in table.items():
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_slow_start_boundaries(self):
        # Akiba et al., batch 32768: eta = 0.1 * 128 = 12.8; epochs 40/70/85 = 1563.9/2736.9/3323.3 -> 1564/2737/3323.
        config = Config(global_batch_size=32768, base_learning_rate=0.1, lr_decay='slow_start', warmup_epochs=0)
        rate = train.build_learning_rate(config)
        table = {0: 6.4, 1563: 6.4, 1564: 0.96, 2736: 0.96, 2737: 0.128, 3322: 0.128, 3323: 0.0128, 3500: 0.0128}
        for step, expected in table.items():
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_alpha_sgd_blend(self):
        alpha = schedules.AlphaSGD(center_steps=100, period_steps=50)
        table = {0: 0.5 * np.exp(-4.0), 50: 0.5 * np.exp(-2.0), 99: 0.5 * np.exp(-2 / 50), 100: 0.5, 110: 0.7,
                 125: 1.0, 500: 1.0}
        for step, expected in table.items():
            self.assertAllClose(alpha(step), expected, rtol=1e-5)

    def test_cosine_and_serialization(self):
        rate = schedules.WarmupCosineDecay(1.0, 0, 100)
        self.assertAllClose([rate(s) for s in (0, 50, 100)], [1.0, 0.5, 0.0], atol=1e-6)
        restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(rate))
        self.assertIsInstance(restored, schedules.WarmupCosineDecay)
        self.assertAllClose(restored(25), rate(25))


class SignificantFiguresTest(parameterized.TestCase):

    @parameterized.parameters(11.24, 532.6, 12345.0, 0.01234, 999.6, 9.996, 1.0, 99.95, 48213.7)
    def test_three_significant_figures_as_pythons_g_format(self, value):
        shown = train.significant(value)
        reference = float(f'{value:.3g}')       # Python's own rounding to 3 significant figures
        self.assertEqual(float(shown.replace(',', '')), reference)
        digits = shown.replace(',', '').replace('.', '').lstrip('0')
        self.assertLen(digits, max(3, len(str(int(reference)))))   # 10.0 and 0.0123, not 10.00 or 0.01


class ProgressTest(tf.test.TestCase):

    def test_epoch_is_the_data_seen_as_the_papers_count_it(self):
        # MLPerf v0.7's batch-64k run: 1,738 steps of 65,536 ImageNet images read as epoch 88.9.
        lines = []
        progress = train.Progress(1738, 65536, 0, lines.append, num_train_images=1_281_167)
        progress.set_model(mock.Mock(optimizer=mock.Mock(iterations=tf.Variable(1738, dtype=tf.int64))))
        self.assertStartsWith(progress._line(19, {'loss': 1.0, 'top_1': 0.5}, 1000.0),
                              'epoch 88.9 step 1738/1738 loss 1.0000 top-1 50.00% 1,000 images/s')


class FitSegmentsTest(tf.test.TestCase):

    def test_fresh_run_is_one_segment(self):
        self.assertEqual(train.fit_segments(0, 30, 10), [train.FitSegment(0, 3, 10)])

    def test_resume_mid_epoch_finishes_that_epoch_first(self):
        self.assertEqual(train.fit_segments(14, 30, 10),
                         [train.FitSegment(1, 2, 6), train.FitSegment(2, 3, 10)])

    def test_fractional_last_epoch_and_finished_run(self):
        self.assertEqual(train.fit_segments(0, 25, 10), [train.FitSegment(0, 2, 10), train.FitSegment(2, 3, 5)])
        self.assertEqual(train.fit_segments(25, 25, 10), [])


class TrainAndEvaluateTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'data')
        helpers.write_dataset(self.data_dir, num_classes=10)
        self.config = dataclasses.replace(TINY, data_dir=self.data_dir, norm='batch_norm', num_classes=10,
                                          model_dir=os.path.join(self.get_temp_dir(), 'run'),
                                          checkpoint_every_steps=2, log_every_steps=0, shuffle_buffer=8)

    @pytest.mark.slow
    def test_resume_continues_at_the_saved_step(self):
        lines = []
        strategy = helpers.mirrored(8)
        # 2 of an epoch's 3 steps, as if the run had stopped mid-epoch.
        first = train.train_and_evaluate(dataclasses.replace(self.config, train_epochs=2 / 3), strategy,
                                         print_fn=lines.append)
        self.assertEqual(first['steps'], 2)
        with strategy.scope():
            saved = train.build_classifier(self.config)
        manager = train.checkpoint_manager(saved, self.config.model_dir)
        self.assertTrue(manager.latest_checkpoint.endswith('ckpt-2'), manager.latest_checkpoint)
        train.restore_latest(manager)
        self.assertEqual(int(saved.optimizer.iterations.numpy()), 2)

        lines.clear()
        second = train.train_and_evaluate(dataclasses.replace(self.config, train_epochs=2), strategy,
                                          print_fn=lines.append)
        self.assertIn(f'resumed from {manager.latest_checkpoint} at step 2', lines)
        self.assertEqual(second['steps'], 6)  # 2 + the rest of epoch 1 (1) + epoch 2 (3), not 2 + 6
        self.assertEqual(second['eval_images'], 20)  # every held-out image, the last batch partial
        self.assertTrue(os.path.exists(os.path.join(self.config.model_dir, 'results.json')))

    def test_non_finite_loss_stops_without_saving_that_step(self):
        config = dataclasses.replace(self.config, base_learning_rate=1e30, norm='none', checkpoint_every_steps=1,
                                     train_epochs=2)
        with self.assertRaisesRegex(train.TrainingDiverged, r'training loss is (nan|inf) at step (\d+)') as caught:
            train.train_and_evaluate(config, helpers.mirrored(2), print_fn=lambda line: None)
        step = int(caught.exception.args[0].split('at step ')[1].split(';')[0])
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), os.path.join(config.model_dir, 'checkpoints'), 3)
        saved = [int(path.rsplit('-', 1)[1]) for path in manager.checkpoints]
        self.assertNotIn(step, saved)
        self.assertTrue(all(s < step for s in saved))

    def test_input_that_ends_early_stops_the_run_instead_of_shortening_it(self):
        # Keras ends a fit call quietly when its input ends; the training stream is endless, so an end means an
        # input error that the distributed iterator reported as the end of the data. 4 per-replica batches are
        # 2 steps on 2 replicas; with none at all Keras raises its own "Empty logs" error. (The step counter is
        # no proof: with no data at all it was seen at 1, and in one CI run it reached the planned 3.)
        original = input_pipeline.train_dataset
        for steps in (4, 0):
            message = r'input ended early \(this fit call was to reach step 3; the step counter is at \d\)'
            config = dataclasses.replace(self.config, model_dir=os.path.join(self.get_temp_dir(), f'ended{steps}'))
            with mock.patch.object(input_pipeline, 'train_dataset',
                                   lambda *args, **kwargs: original(*args, **kwargs).take(steps)):
                with self.assertRaisesRegex(train.InputEnded, message):
                    train.train_and_evaluate(config, helpers.mirrored(2), print_fn=lambda line: None)

    def test_resuming_a_different_model_is_refused_by_name(self):
        train.check_model_settings(self.config, self.config.model_dir)
        other = dataclasses.replace(self.config, depth=34, num_classes=5)
        with self.assertRaisesRegex(ConfigError, r"different model \(depth=10 there, 34 now; "
                                                 r"num_classes=10 there, 5 now\)"):
            train.check_model_settings(other, self.config.model_dir)
        train.check_model_settings(self.config, self.config.model_dir)   # the same model passes

    def test_checkpoint_that_does_not_fit_is_a_clear_error(self):
        small = dataclasses.replace(self.config, num_classes=10)
        classifier = train.build_classifier(small)
        manager = train.checkpoint_manager(classifier, self.config.model_dir)
        manager.save(checkpoint_number=1)
        other = train.build_classifier(dataclasses.replace(small, num_classes=7))
        with self.assertRaisesRegex(ConfigError, 'ckpt-1 does not fit this model'):
            train.restore_latest(train.checkpoint_manager(other, self.config.model_dir))

    def test_global_batch_not_divisible_by_replicas(self):
        config = dataclasses.replace(self.config, global_batch_size=12)
        with self.assertRaisesRegex(ConfigError, 'global_batch_size=12 is not divisible by the 8 replicas'):
            train.train_and_evaluate(config, helpers.mirrored(8))


if __name__ == '__main__':
    tf.test.main()
