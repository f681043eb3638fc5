"""Group assignments against hand-written tables; grouped all-reduce against NumPy sums on 8 replicas."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import helpers
from imagenet_tpu.distribute import collectives

helpers.use_eight_cpus()


class GroupAssignmentTest(tf.test.TestCase, parameterized.TestCase):

    def test_contiguous_groups(self):
        self.assertEqual(collectives.group_assignment(8, 2), [[0, 1], [2, 3], [4, 5], [6, 7]])
        self.assertEqual(collectives.group_assignment(8, 4), [[0, 1, 2, 3], [4, 5, 6, 7]])
        self.assertEqual(collectives.group_assignment(4, 1), [[0], [1], [2], [3]])
        self.assertEqual(collectives.group_assignment(4, 4), [[0, 1, 2, 3]])

    @parameterized.parameters((8, (2, 2)), (16, (2, 4)), (32, (4, 4)), (64, (4, 8)), (2, (1, 1)), (4, (1, 2)))
    def test_tile_shapes_of_the_mlperf_submissions(self, group_size, chips):
        self.assertEqual(collectives.tile_shape(group_size, cores_per_chip=2), chips)

    def test_tiles_on_a_4x4_mesh(self):
        # 4x4 chips, 2 cores each: chip (x, y) holds replicas 2*(4y + x) and 2*(4y + x) + 1.
        #   y=0: chips 0 1 2 3 -> replicas 0-1 2-3 4-5 6-7
        #   y=1: chips 4 5 6 7 -> replicas 8-9 10-11 12-13 14-15 ...
        # Groups of 8 replicas = 2x2 chips.
        expected = [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15],
                    [16, 17, 18, 19, 24, 25, 26, 27], [20, 21, 22, 23, 28, 29, 30, 31]]
        self.assertEqual(collectives.group_assignment(32, 8, mesh_shape=(4, 4)), expected)
        # Groups of 16 = 2x4 chips: two columns of chips, all four rows.
        self.assertEqual(collectives.group_assignment(32, 16, mesh_shape=(4, 4)),
                         [[0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
                          [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]])

    def test_every_replica_in_exactly_one_group(self):
        for replicas, group, mesh in ((512, 32, (16, 16)), (1024, 64, (16, 32)), (8, 4, (2, 2))):
            groups = collectives.group_assignment(replicas, group, mesh_shape=mesh)
            self.assertEqual(sorted(r for g in groups for r in g), list(range(replicas)))
            self.assertTrue(all(len(g) == group for g in groups))

    def test_bad_groups_are_refused(self):
        with self.assertRaisesRegex(ValueError, 'group size 3 does not divide the 8 replicas'):
            collectives.group_assignment(8, 3)
        with self.assertRaisesRegex(ValueError, 'mesh 3x2 chips x 2 cores is not 8 replicas'):
            collectives.group_assignment(8, 4, mesh_shape=(3, 2))

    def test_tiles_fit_the_mesh_they_are_laid_on(self):
        # The MLPerf shape where it divides the mesh, else the nearest shape that does (a v4 torus 2 chips wide).
        self.assertEqual(collectives.tile_shape(16, 1, mesh_shape=(16, 16)), (4, 4))
        self.assertEqual(collectives.tile_shape(16, 1, mesh_shape=(2, 16)), (2, 8))
        self.assertEqual(collectives.tile_shape(8, 2, mesh_shape=(3, 4)), (1, 4))


class GroupedAllReduceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(
        (1, None), (2, None), (4, None), (8, None), (4, (2, 2)), (2, (2, 2)),
        (2, None, True), (8, None, True), (4, (2, 2), True),
    )
    def test_sum_over_own_group_and_its_gradient(self, group_size, mesh, traced=False):
        # traced: inside a tf.function, where the gradient is built as a graph (as in training).
        strategy = helpers.mirrored(8)
        values = np.random.default_rng(group_size).normal(size=(8, 3)).astype(np.float32)
        weights = np.random.default_rng(99).normal(size=(8, 3)).astype(np.float32)
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx: (tf.constant(values[ctx.replica_id_in_sync_group]),
                         tf.constant(weights[ctx.replica_id_in_sync_group])))

        def step(inputs):
            value, weight = inputs
            with tf.GradientTape() as tape:
                tape.watch(value)
                summed = collectives.grouped_all_reduce(value, group_size, mesh, cores_per_chip=2)
                loss = tf.reduce_sum(summed * weight)
            return summed, tape.gradient(loss, value)

        run = lambda inputs: strategy.run(step, args=(inputs,))
        summed, gradient = (tf.function(run) if traced else run)(per_replica)
        summed = np.stack([t.numpy() for t in strategy.experimental_local_results(summed)])
        gradient = np.stack([t.numpy() for t in strategy.experimental_local_results(gradient)])
        groups = collectives.group_assignment(8, group_size, mesh)
        for group in groups:
            for replica in group:
                self.assertAllClose(summed[replica], values[group].sum(0), rtol=1e-6)
                # d/dx_r of sum_s (sum_{t in group(s)} x_t) . w_s = sum of w over r's group.
                self.assertAllClose(gradient[replica], weights[group].sum(0), rtol=1e-6)

    def test_groups_follow_the_replica_order(self):
        # On a 2x2-chip mesh of 2 cores, a 4-replica tile is 1x2 chips: mesh indexes {0, 1, 4, 5} and {2, 3, 6, 7}.
        # With replica_order (the replica at each mesh index) (0, 2, 4, 6, 1, 3, 5, 7) those places hold replicas
        # {0, 2, 1, 3} and {4, 6, 5, 7}: the sums must be over these.
        strategy = helpers.mirrored(8)
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        values = np.random.default_rng(5).normal(size=(8, 3)).astype(np.float32)
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(values[ctx.replica_id_in_sync_group]))
        summed = strategy.run(lambda v: collectives.grouped_all_reduce(v, 4, (2, 2), 2, replica_order=order),
                              args=(per_replica,))
        summed = np.stack([t.numpy() for t in strategy.experimental_local_results(summed)])
        for group in ([0, 1, 2, 3], [4, 5, 6, 7]):
            for replica in group:
                self.assertAllClose(summed[replica], values[group].sum(0), rtol=1e-6)
        self.assertEqual(collectives.group_assignment(8, 4, (2, 2), 2, order), [[0, 1, 2, 3], [4, 5, 6, 7]])
        self.assertEqual(collectives.group_assignment(8, 4, (2, 2), 2), [[0, 1, 4, 5], [2, 3, 6, 7]])

    def test_outside_a_strategy_is_identity(self):
        self.assertAllClose(collectives.grouped_all_reduce(tf.constant([1.0, 2.0]), 4), [1.0, 2.0])


if __name__ == '__main__':
    tf.test.main()
