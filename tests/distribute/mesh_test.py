"""TPU replicas on the torus, in pure Python: topologies as the TPU system reports them are built in the test
(tf.tpu.experimental.Topology takes a mesh shape and device coordinates), and the batch-norm groups and 2-D
all-reduce rows that collectives.py makes for TPUStrategy's replicas are read back as physical chips.

The slices: v3-8 (one host, 2x2 chips, 2 devices per chip), v3-32 (4x4 chips, 4 hosts of 2x2 chips),
v3-1024 (16x32 chips, 128 hosts), v4-64 (2x4x4 chips, 8 hosts of 2x2x1 chips) with a chip as one device
(megacore) and with each core a device. Hosts hold blocks of neighbouring chips, so TPUStrategy's host-by-host
replica order is not mesh order on every slice of several hosts.
"""

import itertools

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from imagenet_tpu.distribute import collectives
from imagenet_tpu.distribute import strategy
from imagenet_tpu.distribute import mesh as tpu_mesh
from imagenet_tpu.config import Config, ConfigError
from imagenet_tpu.hardware import tpu_slice


def topology(chips, devices_per_chip: int, host_block, reverse_devices: bool = False):
    """A Topology of ``chips`` (X, Y, Z) whose hosts each hold a ``host_block`` of chips (blocks in row-major
    order), each host's devices listed chip by chip (reversed with ``reverse_devices``)."""
    chips_x, chips_y, chips_z = chips
    block_x, block_y, block_z = host_block
    hosts = []
    for bz, by, bx in itertools.product(range(0, chips_z, block_z), range(0, chips_y, block_y),
                                        range(0, chips_x, block_x)):
        devices = [(x, y, z, core) for z in range(bz, bz + block_z) for y in range(by, by + block_y)
                   for x in range(bx, bx + block_x) for core in range(devices_per_chip)]
        hosts.append(devices[::-1] if reverse_devices else devices)
    return tf.tpu.experimental.Topology(mesh_shape=[chips_x, chips_y, chips_z, devices_per_chip],
                                        device_coordinates=np.array(hosts, np.int32))


SLICES = {
    'v3_8': dict(chips=(2, 2, 1), devices_per_chip=2, host_block=(2, 2, 1)),
    'v3_32': dict(chips=(4, 4, 1), devices_per_chip=2, host_block=(2, 2, 1)),
    'v3_32_reversed': dict(chips=(4, 4, 1), devices_per_chip=2, host_block=(2, 2, 1), reverse_devices=True),
    'v3_1024': dict(chips=(16, 32, 1), devices_per_chip=2, host_block=(2, 2, 1)),
    'v4_64_megacore': dict(chips=(2, 4, 4), devices_per_chip=1, host_block=(2, 2, 1)),
    'v4_64_two_cores': dict(chips=(2, 4, 4), devices_per_chip=2, host_block=(2, 2, 1)),
}
GROUP_SIZES = {2: (8, 16, 32), 1: (4, 8, 16)}     # devices per chip -> BN group sizes (replicas)


def is_box(chips) -> bool:
    """Whether a set of (x, y, z) chips is a box: the product of one contiguous range per axis."""
    ranges = [sorted({chip[axis] for chip in chips}) for axis in range(3)]
    contiguous = all(r == list(range(r[0], r[-1] + 1)) for r in ranges)
    return contiguous and len(chips) == len(ranges[0]) * len(ranges[1]) * len(ranges[2])


class PlacementTest(tf.test.TestCase, parameterized.TestCase):

    def _slice(self, name):
        made = topology(**SLICES[name])
        return made, tpu_mesh.Placement.from_topology(made.device_coordinates)

    @parameterized.named_parameters((name, name) for name in SLICES)
    def test_mesh_order_is_tensorflows_mesh_device_order(self, name):
        # Reference: TensorFlow's own DeviceAssignment.build in MESH order, which numbers a full slice's devices
        # core first, then x, y, z: replica_order[m] must sit where TF puts mesh replica m.
        made, placement = self._slice(name)
        reference = tf.tpu.experimental.DeviceAssignment.build(
            made, num_replicas=placement.num_replicas,
            device_order_mode=tf.tpu.experimental.DeviceOrderMode.MESH).core_assignment[:, 0, :]
        raw = made.device_coordinates.reshape(-1, 4)
        self.assertEqual(sorted(placement.replica_order), list(range(placement.num_replicas)))
        for index, replica in enumerate(placement.replica_order):
            self.assertAllEqual(raw[replica], reference[index])

    @parameterized.named_parameters((name, name) for name in SLICES)
    def test_batch_norm_tiles_are_boxes_of_neighbouring_chips(self, name):
        made, placement = self._slice(name)
        per_chip = placement.replicas_per_chip
        for group_size in GROUP_SIZES[per_chip]:
            if group_size > placement.num_replicas:
                continue
            groups = collectives.group_assignment(placement.num_replicas, group_size, placement.chip_mesh,
                                                  per_chip, placement.replica_order)
            self.assertEqual(sorted(r for g in groups for r in g), list(range(placement.num_replicas)))
            for group in groups:
                chips = {placement.coordinates[r][:3] for r in group}
                self.assertLen(chips, group_size // per_chip)       # every device of each chip
                self.assertTrue(is_box(chips), f'{name}: group {group} is on chips {sorted(chips)}')

    @parameterized.named_parameters((name, name) for name in SLICES)
    def test_all_reduce_rows_are_torus_rows_and_columns_torus_columns(self, name):
        made, placement = self._slice(name)
        chips_x, chips_y, chips_z = placement.chips
        rows, columns = collectives.mesh_groups(placement.replica_mesh, placement.replica_order)
        self.assertLen(rows, chips_y * chips_z)
        for row in rows:
            places = [placement.coordinates[r] for r in row]
            self.assertLen({(y, z) for _, y, z, _ in places}, 1)                    # one torus row
            self.assertEqual([x for x, _, _, _ in places],                             # along x, in order
                             [x for x in range(chips_x) for _ in range(placement.replicas_per_chip)])
        for column in columns:
            places = [placement.coordinates[r] for r in column]
            self.assertLen({(x, core) for x, _, _, core in places}, 1)              # one torus column
            self.assertEqual(sorted((z, y) for _, y, z, _ in places),
                             [(z, y) for z in range(chips_z) for y in range(chips_y)])

    def test_host_by_host_numbering_is_not_mesh_order_on_several_hosts(self):
        # What the replicas' own order gives: on v3-32, "tiles" of 8 replicas without the placement are hosts'
        # blocks only by accident of the block shape, and rows of the 2-D mesh are not torus rows.
        _, placement = self._slice('v3_32')
        rows, _ = collectives.mesh_groups(placement.replica_mesh)
        self.assertTrue(any(len({placement.coordinates[r][1] for r in row}) > 1 for row in rows))
        groups = collectives.group_assignment(32, 16, placement.chip_mesh, 2)
        self.assertTrue(any(not is_box({placement.coordinates[r][:3] for r in g}) for g in groups))

    def test_one_host_keeps_todays_order(self):
        made, placement = self._slice('v3_8')
        self.assertEqual(placement.replica_order, tuple(range(8)))
        assignment, same = strategy.tpu_device_assignment(made)
        self.assertEqual(same, placement)
        self.assertEqual([assignment.tpu_device(r) for r in range(8)],
                         [f'/task:0/device:TPU:{d}' for d in range(8)])

    @parameterized.named_parameters((name, name) for name in SLICES)
    def test_the_strategy_keeps_tensorflows_host_by_host_order(self, name):
        # TPUStrategy without an assignment numbers replicas host by host (tpu_system_metadata sorts its devices
        # by task, then index); the explicit assignment is that order, so the input pipelines still feed their
        # own host's replicas.
        made, placement = self._slice(name)
        assignment, _ = strategy.tpu_device_assignment(made)
        per_host = made.num_tpus_per_task
        self.assertEqual(assignment.num_replicas, made.num_tasks * per_host)
        for replica in range(assignment.num_replicas):
            self.assertEqual(assignment.tpu_device(replica),
                             f'/task:{replica // per_host}/device:TPU:{replica % per_host}')
        self.assertEqual(placement.num_hosts, made.num_tasks)

    def test_a_degraded_slice_has_no_mesh(self):
        made = topology(chips=(4, 4, 1), devices_per_chip=2, host_block=(2, 2, 1))
        coordinates = made.device_coordinates.copy()
        degraded = tf.tpu.experimental.Topology(mesh_shape=[4, 4, 1, 2], device_coordinates=coordinates[:3])
        self.assertEqual(strategy.tpu_device_assignment(degraded), (None, None))
        with self.assertRaisesRegex(ValueError, 'does not fill a 4x4x1 box'):
            tpu_mesh.Placement.from_topology(coordinates[:3])


class SliceNamesTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(('v3-8', 4, 1), ('v3-32', 16, 4), ('v3-1024', 512, 128), ('v3-8192', 4096, 1024),
                              ('v4-8', 4, 1), ('v4-128', 64, 16), ('v5p-256', 128, 32), ('v5litepod-8', 8, 1),
                              ('v5litepod-256', 256, 64), ('v2-8', 4, 1))
    def test_chips_and_hosts(self, name, chips, hosts):
        self.assertEqual(tpu_slice(name)[1:], (chips, hosts))

    def test_unknown_names_are_one_line(self):
        for name in ('v9-8', 'v3', 'v3-x', 'v3-7', '8xA100'):
            with self.assertRaises(ConfigError):
                tpu_slice(name)

    def test_pod_slice_needs_a_name(self):
        with self.assertRaisesRegex(ConfigError, 'spans 128 hosts but --tpu=local sees only this host'):
            Config(strategy='tpu', tpu='local', topology='v3-1024')
        Config(strategy='tpu', tpu='my-pod', topology='v3-1024')
        Config(strategy='tpu', tpu='local', topology='v3-8')

    def test_fewer_hosts_than_the_slice_stops(self):
        with self.assertRaisesRegex(ConfigError, 'shows 1 TPU host but --topology implies 128'):
            strategy.check_tpu_hosts(1, 128, 'my-pod')
        strategy.check_tpu_hosts(128, 128, 'my-pod')
        strategy.check_tpu_hosts(4, 0, 'my-pod')

    def test_float16_on_tpu_is_refused_at_start(self):
        with self.assertRaisesRegex(ConfigError, 'mixed_float16 needs loss scaling'):
            Config(strategy='tpu', tpu='local', precision='mixed_float16')
        Config(strategy='mirrored', precision='mixed_float16')


if __name__ == '__main__':
    tf.test.main()
