"""2-D all-reduce against the plain sum on 8 replicas, for every mesh shape of 8, odd sizes, float32 and bfloat16."""

import dataclasses

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu.distribute import collectives

helpers.use_eight_cpus()

SHAPES = [(3, 5), (7,), (2, 3, 3, 1), (11,)]   # 15, 7, 18, 11 elements: none a multiple of 8


class AllReduce2DTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(
        ((1, 8), tf.float32), ((2, 4), tf.float32), ((4, 2), tf.float32), ((8, 1), tf.float32),
        ((2, 4), tf.bfloat16), ((8, 1), tf.bfloat16),
        ((2, 4), tf.float32, (3, 0, 6, 5, 1, 7, 2, 4)), ((4, 2), tf.float32, (7, 6, 5, 4, 3, 2, 1, 0)),
    )
    def test_equals_plain_sum(self, mesh, dtype, replica_order=None):
        strategy = helpers.mirrored(8)
        rng = np.random.default_rng(sum(mesh))
        values = [rng.normal(size=(8,) + shape).astype(np.float32) for shape in SHAPES]

        @tf.function
        def run():
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                mine = [tf.cast(tf.gather(tf.constant(v), replica), dtype) for v in values]
                # A 64-byte bucket size forces several buckets.
                return collectives.all_reduce_2d(mine, mesh, bucket_bytes=64, replica_order=replica_order)
            return strategy.run(replica_fn)

        summed = run()
        for index, value in enumerate(values):
            expected = value.astype(dtype.as_numpy_dtype).astype(np.float32).sum(0)
            for replica_result in strategy.experimental_local_results(summed[index]):
                self.assertEqual(replica_result.dtype, dtype)
                tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == tf.float32 else dict(rtol=3e-2, atol=6e-2)
                self.assertAllClose(tf.cast(replica_result, tf.float32), expected, **tolerance)

    def test_bucket_layout_and_meshes(self):
        self.assertEqual(collectives.bucket_layout([10, 10, 10, 30], 4, bucket_bytes=80), [[0, 1], [2], [3]])
        self.assertEqual(collectives.default_mesh_shape(8), (4, 2))
        self.assertEqual(collectives.default_mesh_shape(1024), (32, 32))
        rows, columns = collectives.mesh_groups((4, 2))
        self.assertEqual(rows, [[0, 1, 2, 3], [4, 5, 6, 7]])
        self.assertEqual(columns, [[0, 4], [1, 5], [2, 6], [3, 7]])
        rows, columns = collectives.mesh_groups((4, 2), replica_order=(3, 0, 6, 5, 1, 7, 2, 4))
        self.assertEqual(rows, [[3, 0, 6, 5], [1, 7, 2, 4]])
        self.assertEqual(columns, [[3, 1], [0, 7], [6, 2], [5, 4]])

    def test_wrong_mesh_is_refused(self):
        strategy = helpers.mirrored(8)
        with self.assertRaisesRegex(ValueError, 'mesh 3x3 does not hold the 8 replicas'):
            strategy.run(lambda: collectives.all_reduce_2d([tf.ones([2])], (3, 3)))


@pytest.mark.slow
class TrainWith2DAllReduceTest(tf.test.TestCase):

    def test_three_steps_equal_the_default_all_reduce(self):
        # 4 replicas as a 2x2 mesh of one-core chips (every mesh of 8 is tested above, on the collective alone;
        # tracing costs a step's graph per replica); learning rate 0.1 x 16/256.
        base = helpers.tiny_config(base_learning_rate=0.1, mesh_shape=(2, 2), cores_per_chip=1)
        # Tolerances (on the weights; on each weight's change, relative) and what was measured on a 2x4 mesh:
        # float32 7e-9 apart, changes 8e-6 apart; bfloat16 1e-5 apart, changes 0.5% apart. The weights move by
        # 2e-3 at most, so for bfloat16, whose rounding needs the wider weight tolerance, the changes are compared
        # as well.
        tolerances = {'float32': (1e-5, None), 'bfloat16': (1e-4, 0.02)}
        runs = [(base, helpers.mirrored(4))] + [
            (dataclasses.replace(base, allreduce='2d', allreduce_dtype=dtype), helpers.mirrored(4))
            for dtype in tolerances]
        initial, (default, *two_d) = helpers.train_same_start(runs)
        for (dtype, (tolerance, update_error)), weights in zip(tolerances.items(), two_d):
            helpers.assert_same_training(self, default, weights, initial, atol=tolerance, rtol=tolerance,
                                         min_change=1e-3, max_update_error=update_error, msg=dtype)


if __name__ == '__main__':
    tf.test.main()
