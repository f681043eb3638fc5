"""Keras's batch norm computed faster on CPU-only machines.

BatchNormalization is Keras's layer, computed faster on CPUs. With TensorFlow's oneDNN kernels, the fused
batch-norm forward pass on channels-last maps is several times slower per element than its backward pass
(docs/benchmarks.md; docs/design.md, "Batch norm on CPU"). On CPU this layer takes the mean and the variance with
two matrix products (ones [1, n] x the map as [n, C], then x its squared deviations), normalizes with one
multiply-add per element, and leaves the backward pass to the same fused gradient kernel, given those
statistics: the same function and the same variables, so a checkpoint of either layer loads into the other.

Which formulation of the training step is fastest depends on the CPU (AMD without AVX-512 and Intel with it rank
them differently: docs/benchmarks.md), so, as the convolutions are (convolution.py), each per-replica shape is
timed once on the machine, forward and backward: 'matmul' (the statistics as matrix products), 'reduce' (the same
with TensorFlow's mean reductions), 'fused' (Keras's fused kernel, the layer's own code) and, where the machine
can compile them, 'native' (our own kernels, native.py: fewer passes over the map). Keras's kernel is the
one to beat: another formulation replaces it only when it took at most MARGIN of its time, so that a close call
keeps Keras's code rather than flipping with the timing's noise (docs/benchmarks.md B10). Shapes under
MIN_ELEMENTS, runs with op determinism and batches of unknown size keep DEFAULT untimed ('matmul', the fastest on
the CPU without AVX-512, B5). The choices are kept per machine (tuning.py).

A layer whose output only a ReLU takes (as in ResNet, 33 of its 53) is timed with that ReLU and its gradient:
TensorFlow's graph optimizer fuses the ReLU into Keras's kernel (_FusedBatchNormEx, where oneDNN runs), while
after 'matmul' and 'reduce' the ReLU is a pass of its own over the map, which costs more inside the network's
step than timed alone (docs/benchmarks.md S44). Our kernels apply the ReLU themselves where only ReLU layers of
this module take the output (ReLU below, which passes on what they rectified), and recompute its mask from x in
the backward pass: no ReLU op runs in either direction (docs/benchmarks.md B13). After Keras's own ReLU layers
they do not, and they are timed with the ReLU op after them (relu_after: 'keras_relu').
"""

import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras as keras
from tensorflow.python.framework import config as tf_config  # is_op_determinism_enabled: no public API

from imagenet_tpu.cpu import native, tuning
from imagenet_tpu.distribute import collectives

FORMULATIONS = ('matmul', 'reduce', 'fused', 'native')
# What maps that are not timed use.
DEFAULT = 'matmul'
# The formulation the others must beat by MARGIN on the maps that are timed: Keras's own.
INCUMBENT = 'fused'
MARGIN = 0.97
# Maps smaller than this many elements keep 'matmul' untimed. Timing a shape takes a fraction of a second once per
# machine; ResNet-50's smallest batch-norm maps at 128 px and batch 32 (4x4x512, 262,144 elements; 8x8x256) are
# timed: 16 of its 53 layers, where an earlier limit of a million left them to 'matmul' and Keras's fused kernel
# was faster (docs/benchmarks.md S37).
MIN_ELEMENTS = 200_000


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


def normalize_training(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor, epsilon: float,
                       statistics: str = 'matmul'):
    """Batch norm in training mode of float32 NHWC maps x: (y, batch mean, biased batch variance).

    With ``statistics`` 'matmul' they are two matrix products with X the map as [n, C]: mean = ones [1, n] x X /
    n, then variance = ones x (X - mean)^2 / n (two passes: no cancellation when a channel's mean is far from 0);
    with 'reduce' the same two passes as TensorFlow's mean reductions. y = x * a + b per channel. The gradient is
    TensorFlow's fused batch-norm gradient kernel (the one Keras's fused layer uses) given these statistics: the
    gradient of the whole function, through mean and variance, with respect to x, gamma and beta."""
    channels = x.shape[-1]

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        rows = tf.reshape(x, [-1, channels])
        if statistics == 'reduce':
            mean = tf.reduce_mean(rows, axis=0, keepdims=True)
            variance = tf.reduce_mean(tf.math.squared_difference(rows, mean), axis=0)
        else:
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


def normalize_native(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor, epsilon: float, relu: bool = False):
    """normalize_training's (y, batch mean, biased batch variance) by our own kernels (native.py,
    kernels/batch_norm.cc); with ``relu``, y is relu(batch norm) and its gradient goes through the ReLU, so that no
    ReLU op follows (the kernels recompute its mask from x)."""
    kernels = native.library()

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        y, mean, variance = kernels.imagenet_tpu_batch_norm(x, gamma, beta, epsilon=epsilon, relu=relu)

        def gradient(dy, *unused_statistics_gradients):
            return tuple(kernels.imagenet_tpu_batch_norm_grad(dy, x, gamma, beta, mean, variance, epsilon=epsilon,
                                                              relu=relu))

        return (y, tf.stop_gradient(mean), tf.stop_gradient(variance)), gradient

    return normalize(x, gamma, beta)


def formulations() -> Tuple[str, ...]:
    """The FORMULATIONS this machine can run: 'native' only where our kernels build and load (native.py)."""
    return tuple(name for name in FORMULATIONS if name != 'native' or native.available())


def training_output(formulation: str, x, gamma, beta, epsilon: float):
    """The training-mode output of ``formulation`` (FORMULATIONS)."""
    if formulation == 'native':
        return normalize_native(x, gamma, beta, epsilon)[0]
    if formulation == 'fused':
        return tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, epsilon=epsilon, is_training=True)[0]
    return normalize_training(x, gamma, beta, epsilon, statistics=formulation)[0]


# The ReLU after a batch norm, as the tuner times it (relu_after): none; 'relu', ReLU layers of this module,
# which our kernels apply; 'keras_relu', other plain ReLU layers, a ReLU op after our kernels. After Keras's kernel
# TensorFlow's graph optimizer fuses either.
RELUS = ('', 'relu', 'keras_relu')


def training_step(formulation: str, x, gamma, beta, dy, epsilon: float, relu: str = ''):
    """(y, dx, dgamma, dbeta) of ``formulation``: its forward pass and the kernels its gradient runs, called
    directly (no GradientTape: timing runs inside tf.init_scope while a step is traced, where tapes are paused).
    With a ``relu`` (RELUS), of relu(batch norm): y is the ReLU's output and dy the gradient at it."""
    if formulation == 'native':
        kernels = native.library()
        in_kernel = relu == 'relu'
        y, mean, variance = kernels.imagenet_tpu_batch_norm(x, gamma, beta, epsilon=epsilon, relu=in_kernel)
        if relu and not in_kernel:
            y = tf.nn.relu(y)
            dy = tf.raw_ops.ReluGrad(gradients=dy, features=y)
        return (y, *kernels.imagenet_tpu_batch_norm_grad(dy, x, gamma, beta, mean, variance, epsilon=epsilon,
                                                          relu=in_kernel))
    if formulation == 'fused':
        y, _, _, saved_mean, saved_variance, reserve = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=gamma, offset=beta, mean=tf.zeros([0]), variance=tf.zeros([0]), epsilon=epsilon,
            data_format='NHWC', is_training=True)
    else:
        y, saved_mean, saved_variance = normalize_training(x, gamma, beta, epsilon, statistics=formulation)
        reserve = tf.zeros([0], x.dtype)
    if relu:
        y = tf.nn.relu(y)
        dy = tf.raw_ops.ReluGrad(gradients=dy, features=y)
    dx, dgamma, dbeta = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=gamma, reserve_space_1=saved_mean, reserve_space_2=saved_variance,
        reserve_space_3=reserve, epsilon=epsilon, data_format='NHWC', is_training=True)[:3]
    return y, dx, dgamma, dbeta


@tf.autograph.experimental.do_not_convert     # Python that times eagerly, also when called while tracing
def measure(shape: Tuple[int, ...], relu: str = '', repeats: int = 10, epsilon: float = 1e-3) -> Dict[str, float]:
    """Seconds of a training step's batch norm (training_step: forward, and the gradients of x, gamma and beta;
    with a ``relu`` (RELUS), of that ReLU after it too) of each formulation on float32 maps of ``shape``, each as a
    tf.function (so with the graph optimizer's fusions), shortest of ``repeats`` after a warm-up, the formulations
    taking turns run by run (tuning.shortest_in_turns)."""
    channels = shape[-1]
    x = tf.random.normal(shape) * 0.5 + 1.0
    dy = tf.random.normal(shape)
    gamma, beta = tf.ones([channels]), tf.zeros([channels])
    runs = {}
    for formulation in formulations():
        step = tf.function(lambda x, gamma, beta, dy, formulation=formulation: training_step(
            formulation, x, gamma, beta, dy, epsilon, relu))
        runs[formulation] = lambda step=step: [value.numpy() for value in step(x, gamma, beta, dy)]
    return tuning.shortest_in_turns(runs, repeats)


def fastest(seconds: Dict[str, float], incumbent: str = INCUMBENT) -> str:
    """The formulation of least time if it took at most MARGIN of ``incumbent``'s, else ``incumbent``."""
    best = min(seconds, key=seconds.get)
    return best if seconds[best] <= MARGIN * seconds[incumbent] else incumbent


_choices: Dict[Tuple[Tuple[int, ...], str], str] = {}
_lock = threading.Lock()


@tf.autograph.experimental.do_not_convert
def choose(shape: Sequence[int], measure_fn: Optional[Callable] = None, may_measure: bool = True,
           relu: str = '') -> str:
    """The formulation for training maps of ``shape`` (followed by a ``relu``, RELUS): this process's choice,
    else the machine's cache's, else (``may_measure``) measured (``measure_fn(shape, relu)``; the fastest against
    INCUMBENT) and remembered in both; else DEFAULT. Small maps keep DEFAULT unmeasured."""
    shape = tuple(int(size) for size in shape)
    elements = 1
    for size in shape:
        elements *= size
    if elements < MIN_ELEMENTS:
        return DEFAULT
    with _lock:
        if (shape, relu) not in _choices:
            key = ','.join(str(size) for size in shape) + (',' + relu if relu else '')
            choice = tuning.CACHE.get('batch_norm', key)
            if choice not in formulations():
                if not may_measure:
                    return DEFAULT
                with tf.init_scope():      # eagerly, also while a tf.function is being traced
                    choice = fastest((measure_fn or measure)(shape, relu))
                tuning.CACHE.put('batch_norm', key, choice)
            _choices[shape, relu] = choice
        return _choices[shape, relu]


def feeds_only_relu(layer: keras.layers.Layer, kind: Optional[type] = None) -> bool:
    """Whether the layer's output, in the functional models built from it, goes to plain ReLUs and nothing else
    (keras.layers.ReLU or Activation('relu') with their defaults: tf.nn.relu, which the graph optimizer fuses);
    with ``kind``, to plain ReLUs of that class."""
    consumers = [node.layer for node in getattr(layer, '_outbound_nodes', ())]
    return bool(consumers) and all(_is_plain_relu(consumer) and (kind is None or isinstance(consumer, kind))
                                   for consumer in consumers)


def relu_after(layer: keras.layers.Layer) -> str:
    """The ReLU after the layer in its functional models (RELUS): 'relu' where only ReLU layers of this module
    take its output, 'keras_relu' where only plain ReLUs take it and some are not ours, else ''."""
    if feeds_only_relu(layer, ReLU):
        return 'relu'
    return 'keras_relu' if feeds_only_relu(layer) else ''


def _is_plain_relu(layer) -> bool:
    if isinstance(layer, keras.layers.ReLU):
        return (layer.max_value is None and float(layer.negative_slope) == 0.0
                and float(layer.threshold) == 0.0)
    return isinstance(layer, keras.layers.Activation) and layer.activation is keras.activations.relu


def tune_network(network: keras.Model, batch_size: int) -> Dict[Tuple[int, ...], str]:
    """Times every shape of the network's BatchNormalization layers (ours, built, using their own kernels) for
    batches of ``batch_size`` per replica now, before training starts; returns {shape: formulation}, the shapes
    of layers followed by a ReLU with a last entry, the kind of ReLU (relu_after). Nothing with op determinism
    on."""
    if tf_config.is_op_determinism_enabled():
        return {}
    choices = {}
    for layer in network.submodules:
        if isinstance(layer, BatchNormalization) and layer.built and layer._use_cpu_kernels:  # pylint: disable=protected-access
            try:
                shape = layer.input_shape
            except (AttributeError, RuntimeError):
                continue
            if (isinstance(shape, tuple) and len(shape) == 4 and layer.axis == [3] and layer.dtype == 'float32'
                    and layer.compute_dtype == 'float32' and all(size is not None for size in shape[1:])):
                full = (batch_size, *shape[1:])
                relu = relu_after(layer)
                choices[full + ((relu,) if relu else ())] = choose(full, relu=relu)
    return choices


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
        formulation = self.formulation(inputs.shape)
        if formulation == 'fused':
            return super().call(inputs, training=training, mask=mask)
        # Our kernels apply the ReLU where only our ReLU layers take the output (they pass it on), so that no
        # ReLU op runs in either direction: what the tuner timed as relu_after's 'relu'.
        rectify = formulation == 'native' and relu_after(self) == 'relu'
        if formulation == 'native':
            outputs, mean, variance = normalize_native(inputs, self.gamma, self.beta, self.epsilon, relu=rectify)
        else:
            outputs, mean, variance = normalize_training(inputs, self.gamma, self.beta, self.epsilon, formulation)
        count = tf.cast(tf.size(inputs, tf.int64) // tf.shape(inputs, tf.int64)[-1], variance.dtype)
        unbiased = variance * count / tf.maximum(count - 1.0, 1.0)
        # Under a strategy a replica may get an empty batch: as Keras, it leaves the moving statistics alone
        # (its statistics are NaN).
        batch = tf.shape(inputs)[0] if self._support_zero_size_input() else None
        self.add_update(lambda: self._assign_moving_average(self.moving_mean, mean, self.momentum, batch))
        self.add_update(lambda: self._assign_moving_average(self.moving_variance, unbiased, self.momentum, batch))
        if rectify:
            setattr(outputs, RECTIFIED, True)     # the ReLU after the layer passes it on (ReLU below)
        return outputs

    def formulation(self, shape) -> str:
        """The training formulation for maps of ``shape`` (choose; with the ReLU after the layer where only a
        ReLU takes its output), DEFAULT where it is not fully known or op determinism is on. A shape not yet
        timed is timed only under one replica."""
        shape = tf.TensorShape(shape)
        if not shape.is_fully_defined() or tf_config.is_op_determinism_enabled():
            return DEFAULT
        return choose(shape.as_list(), may_measure=tf.distribute.get_strategy().num_replicas_in_sync == 1,
                      relu=relu_after(self))

    def get_config(self):
        config = super().get_config()
        config.update(cpu_kernels=self.cpu_kernels)
        return config


# The attribute that marks a tensor as a batch norm's output already passed through its ReLU.
RECTIFIED = '_imagenet_tpu_rectified'


@keras.utils.register_keras_serializable('imagenet_tpu')
class ReLU(keras.layers.ReLU):
    """keras.layers.ReLU, which passes on unchanged what a BatchNormalization with our own kernels ('native')
    already rectified: that layer, when only ReLU layers of this class take its output, applies the ReLU in its
    kernels (and its gradient), and max(y, 0) = y on what it returns. Anything else is Keras's ReLU.

    So in training mode on a CPU-only machine such a batch norm's own output is already rectified: a model that
    ends at it (a feature extractor cut at the batch norm rather than at its ReLU) returns relu(batch norm) when
    called with training=True. Inference (training=False) never uses these kernels."""

    def call(self, inputs):
        if getattr(inputs, RECTIFIED, False):
            return inputs
        return super().call(inputs)
