"""Batch normalization over subgroups of replicas (Ying et al. 2018) and batch norm without moving averages
(Akiba et al. 2017). Per-replica batch norm with moving averages is Keras's own layer.

GroupBatchNormalization normalizes each replica's batch with the statistics of its group of ``group_size``
replicas: per replica, the per-channel sum, sum of squares and count are computed in float32 (also under a
mixed_bfloat16 policy), summed over the group in one collective, and mean = S1 / n, var = S2 / n - mean^2.
Gradients flow through the collective, so each replica's input gradient is that of batch norm over the group's
concatenated batch. group_size=1 is per-replica batch norm, group_size=all replicas is synchronized batch norm.
Outside a strategy it is plain batch norm, so the model can be built and used anywhere.

What inference uses (``inference_statistics``):
  'moving_average'  moving averages of the group statistics (Keras's rule, with ``momentum``);
  'last_batch'      Akiba et al.: the moving statistics are replaced at every training step by the statistics of
                    that step's whole global batch (all replicas), so evaluation uses the last minibatch's;
  'reestimate'      the moving statistics are recomputed before each evaluation from K training batches
                    (reestimate_statistics below; builders.py adds it as a callback).
Evaluation, checkpoints and SavedModel exports all read the moving-statistics variables, so they all use the
chosen statistics.
"""

import weakref
from typing import Callable, Optional, Sequence

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.config import BN_INFERENCE_STATISTICS as INFERENCE_STATISTICS
from imagenet_tpu.distribute import collectives



def _local_sums(x: tf.Tensor, axes) -> tf.Tensor:
    """[sum (C), sum of squares (C), count (1)] of x over ``axes``, float32, as one vector for one collective."""
    x = tf.cast(x, tf.float32)
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), tf.float32)
    return tf.concat([tf.reshape(tf.reduce_sum(x, axes), [-1]), tf.reshape(tf.reduce_sum(tf.square(x), axes), [-1]),
                      count[tf.newaxis]], axis=0)


def _moments_from_sums(sums: tf.Tensor, channels: int):
    mean = tf.math.divide_no_nan(sums[:channels], sums[-1])
    mean_square = tf.math.divide_no_nan(sums[channels:2 * channels], sums[-1])
    return mean, tf.maximum(mean_square - tf.square(mean), 0.0)


@keras.utils.register_keras_serializable('imagenet_tpu')
class GroupBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training statistics are those of a group of replicas.

    Args: group_size (replicas per group, a divisor of the replica count; default 1), mesh_shape (optional
    (X, Y) chips: groups become 2-D tiles, see collectives.group_assignment), cores_per_chip (default 2),
    replica_order (optional: the replica at each mesh index, on a TPU slice; collectives.py),
    inference_statistics ('moving_average', 'last_batch' or 'reestimate'), and every argument of
    BatchNormalization (axis, momentum, epsilon, center, scale, initializers, regularizers).
    """

    def __init__(self, group_size: int = 1, mesh_shape: Optional[Sequence[int]] = None, cores_per_chip: int = 2,
                 inference_statistics: str = 'moving_average', replica_order: Optional[Sequence[int]] = None,
                 **kwargs):
        kwargs['fused'] = False       # the fused kernel computes its own statistics
        kwargs.pop('synchronized', None)
        super().__init__(**kwargs)
        if inference_statistics not in INFERENCE_STATISTICS:
            raise ValueError(f'inference_statistics must be one of {INFERENCE_STATISTICS}, '
                             f'got {inference_statistics!r}')
        self.group_size = group_size
        self.mesh_shape = tuple(mesh_shape) if mesh_shape else None
        self.cores_per_chip = cores_per_chip
        self.replica_order = tuple(replica_order) if replica_order is not None else None
        self.inference_statistics = inference_statistics
        self._global_moments = None

    def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
        if mask is not None:
            raise ValueError('GroupBatchNormalization does not support masks')
        channels = inputs.shape[-1] if self.axis in ([-1], [len(inputs.shape) - 1]) else None
        if channels is None:
            raise ValueError('GroupBatchNormalization expects channels-last inputs (axis=-1)')
        sums = _local_sums(inputs, reduction_axes)
        total, grouped = collectives.all_and_grouped_sum(
            sums, self.group_size, self.mesh_shape, self.cores_per_chip,
            need_total=self.inference_statistics == 'last_batch', replica_order=self.replica_order)
        mean, variance = _moments_from_sums(grouped, channels)
        # Statistics of the whole global batch, kept for the moving-statistics update of 'last_batch'.
        self._global_moments = _moments_from_sums(tf.stop_gradient(total), channels) if total is not None else None
        if keep_dims:
            shape = [1] * (len(inputs.shape) - 1) + [channels]
            mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
        return mean, variance

    def _assign_moving_average(self, variable, value, momentum, inputs_size):
        if self.inference_statistics == 'last_batch' and self._global_moments is not None:
            global_mean, global_variance = self._global_moments
            replacement = global_mean if variable is self.moving_mean else global_variance
            return variable.assign(tf.cast(tf.reshape(replacement, variable.shape), variable.dtype))
        return super()._assign_moving_average(variable, value, momentum, inputs_size)

    def get_config(self):
        config = super().get_config()
        config.update(group_size=self.group_size, mesh_shape=self.mesh_shape, cores_per_chip=self.cores_per_chip,
                      inference_statistics=self.inference_statistics, replica_order=self.replica_order)
        return config


def group_batch_norm_factory(group_size: int = 1, momentum: float = 0.9, epsilon: float = 1e-5,
                             inference_statistics: str = 'moving_average',
                             mesh_shape: Optional[Sequence[int]] = None, cores_per_chip: int = 2,
                             replica_order: Optional[Sequence[int]] = None) -> Callable:
    """A resnet.NormFactory making GroupBatchNormalization layers."""
    def make(name: str, zero_gamma: bool) -> keras.layers.Layer:
        return GroupBatchNormalization(group_size=group_size, mesh_shape=mesh_shape, cores_per_chip=cores_per_chip,
                                       inference_statistics=inference_statistics, replica_order=replica_order,
                                       momentum=momentum,
                                       epsilon=epsilon, name=name,
                                       gamma_initializer='zeros' if zero_gamma else 'ones')
    return make


def batch_norm_layers(network: keras.Model) -> list:
    """Every batch-norm layer of ``network`` (Keras's and ours), in order."""
    return [layer for layer in network.submodules if isinstance(layer, keras.layers.BatchNormalization)]


def reestimate_statistics(network: keras.Model, batches, steps: int,
                          strategy: Optional[tf.distribute.Strategy] = None) -> None:
    """Sets every batch-norm layer's moving mean and variance to the statistics of its inputs over ``steps``
    training batches, pooled over all replicas: mean = S1 / n and var = S2 / n - mean^2 with the sums taken over
    every image of every batch.

    ``batches``: an iterator of (images, labels[, weights]) batches (distributed, if ``strategy`` is given).
    The forward passes run in training mode (the statistics the model trained with); their side effects on the
    moving statistics are overwritten.
    """
    strategy = strategy or tf.distribute.get_strategy()
    sums_of = _sums_function(network, strategy)
    totals = None
    for _ in range(steps):
        sums = sums_of(next(batches))
        totals = sums if totals is None else [a + b for a, b in zip(totals, sums)]
    _assign_function(network, strategy)(totals)


_ASSIGN_FUNCTIONS = weakref.WeakKeyDictionary()     # network -> (strategy, tf.function)


def _assign_function(network: keras.Model, strategy: tf.distribute.Strategy):
    """The totals -> moving statistics assignment of reestimate_statistics: one replicated step in which each
    replica assigns its own copy of every statistic (traced once per network and strategy). Assigned from the host,
    each of the ~2 x 53 synchronized-on-read statistics of a ResNet-50 would be one remote assign per replica."""
    cached = _ASSIGN_FUNCTIONS.get(network)
    if cached is not None and cached[0] is strategy:
        return cached[1]
    layers = batch_norm_layers(network)

    def replica_step(totals):
        for layer, total in zip(layers, totals):
            mean, variance = _moments_from_sums(total, layer.moving_mean.shape[-1])
            layer.moving_mean.assign(tf.cast(tf.reshape(mean, layer.moving_mean.shape), layer.moving_mean.dtype))
            layer.moving_variance.assign(
                tf.cast(tf.reshape(variance, layer.moving_variance.shape), layer.moving_variance.dtype))

    @tf.function
    def assign(totals):
        strategy.run(replica_step, args=(totals,))

    _ASSIGN_FUNCTIONS[network] = (strategy, assign)
    return assign


_SUMS_FUNCTIONS = weakref.WeakKeyDictionary()     # network -> (strategy, tf.function)


def _sums_function(network: keras.Model, strategy: tf.distribute.Strategy):
    """The batch -> per-layer [S1, S2, n] function of reestimate_statistics, made (and traced) once per network
    and strategy rather than at every evaluation."""
    cached = _SUMS_FUNCTIONS.get(network)
    if cached is not None and cached[0] is strategy:
        return cached[1]
    probe = keras.Model(network.inputs, [layer.input for layer in batch_norm_layers(network)])

    @tf.function
    def sums_of(batch):
        def replica_sums(images):
            inputs = probe(images, training=True)
            inputs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
            local = [_local_sums(x, list(range(len(x.shape) - 1))) for x in inputs]
            return [collectives.replica_sum(s) for s in local]
        per_replica = strategy.run(replica_sums, args=(batch[0],))
        return [strategy.experimental_local_results(s)[0] for s in per_replica]

    _SUMS_FUNCTIONS[network] = (strategy, sums_of)
    return sums_of
