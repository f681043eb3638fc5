"""The demo data tool: scikit-learn's digits as ImageNet-format shards, with the digit names in labels.txt."""

import os
import subprocess
import sys
import tempfile

import numpy as np
import sklearn.datasets
import tensorflow as tf

import helpers
from imagenet_tpu.data import labels
from imagenet_tpu.data import record_counts
from imagenet_tpu.data import tfrecord


class MakeDemoDataTest(tf.test.TestCase):

    def test_shards_hold_every_digit_once_and_labels_name_them(self):
        output = tempfile.mkdtemp(prefix='demo-', dir=self.get_temp_dir())
        process = subprocess.run([sys.executable, os.path.join(helpers.REPO, 'tools', 'data', 'make_demo_data.py'),
                                  f'--output_dir={output}', '--image_size=16'], capture_output=True, text=True,
                                 env=helpers.subprocess_environment(), timeout=300)
        self.assertEqual(process.returncode, 0, process.stderr)
        disk_labels = [label for split in (tfrecord.TRAIN, tfrecord.VALIDATION)
                       for path in tf.io.gfile.glob(tfrecord.file_pattern(output, split))
                       for label in tfrecord.read_labels(path)]
        digits = sklearn.datasets.load_digits().target
        self.assertEqual(np.bincount(np.array(disk_labels) - 1).tolist(), np.bincount(digits).tolist())
        names, ids = labels.class_names(10, 1, data_dir=output)
        self.assertEqual(names, ['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine'])
        self.assertEqual(ids, [f'digit{d}' for d in range(10)])
        counts = record_counts.read(record_counts.path_in(output))
        self.assertEqual(sum(records for records, _ in counts.values()), len(digits))


if __name__ == '__main__':
    tf.test.main()
