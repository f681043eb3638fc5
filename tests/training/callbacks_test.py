"""Callbacks: progress lines (significant figures, the epoch as the data seen)."""

from unittest import mock

from absl.testing import parameterized
import tensorflow as tf

from imagenet_tpu.training import callbacks


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


if __name__ == '__main__':
    tf.test.main()
