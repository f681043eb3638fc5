"""Callbacks: progress lines (significant figures, the epoch as the data seen), the profile of chosen steps."""

import glob
import os
from unittest import mock

from absl.testing import parameterized
import tensorflow as tf

import helpers
from imagenet_tpu import config as config_lib
from imagenet_tpu import errors, train
from imagenet_tpu.training import callbacks, checkpoints

helpers.use_eight_cpus()


class SignificantFiguresTest(parameterized.TestCase):

    @parameterized.parameters(11.24, 532.6, 12345.0, 0.01234, 999.6, 9.996, 1.0, 99.95, 48213.7)
    def test_three_significant_figures_as_pythons_g_format(self, value):
        shown = callbacks.significant(value)
        reference = float(f'{value:.3g}')       # Python's own rounding to 3 significant figures
        self.assertEqual(float(shown.replace(',', '')), reference)
        digits = shown.replace(',', '').replace('.', '').lstrip('0')
        self.assertLen(digits, max(3, len(str(int(reference)))))   # 10.0 and 0.0123, not 10.00 or 0.01


class ProgressTest(tf.test.TestCase):

    def test_epoch_is_the_data_seen_as_the_papers_count_it(self):
        # MLPerf v0.7's batch-64k run: 1,738 steps of 65,536 ImageNet images read as epoch 88.9.
        lines = []
        progress = callbacks.Progress(1738, 65536, 0, lines.append, num_train_images=1_281_167)
        progress.set_model(mock.Mock(optimizer=mock.Mock(iterations=tf.Variable(1738, dtype=tf.int64))))
        self.assertStartsWith(progress._line(19, {'loss': 1.0, 'top_1': 0.5}, 1000.0),
                              'epoch 88.9 step 1738/1738 loss 1.0000 top-1 50.00% 1,000 images/s')


class ProfileStepsTest(tf.test.TestCase):

    def test_a_run_writes_the_profile_of_the_steps_asked_for_and_only_on_the_chief(self):
        root = helpers.class_folder(ProfileStepsTest)
        lines = []
        config = helpers.tiny_config(data_dir=os.path.join(root, 'data'), num_classes=4, model_dir=os.path.join(
            root, 'run'), train_epochs=2, eval_every_epochs=100, profile_steps=(2, 4), strategy='default',
                                     input_timeout_minutes=0)
        train.train_and_evaluate(config, print_fn=lines.append)
        profiles = glob.glob(os.path.join(config.model_dir, 'logs', 'plugins', 'profile', '*', '*.xplane.pb'))
        self.assertLen(profiles, 1)
        self.assertGreater(os.path.getsize(profiles[0]), 1000)
        self.assertIn(f'profile of steps 2-4 written to {config.model_dir}/logs', '\n'.join(lines))

    def test_the_setting_is_two_steps_in_order(self):
        self.assertEqual(config_lib.parse_step_range('100,110'), (100, 110))
        for text in ('100', '5,2', '0,3', 'a,b'):
            with self.assertRaisesRegex(errors.ConfigError, '--profile_steps'):
                config_lib.parse_step_range(text)


if __name__ == '__main__':
    tf.test.main()


class StopOnNonFiniteLossTest(tf.test.TestCase):
    """The weights are checked once per interval, not in every step; the loss at every host call."""

    def model_with_weights(self, value):
        holder = mock.Mock()
        holder.network.variables = [tf.Variable([1.0, value]), tf.Variable([2.0])]
        holder.optimizer.iterations = tf.Variable(7, dtype=tf.int64)
        holder.steps_per_execution = tf.Variable(1, dtype=tf.int64)
        return holder

    def test_a_nan_moving_statistic_under_a_finite_loss_is_caught_at_the_next_check(self):
        callback = callbacks.StopOnNonFiniteLoss(weights_every_seconds=0.0, nonfinite=checkpoints.nonfinite_variables)
        callback.set_model(self.model_with_weights(float('nan')))
        callback.on_train_begin()
        with self.assertRaisesRegex(errors.TrainingDiverged, r'1 weights are NaN or infinite .* at step 7'):
            callback.on_train_batch_end(0, {'loss': 0.5})

    def test_between_checks_the_weights_are_not_read(self):
        reads = mock.Mock(return_value=[])
        callback = callbacks.StopOnNonFiniteLoss(weights_every_seconds=3600.0, nonfinite=reads)
        callback.set_model(self.model_with_weights(1.0))
        callback.on_train_begin()
        for batch in range(5):
            callback.on_train_batch_end(batch, {'loss': 0.5})
        reads.assert_not_called()
        with self.assertRaisesRegex(errors.TrainingDiverged, 'training loss is nan at step 7'):
            callback.on_train_batch_end(5, {'loss': float('nan')})
