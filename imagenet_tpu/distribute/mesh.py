"""Where each TPU replica sits on the torus, from the topology the TPU system reports (pure Python and NumPy).

TPUStrategy numbers its replicas host by host: replica i is TPU device i % per_host of host i // per_host
(tensorflow/python/tpu/tpu_system_metadata.py sorts the devices by task, then device index). Where those devices
sit is known only from ``topology.device_coordinates`` ([hosts, devices per host, (x, y, z, core)]). On a slice of
several hosts, replica order is therefore not mesh order: a host holds a block of chips, and consecutive replica
ids jump from block to block.

collectives.py places batch-norm tiles and 2-D all-reduce rows on a mesh of X x Y' chips with R replicas each
(Y' = Y * Z for the 3-D tori of TPU v4 and later), mesh index m = (y' * X + x) * R + core, y' = z * Y + y. This
module gives the replica at each mesh index (``Placement.replica_order``), so that a group or a row built on the
mesh is made of the replicas that really sit there. The replicas keep TensorFlow's order: TF 2.20's distributed
input hands replica i the batch that host-major position i received (input_lib.py, _get_next_no_partial_batch_
handling; TPUExtended._enable_data_reorder is off), so an assignment that interleaved hosts would move every
replica's batch across hosts at every step. The strategy is built with the same order as an explicit
DeviceAssignment (``core_assignment``), so the order the groups are computed for is the order that runs.
"""

import dataclasses
from typing import Tuple

import numpy as np

Coordinates = Tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Replicas of a TPU slice on its torus.

    chips: (X, Y, Z) chips of the torus; replicas_per_chip: TPU devices per chip (2 on v2/v3, 1 on v4 and later
    with both cores as one device); coordinates[r] and hosts[r]: (x, y, z, core) and host (task) of replica r,
    replicas in TPUStrategy's order.
    """
    chips: Tuple[int, int, int]
    replicas_per_chip: int
    coordinates: Tuple[Coordinates, ...]
    hosts: Tuple[int, ...]

    @classmethod
    def from_topology(cls, device_coordinates) -> 'Placement':
        """From ``device_coordinates`` [hosts, devices per host, 4] (tf.tpu.experimental.Topology's). Raises
        ValueError for a slice whose chips do not fill a box (a degraded slice) or whose chips differ in
        device count."""
        coordinates = np.asarray(device_coordinates, dtype=np.int64)
        if coordinates.ndim != 3 or coordinates.shape[2] != 4:
            raise ValueError(f'device coordinates must be [hosts, devices, 4], got shape {coordinates.shape}')
        hosts = tuple(int(task) for task in np.repeat(np.arange(coordinates.shape[0]), coordinates.shape[1]))
        flat = [tuple(int(c) for c in row) for row in coordinates.reshape(-1, 4)]
        if len(set(flat)) != len(flat):
            raise ValueError('two TPU devices report the same coordinates')
        low = np.min(coordinates.reshape(-1, 4)[:, :3], axis=0)
        high = np.max(coordinates.reshape(-1, 4)[:, :3], axis=0)
        chips = tuple(int(n) for n in high - low + 1)
        cores = sorted({c[3] for c in flat})
        per_chip = {}
        for x, y, z, _ in flat:
            per_chip[(x, y, z)] = per_chip.get((x, y, z), 0) + 1
        if len(per_chip) != chips[0] * chips[1] * chips[2] or set(per_chip.values()) != {len(cores)}:
            raise ValueError(f'the slice does not fill a {chips[0]}x{chips[1]}x{chips[2]} box of chips with '
                             f'{len(cores)} devices each (missing chips?)')
        rank = {core: index for index, core in enumerate(cores)}
        shifted = tuple((x - int(low[0]), y - int(low[1]), z - int(low[2]), rank[core]) for x, y, z, core in flat)
        return cls(chips, len(cores), shifted, hosts)

    @property
    def num_replicas(self) -> int:
        return len(self.coordinates)

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))

    @property
    def chip_mesh(self) -> Tuple[int, int]:
        """(X, Y * Z) chips: the mesh that --mesh_shape names and batch-norm tiles are laid on."""
        x, y, z = self.chips
        return x, y * z

    @property
    def replica_mesh(self) -> Tuple[int, int]:
        """(X * replicas per chip, Y * Z) replicas: the 2-D all-reduce's rows and columns."""
        x, y_prime = self.chip_mesh
        return x * self.replicas_per_chip, y_prime

    def mesh_index(self, replica: int) -> int:
        """Index of ``replica`` on the mesh: (y' * X + x) * replicas_per_chip + core, y' = z * Y + y."""
        x, y, z, core = self.coordinates[replica]
        chips_x, chips_y, _ = self.chips
        return ((z * chips_y + y) * chips_x + x) * self.replicas_per_chip + core

    @property
    def replica_order(self) -> Tuple[int, ...]:
        """replica_order[m]: the replica at mesh index m."""
        order = [0] * self.num_replicas
        for replica in range(self.num_replicas):
            order[self.mesh_index(replica)] = replica
        return tuple(order)

    def core_assignment(self, device_coordinates) -> np.ndarray:
        """[replicas, 1, 4] topology coordinates of each replica in TPUStrategy's order, for
        tf.tpu.experimental.DeviceAssignment: the order TensorFlow's default gives, made explicit."""
        return np.asarray(device_coordinates, dtype=np.int32).reshape(-1, 1, 4)

