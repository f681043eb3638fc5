"""tools/plots/plot_metrics.py reads back exactly the scalars a run wrote, and draws them."""

import os
import sys

import tensorflow as tf

import helpers

helpers.use_eight_cpus()
sys.path.insert(0, os.path.join(helpers.REPO, 'tools', 'plots'))
import plot_metrics  # pylint: disable=wrong-import-position


class PlotMetricsTest(tf.test.TestCase):

    def test_reads_scalars_and_writes_png(self):
        model_dir = self.get_temp_dir()
        losses = {'train': [2.0, 1.5, 1.2], 'validation': [2.1, 1.6, 1.3]}
        for split, values in losses.items():
            with tf.summary.create_file_writer(os.path.join(model_dir, 'logs', split)).as_default():
                for epoch, value in enumerate(values):
                    tf.summary.scalar('epoch_loss', value, step=epoch)
                    tf.summary.scalar('epoch_top_1', 1 - value / 3, step=epoch)
        scalars = plot_metrics.read_scalars(os.path.join(model_dir, 'logs', 'train'))
        self.assertAllClose([v for _, v in scalars['epoch_loss']], losses['train'])
        self.assertEqual([s for s, _ in scalars['epoch_loss']], [0, 1, 2])
        path = plot_metrics.plot(model_dir, os.path.join(model_dir, 'metrics.png'))
        with open(path, 'rb') as f:
            self.assertEqual(f.read(8), b'\x89PNG\r\n\x1a\n')

    def test_missing_logs_are_reported(self):
        with self.assertRaisesRegex(FileNotFoundError, 'no TensorBoard scalars'):
            plot_metrics.plot(self.get_temp_dir(), os.path.join(self.get_temp_dir(), 'x.png'))


if __name__ == '__main__':
    tf.test.main()
