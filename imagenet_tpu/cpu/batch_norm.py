"""Keras's batch norm computed faster on CPU-only machines.

BatchNormalization is Keras's layer, computed faster on CPUs. With TensorFlow's oneDNN kernels, the fused
batch-norm forward pass on channels-last maps is several times slower per element than its backward pass
(docs/benchmarks.md; docs/design.md, "Batch norm on CPU"). On CPU this layer takes the mean and the variance with
two matrix products (ones [1, n] x the map as [n, C], then x its squared deviations), normalizes with one
multiply-add per element, and leaves the backward pass to the same fused gradient kernel, given those
statistics: the same function and the same variables, so a checkpoint of either layer loads into the other.
"""

from typing import Optional, Sequence

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.distribute import collectives


def places_on_accelerator(devices: Sequence[str]) -> bool:
    """Whether any of ``devices`` (TensorFlow device names) is a GPU or a TPU."""
    return any((tf.DeviceSpec.from_string(device).device_type or '').upper() in ('GPU', 'TPU')
               for device in devices)


def cpu_only() -> bool:
    """True where layers built now will run on the CPU: TensorFlow sees no GPU, and the strategy in scope is no
    TPU strategy and places no replica on a GPU or TPU (TPUs are not physical devices of the host)."""
    if tf.config.list_physical_devices('GPU'):
        return False
    strategy = tf.distribute.get_strategy()
    if collectives.is_tpu_strategy(strategy):
        return False
    try:
        devices = tuple(strategy.extended.worker_devices)
    except (RuntimeError, NotImplementedError, ValueError):
        devices = ()     # the default strategy: this host's default device
    return not places_on_accelerator(devices)


def _normalize_with(x, gamma, beta, mean, variance, epsilon):
    """gamma * (x - mean) / sqrt(variance + epsilon) + beta, as one multiply-add per element."""
    scale = gamma * tf.math.rsqrt(variance + epsilon)
    return x * scale + (beta - mean * scale)


def normalize_training(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor, epsilon: float):
    """Batch norm in training mode of float32 NHWC maps x: (y, batch mean, biased batch variance).

    The statistics are two matrix products with X the map as [n, C]: mean = ones [1, n] x X / n, then
    variance = ones x (X - mean)^2 / n (two passes: no cancellation when a channel's mean is far from 0);
    y = x * a + b per channel. The gradient is TensorFlow's fused batch-norm gradient kernel (the one
    Keras's fused layer uses) given these statistics: the gradient of the whole function, through mean and
    variance, with respect to x, gamma and beta."""
    channels = x.shape[-1]

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        rows = tf.reshape(x, [-1, channels])
        count = tf.shape(rows)[0]
        ones = tf.ones([1, count], x.dtype)
        mean = tf.matmul(ones, rows) / tf.cast(count, x.dtype)
        variance = tf.matmul(ones, tf.math.squared_difference(rows, mean)) / tf.cast(count, x.dtype)
        mean, variance = tf.reshape(mean, [channels]), tf.reshape(variance, [channels])
        y = _normalize_with(x, gamma, beta, mean, variance, epsilon)

        def gradient(dy, *unused_statistics_gradients):
            dx, dgamma, dbeta = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=dy, x=x, scale=gamma, reserve_space_1=mean, reserve_space_2=variance,
                reserve_space_3=tf.zeros([0], x.dtype), epsilon=epsilon, data_format='NHWC', is_training=True)[:3]
            return dx, dgamma, dbeta

        return (y, tf.stop_gradient(mean), tf.stop_gradient(variance)), gradient

    return normalize(x, gamma, beta)


@keras.utils.register_keras_serializable('imagenet_tpu')
class BatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization, with training and inference computed by normalize_training and one
    multiply-add per element where that is faster: float32 NHWC maps, where Keras would use its fused kernel, on
    a machine without GPU or TPU (``cpu_kernels=None`` decides so when the layer is built). Moving statistics
    follow Keras's fused layer: the moving variance averages the unbiased (n / (n - 1)) batch variance. Anything
    else (other dtypes, ranks or axes, masks, renorm, virtual batches, a symbolic ``training``) is Keras's code."""

    def __init__(self, cpu_kernels: Optional[bool] = None, **kwargs):
        super().__init__(**kwargs)
        self.cpu_kernels = cpu_kernels
        self._use_cpu_kernels = cpu_kernels

    def build(self, input_shape):
        super().build(input_shape)
        if self._use_cpu_kernels is None:
            self._use_cpu_kernels = cpu_only()

    def _own_kernels(self, inputs, mask) -> bool:
        return (self._use_cpu_kernels and mask is None and self.center and self.scale and not self.renorm
                and self.virtual_batch_size is None and self.adjustment is None and not self.synchronized
                and self.fused and self.compute_dtype == 'float32' and len(inputs.shape) == 4 and self.axis == [3])

    def call(self, inputs, training=None, mask=None):
        training_value = self._get_training_value(training)
        if not isinstance(training_value, bool):
            training_value = tf.get_static_value(training_value)
        if training_value is None or not self._own_kernels(inputs, mask):
            return super().call(inputs, training=training, mask=mask)
        inputs = tf.cast(inputs, self.compute_dtype)
        if not training_value:
            return _normalize_with(inputs, self.gamma, self.beta, self.moving_mean, self.moving_variance,
                                   self.epsilon)
        outputs, mean, variance = normalize_training(inputs, self.gamma, self.beta, self.epsilon)
        count = tf.cast(tf.size(inputs, tf.int64) // tf.shape(inputs, tf.int64)[-1], variance.dtype)
        unbiased = variance * count / tf.maximum(count - 1.0, 1.0)
        # Under a strategy a replica may get an empty batch: as Keras, it leaves the moving statistics alone
        # (its statistics are NaN).
        batch = tf.shape(inputs)[0] if self._support_zero_size_input() else None
        self.add_update(lambda: self._assign_moving_average(self.moving_mean, mean, self.momentum, batch))
        self.add_update(lambda: self._assign_moving_average(self.moving_variance, unbiased, self.momentum, batch))
        return outputs

    def get_config(self):
        config = super().get_config()
        config.update(cpu_kernels=self.cpu_kernels)
        return config
