"""Collectives over subgroups of replicas: the one module that knows TPU collective ops.

Group assignments are pure Python (tested against hand-written tables). ``grouped_all_reduce`` uses the TPU's
grouped cross-replica sum under TPUStrategy and, under every other strategy, one all-reduce of a tensor in which
each replica fills its group's row: the same result, so the tests run the algorithm on 8 logical CPU devices.

Replicas on a mesh: the mesh is X x Y chips with ``cores_per_chip`` replicas each (2 on TPU v3), indexed
row-major over chips with a chip's cores consecutive: mesh index = (y * X + x) * cores_per_chip + core. The replica
at mesh index m is ``replica_order[m]`` (on a TPU slice, tpu_mesh.Placement.replica_order: TPUStrategy numbers
replicas host by host, not along the torus); without ``replica_order`` replica m sits at mesh index m.
"""

import math
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf


def tile_shape(group_size: int, cores_per_chip: int = 2, mesh_shape: Optional[Sequence[int]] = None
               ) -> Tuple[int, int]:
    """Chips (x, y) of the 2-D tile holding one group: 8 -> (2, 2), 16 -> (2, 4), 32 -> (4, 4), 64 -> (4, 8)
    with 2 cores per chip, the tiles of Google's MLPerf TPU submissions (square, else twice as long in y). On a
    ``mesh_shape`` (X, Y chips) that such a tile does not divide, the tile nearest that shape which does (one
    always does when the group's chips divide X * Y: they are a power of two)."""
    if group_size % cores_per_chip:
        raise ValueError(f'a group of {group_size} replicas is not a whole number of {cores_per_chip}-core chips')
    chips = group_size // cores_per_chip
    if chips & (chips - 1):
        raise ValueError(f'2-D tiles need a power-of-two number of chips per group, got {chips}')
    preferred = int(math.log2(chips)) // 2
    if mesh_shape is None:
        return 2 ** preferred, chips // 2 ** preferred
    fitting = [power for power in range(int(math.log2(chips)) + 1)
               if mesh_shape[0] % 2 ** power == 0 and mesh_shape[1] % (chips // 2 ** power) == 0]
    if not fitting:
        raise ValueError(f'no tile of {chips} chips divides the {mesh_shape[0]}x{mesh_shape[1]} mesh')
    power = min(fitting, key=lambda p: (abs(p - preferred), p))
    return 2 ** power, chips // 2 ** power


def _placed(groups: List[List[int]], replica_order: Optional[Sequence[int]], keep_order: bool = False):
    """Groups of mesh indexes as groups of the replicas at those places (each sorted, unless ``keep_order``)."""
    if replica_order is None:
        return groups
    if len(replica_order) != sum(len(group) for group in groups):
        raise ValueError(f'replica order of {len(replica_order)} replicas for a mesh of '
                         f'{sum(len(group) for group in groups)}')
    placed = [[replica_order[index] for index in group] for group in groups]
    return placed if keep_order else sorted(sorted(group) for group in placed)


def group_assignment(num_replicas: int, group_size: int, mesh_shape: Optional[Sequence[int]] = None,
                     cores_per_chip: int = 2, replica_order: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Replica ids of each group (sorted), groups in order of their first replica.

    Without ``mesh_shape``: groups of consecutive mesh indexes [0..k-1], [k..2k-1], .... With ``mesh_shape`` =
    (X, Y) chips: each group is a tile_shape(group_size) block of neighbouring chips (all their cores), so a
    group's collective stays on neighbouring links. ``replica_order``: the replica at each mesh index (module
    docstring).
    """
    if group_size < 1 or num_replicas % group_size:
        raise ValueError(f'group size {group_size} does not divide the {num_replicas} replicas')
    if mesh_shape is None or group_size == 1:
        return _placed([list(range(start, start + group_size)) for start in range(0, num_replicas, group_size)],
                       replica_order)
    mesh_x, mesh_y = mesh_shape
    if mesh_x * mesh_y * cores_per_chip != num_replicas:
        raise ValueError(f'mesh {mesh_x}x{mesh_y} chips x {cores_per_chip} cores is not {num_replicas} replicas')
    tile_x, tile_y = tile_shape(group_size, cores_per_chip, mesh_shape)
    groups = []
    for y0 in range(0, mesh_y, tile_y):
        for x0 in range(0, mesh_x, tile_x):
            groups.append(sorted((y * mesh_x + x) * cores_per_chip + core
                                 for y in range(y0, y0 + tile_y) for x in range(x0, x0 + tile_x)
                                 for core in range(cores_per_chip)))
    return _placed(sorted(groups), replica_order)


def is_tpu_strategy(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` is a TPU strategy: tf.distribute.TPUStrategy or tf.distribute.experimental.TPUStrategy
    (a class of its own in TF 2.20, not a subclass)."""
    return isinstance(strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy))


def _on_tpu() -> bool:
    return is_tpu_strategy(tf.distribute.get_strategy())


def _tpu_grouped_sum(value: tf.Tensor, groups: List[List[int]]) -> tf.Tensor:
    return tf.raw_ops.CrossReplicaSum(input=value, group_assignment=tf.constant(groups, tf.int32))


def replica_sum(value: tf.Tensor) -> tf.Tensor:
    """Sum of ``value`` over all replicas (replica context), differentiable: its gradient is again the sum.

    The same as ReplicaContext.all_reduce(SUM, value) but cheap to trace. That call wraps the collective in
    tf.custom_gradient, which walks the graph backward from the collective's outputs to its inputs looking for
    variables; when the reduction joins the replicas' graphs (ReductionToOneDevice, merge_call) the walk leaves
    through the other replicas' inputs and covers every replica's graph, once per collective, so tracing a step
    with ~100 batch-norm collectives grew quadratically (a ResNet-50 step on 8 logical devices traced for over
    15 minutes). Here the collective sees the inputs through tf.stop_gradient, where that walk ends, and the
    gradient is supplied by hand.
    """
    context = tf.distribute.get_replica_context()

    @tf.custom_gradient
    def summed(x):
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stop_gradient(x)), replica_sum

    return summed(value)


def _placed_sum(context, value, groups) -> Tuple[tf.Tensor, tf.Tensor]:
    """(sum over all replicas, sum over this replica's group) from one all-reduce (differentiable).

    Each replica writes its value into its group's row of a [num_groups, ...] tensor of zeros; one SUM
    all-reduce then holds every group's sum in its row. The message is num_groups times larger than ``value``,
    which is small for batch-norm statistics (2C + 1 floats), and the all-reduce's gradient is again an
    all-reduce (an all_gather would also work, but its gradient builds a far larger graph: tracing a ResNet-18
    step on 8 replicas took 117 s that way on a 2-core CPU, against 57 s for a plain all-reduce).
    """
    num_replicas = context.num_replicas_in_sync
    in_group = [[0.0] * len(groups) for _ in range(num_replicas)]   # in_group[r][g] = 1 if replica r is in group g
    for index, group in enumerate(groups):
        for replica in group:
            in_group[replica][index] = 1.0
    mine = tf.gather(tf.constant(in_group, value.dtype), context.replica_id_in_sync_group)       # [num_groups]
    placed = tf.reshape(mine, [-1] + [1] * len(value.shape)) * value[tf.newaxis]              # [num_groups, ...]
    sums = replica_sum(placed)
    return tf.reduce_sum(sums, axis=0), tf.tensordot(mine, sums, axes=1)


def all_and_grouped_sum(value: tf.Tensor, group_size: int, mesh_shape: Optional[Sequence[int]] = None,
                        cores_per_chip: int = 2, need_total: bool = True,
                        replica_order: Optional[Sequence[int]] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """(sum of ``value`` over all replicas, sum over this replica's group), in replica context; differentiable.

    group_size 1 gives ``value`` as the group sum; group_size = all replicas is one plain all-reduce. On TPU the
    group sum is the grouped cross-replica sum (and the total, if ``need_total``, a second collective);
    elsewhere both come from one all-reduce (_placed_sum). Outside a strategy both are ``value``. The total is None when
    ``need_total`` is False and computing it would cost a collective.
    """
    context = tf.distribute.get_replica_context()
    num_replicas = context.num_replicas_in_sync if context else 1
    if num_replicas == 1:
        return value, value
    if group_size == num_replicas:
        total = replica_sum(value)
        return total, total
    if group_size == 1 and not need_total:
        return None, value
    groups = group_assignment(num_replicas, group_size, mesh_shape, cores_per_chip, replica_order)
    if _on_tpu() or (group_size == 1 and need_total):
        total = replica_sum(value) if need_total else None
        grouped = value if group_size == 1 else _tpu_grouped_sum(value, groups)
        return total, grouped
    return _placed_sum(context, value, groups)


def grouped_all_reduce(value: tf.Tensor, group_size: int, mesh_shape: Optional[Sequence[int]] = None,
                       cores_per_chip: int = 2, replica_order: Optional[Sequence[int]] = None) -> tf.Tensor:
    """Sum of ``value`` over the replicas of this replica's group (replica context); differentiable.

    group_size 1 returns ``value``, group_size = all replicas is a plain all-reduce, and outside a strategy
    (one replica) it returns ``value``.
    """
    return all_and_grouped_sum(value, group_size, mesh_shape, cores_per_chip, need_total=False,
                               replica_order=replica_order)[1]


# ---------------------------------------------------------------------------------------------------------------
# 2-D torus all-reduce of gradients (Ying et al. 2018).
#
# On an X x Y mesh of replicas (mesh index = y * X + x: a row is X consecutive indexes, a column every X-th) a sum
# over all N = X * Y replicas is done in three phases, on a few large buckets rather than ~160 small tensors:
#   1. reduce-scatter within each row: replica x of a row ends with the row's sum of chunk x of the bucket;
#   2. all-reduce within each column: chunk x summed over the whole mesh;
#   3. all-gather within each row: every replica gets every chunk back.
# Latency hops fall from 2(N - 1) for a ring to 2(X + Y - 2), for the same bandwidth term.

DEFAULT_BUCKET_BYTES = 32 * 2 ** 20


def default_mesh_shape(num_replicas: int) -> Tuple[int, int]:
    """The most square (X, Y) with X * Y = num_replicas and X >= Y."""
    y = max(d for d in range(1, int(math.isqrt(num_replicas)) + 1) if num_replicas % d == 0)
    return num_replicas // y, y


def mesh_groups(mesh_shape: Sequence[int], replica_order: Optional[Sequence[int]] = None
                ) -> Tuple[List[List[int]], List[List[int]]]:
    """(rows, columns) of replica ids on an X x Y mesh, mesh index = y * X + x, each in mesh order (the order
    of the chunks a row's members hold); ``replica_order``: the replica at each mesh index."""
    mesh_x, mesh_y = mesh_shape
    rows = [[y * mesh_x + x for x in range(mesh_x)] for y in range(mesh_y)]
    columns = [[y * mesh_x + x for y in range(mesh_y)] for x in range(mesh_x)]
    return _placed(rows, replica_order, keep_order=True), _placed(columns, replica_order, keep_order=True)


def bucket_layout(sizes: Sequence[int], bytes_per_element: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Consecutive tensors packed into buckets of about ``bucket_bytes``: a list of lists of tensor indexes."""
    buckets, current, current_bytes = [], [], 0
    for index, size in enumerate(sizes):
        if current and current_bytes + size * bytes_per_element > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size * bytes_per_element
    if current:
        buckets.append(current)
    return buckets


def _tpu_reduce_scatter(flat, rows, row_size):
    # TF 2.20's pip build has no XlaReduceScatter: AllToAll sends chunk j to row member j, then sum locally.
    chunks = tf.reshape(flat, [row_size, -1])
    received = tf.raw_ops.AllToAll(input=chunks, group_assignment=tf.constant(rows, tf.int32), concat_dimension=0,
                                   split_dimension=0, split_count=row_size)
    return tf.reduce_sum(received, axis=0)


def _tpu_all_gather(chunk, rows, row_size):
    tiled = tf.tile(chunk[tf.newaxis], [row_size, 1])
    gathered = tf.raw_ops.AllToAll(input=tiled, group_assignment=tf.constant(rows, tf.int32), concat_dimension=0,
                                   split_dimension=0, split_count=row_size)
    return tf.reshape(gathered, [-1])


def _position_in(groups, replica_id: tf.Tensor) -> tf.Tensor:
    """This replica's index within its group (int32 scalar)."""
    position = [0] * sum(len(g) for g in groups)
    for group in groups:
        for index, replica in enumerate(group):
            position[replica] = index
    return tf.gather(tf.constant(position, tf.int32), replica_id)


def _reduce_2d_flat(flat: tf.Tensor, context, rows, columns, row_size: int) -> tf.Tensor:
    """Sum over all replicas of a 1-D tensor whose length is a multiple of row_size, in the three phases."""
    if _on_tpu():
        chunk = _tpu_reduce_scatter(flat, rows, row_size)
        chunk = _tpu_grouped_sum(chunk, columns)
        return _tpu_all_gather(chunk, rows, row_size)
    # Every other strategy: the same three phases from grouped sums (collectives over subgroups are not
    # exposed there). Phase 1 keeps only this replica's chunk of the row sum.
    position = _position_in(rows, context.replica_id_in_sync_group)
    chunks = tf.reshape(_placed_sum(context, flat, rows)[1], [row_size, -1])
    chunk = tf.gather(chunks, position)                                     # phase 1: reduce-scatter in the row
    chunk = _placed_sum(context, chunk, columns)[1]                          # phase 2: all-reduce in the column
    slots = tf.one_hot(position, row_size, dtype=chunk.dtype)[:, tf.newaxis] * chunk[tf.newaxis]
    return tf.reshape(_placed_sum(context, slots, rows)[1], [-1])           # phase 3: all-gather in the row


def all_reduce_2d(values: Sequence[tf.Tensor], mesh_shape: Sequence[int], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  dtype: Optional[tf.DType] = None, replica_order: Optional[Sequence[int]] = None) -> List[tf.Tensor]:
    """Sums each tensor of ``values`` over all replicas (replica context) with the 2-D algorithm above.

    mesh_shape: (X, Y) replicas, X * Y = the replica count. Tensors are packed into buckets of about
    ``bucket_bytes``, each padded to a multiple of X. ``dtype`` (e.g. tf.bfloat16) sums in that type, half the
    bytes, and returns the original types. ``replica_order``: the replica at each mesh index (module docstring).
    Outside a strategy it returns the values unchanged.
    """
    context = tf.distribute.get_replica_context()
    num_replicas = context.num_replicas_in_sync if context else 1
    values = list(values)
    if num_replicas == 1:
        return values
    mesh_x, mesh_y = mesh_shape
    if mesh_x * mesh_y != num_replicas:
        raise ValueError(f'mesh {mesh_x}x{mesh_y} does not hold the {num_replicas} replicas')
    rows, columns = mesh_groups(mesh_shape, replica_order)
    sum_dtype = dtype or values[0].dtype
    sizes = [int(math.prod(v.shape)) for v in values]
    results = [None] * len(values)
    for bucket in bucket_layout(sizes, sum_dtype.size, bucket_bytes):
        flat = tf.concat([tf.reshape(tf.cast(values[i], sum_dtype), [-1]) for i in bucket], axis=0)
        length = sum(sizes[i] for i in bucket)
        padded = -(-length // mesh_x) * mesh_x
        flat = tf.pad(flat, [[0, padded - length]])
        summed = _reduce_2d_flat(flat, context, rows, columns, mesh_x)[:length]
        offset = 0
        for i in bucket:
            piece = summed[offset:offset + sizes[i]]
            results[i] = tf.cast(tf.reshape(piece, values[i].shape), values[i].dtype)
            offset += sizes[i]
    return results
