"""2-D all-reduce against the plain sum on 8 replicas, for every mesh shape of 8, odd sizes, float32 and bfloat16."""

import dataclasses

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import tf_keras as keras

import helpers
import lars_test
from imagenet_tpu import collectives, train

helpers.use_eight_cpus()

SHAPES = [(3, 5), (7,), (2, 3, 3, 1), (11,)]   # 15, 7, 18, 11 elements: none a multiple of 8


class AllReduce2DTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(
        ((1, 8), tf.float32), ((2, 4), tf.float32), ((4, 2), tf.float32), ((8, 1), tf.float32),
        ((2, 4), tf.bfloat16), ((8, 1), tf.bfloat16),
    )
    def test_equals_plain_sum(self, mesh, dtype):
        strategy = helpers.mirrored(8)
        rng = np.random.default_rng(sum(mesh))
        values = [rng.normal(size=(8,) + shape).astype(np.float32) for shape in SHAPES]

        @tf.function
        def run():
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                mine = [tf.cast(tf.gather(tf.constant(v), replica), dtype) for v in values]
                # A 64-byte bucket size forces several buckets.
                return collectives.all_reduce_2d(mine, mesh, bucket_bytes=64)
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

    def test_wrong_mesh_is_refused(self):
        strategy = helpers.mirrored(8)
        with self.assertRaisesRegex(ValueError, 'mesh 3x3 does not hold the 8 replicas'):
            strategy.run(lambda: collectives.all_reduce_2d([tf.ones([2])], (3, 3)))


@pytest.mark.slow
class TrainWith2DAllReduceTest(tf.test.TestCase):

    def test_three_steps_equal_the_default_all_reduce(self):
        base = dataclasses.replace(lars_test.EQUIVALENCE, mesh_shape=(2, 4), cores_per_chip=1)
        dataset = helpers.equivalence_batches()
        keras.utils.set_random_seed(0)
        initial = train.build_network(base).get_weights()
        default = helpers.train_from(base, initial, helpers.mirrored(8), dataset)
        for dtype, tolerance in (('float32', 1e-5), ('bfloat16', 2e-3)):
            config = dataclasses.replace(base, allreduce='2d', allreduce_dtype=dtype)
            two_d = helpers.train_from(config, initial, helpers.mirrored(8), dataset)
            for a, b in zip(default, two_d):
                self.assertAllClose(a, b, atol=tolerance, rtol=tolerance, msg=dtype)


if __name__ == '__main__':
    tf.test.main()
