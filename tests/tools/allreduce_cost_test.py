"""tools/benchmarks/allreduce_cost.py against values worked out by hand."""

import os
import sys

import tensorflow as tf

import helpers

sys.path.insert(0, os.path.join(helpers.REPO, 'tools', 'benchmarks'))
import allreduce_cost  # pylint: disable=wrong-import-position


class AllReduceCostTest(tf.test.TestCase):

    def test_1024_chips_float32(self):
        # S = 25,557,032 x 4 = 102,228,128 bytes in 4 buckets of 32 MiB; B = 340e12 / 1024 = 332.03e9 B/s;
        # alpha = 1 us. Bandwidth term: 2 x 1023/1024 x 102,228,128 / 332.03e9 = 0.61517 ms.
        # Ring: 4 x 2 x 1023 hops x 1 us = 8.184 ms (+ 0.61517) = 8.79917 ms.
        # 32x32 torus: 4 x 2 x (32 + 32 - 2) = 496 hops = 0.496 ms (+ 0.61517) = 1.11117 ms.
        row = next(r for r in allreduce_cost.table() if r['chips'] == 1024 and r['dtype'] == 'float32')
        self.assertEqual((row['mesh'], row['buckets']), ('32x32', 4))
        self.assertAllClose(row['ring_ms'], 8.79917, rtol=1e-5)
        self.assertAllClose(row['torus_ms'], 1.11117, rtol=1e-5)

    def test_8_chips_bfloat16(self):
        # S = 51,114,064 bytes in 2 buckets. Bandwidth: 2 x 7/8 x 51,114,064 / 332.03e9 = 0.26940 ms.
        # Ring: 2 x 2 x 7 = 28 hops -> 0.29740 ms; 4x2 torus: 2 x 2 x (4 + 2 - 2) = 16 hops -> 0.28540 ms.
        row = next(r for r in allreduce_cost.table() if r['chips'] == 8 and r['dtype'] == 'bfloat16')
        self.assertEqual((row['mesh'], row['buckets']), ('4x2', 2))
        self.assertAllClose(row['ring_ms'], 0.29740, rtol=1e-4)
        self.assertAllClose(row['torus_ms'], 0.28540, rtol=1e-4)


if __name__ == '__main__':
    tf.test.main()
