"""Keras's Conv2D, with each of its three computations done the fastest of equivalent ways on CPUs.

A training step runs every convolution three times: the forward pass, the gradient with respect to its input and
the gradient with respect to its filter. With TensorFlow's oneDNN kernels on CPUs without AVX-512, the filter
gradient runs a direct kernel at 100-150 GFLOP/s where the forward pass reaches 150-230 (docs/design.md, "Convolutions
on CPU"), and the best way to compute it depends on the shape. Each computation has equivalent formulations:

  forward          'convolution' (TensorFlow's op) or, for 1x1 filters, 'matmul': [b*h*w, Cin] x [Cin, F] on the
                   (strided) input;
  input gradient   'convolution' or, for 1x1 filters, 'matmul': dY [b*oh*ow, F] x W^T, spread over the pixels
                   the filter read with zeros between them when it is strided (oneDNN's strided 1x1 kernel for
                   this runs at about half the peak on ResNet-50's last projection, C15);
  filter gradient  'convolution', for 1x1 filters 'matmul' (X^T dY) or 'matmul_swapped' ((dY^T X)^T: the same
                   product with the operands' roles swapped, which oneDNN blocks differently: 0.88x and 0.91x
                   'matmul's time for ResNet-50's 256 -> 64 and 256 -> 128 at 32x32, 1.09-1.12x for 64 -> 64 and
                   64 -> 256; docs/benchmarks.md C17), or, for larger filters, 'swapped': the
                   correlation of X with dY computed as a forward convolution whose batch is X's channels, whose
                   input channels are the images and whose filter is dY (dilated by the stride);
  and, for larger filters, 'im2col': the forward pass and the filter gradient as one matrix product with the
                   patches of X ([b*oh*ow, kh*kw*Cin]: one shifted view of the padded map per filter tap, taken
                   as plain slices of a view whose strides are dimensions of their own, side by side; 0.68-0.91x
                   the time of tf.image.extract_patches, the same values, C16), the input gradient (stride 1) as
                   the forward pass of dY, padded, with the filter turned by 180 degrees and its input and output
                   channels swapped; timed only on small maps (MAX_PATCH_VALUES_PER_IMAGE). On small maps of many
                   channels (ResNet-50's last stage) oneDNN's direct kernels run far from the machine's peak and
                   one large matrix product is faster; elsewhere copying the patches costs more than it saves;
  and, for 3x3 filters of stride 1 and SAME padding, 'winograd': Winograd's minimal filtering F(2x2, 3x3) (Lavin
                   and Gray, CVPR 2016), each 2x2 block of outputs from its 4x4 tile of inputs with 16
                   multiplications in place of 36: the tiles and the filter transformed by our kernels
                   (kernels/winograd.cc), then 16 matrix products [tiles, Cin] x [Cin, F] (a batched product), then
                   the outputs transformed back. Its two gradients are the adjoints of those steps (the transforms'
                   adjoints are kernels too): the input gradient dv[k] = dm[k] u[k]^T, the filter gradient
                   du[k] = v[k]^T dm[k]. The forward pass and the filter gradient transform the same x, the two
                   gradients the same dy: TensorFlow's graph optimizer merges those identical ops, so each is done
                   once a step. 2.25x fewer multiply-adds, at the cost of passes over 4x the map; it is a candidate
                   where our kernels build (native.py).

Conv2D times the applicable formulations of each computation once per problem (batch, map size, channels,
filter, strides, padding) on this machine and uses the fastest of each: an autotuner, as cuDNN's is for GPUs.
The result is the same function (to float rounding) with the same variables, so checkpoints load into Keras's
layer and back. Tuning happens on machines without GPU or TPU (cpu_only), for float32 channels-last maps of known
batch size and at least MIN_MULTIPLY_ADDS. tune_network times every problem of a network before training starts,
also for several replicas (they share the per-replica shapes); while a step is traced, a problem not yet timed is
timed only under one replica (replicas traced side by side would time each other), else it keeps TensorFlow's
op. The choices are kept per machine (tuning.py), so a resumed or repeated run does not time again. With
TensorFlow's op determinism on (--deterministic) every computation stays 'convolution', so that runs repeat bit
for bit. Wherever tuning does not apply, the layer is exactly Keras's.
"""

import dataclasses
import threading
from typing import Callable, Dict, Optional, Tuple

import tensorflow as tf
import tf_keras as keras
from tensorflow.python.framework import config as tf_config  # is_op_determinism_enabled: no public API

from imagenet_tpu.cpu import native, tuning
from imagenet_tpu.cpu.batch_norm import cpu_only

PARTS = ('forward', 'input_gradient', 'filter_gradient')
DEFAULT = 'convolution'
# Problems below this many multiply-adds keep TensorFlow's op: what another formulation could save there is less
# than timing it costs (ResNet-50's smallest convolution at 128x128 and batch 32 has 134 million).
MIN_MULTIPLY_ADDS = 50_000_000
# Another formulation replaces 'convolution' only when it took at most this fraction of its time, so that a
# difference within the timing noise does not change the computation from one run to the next.
MARGIN = 0.97
# 'im2col' is a candidate only where its patch matrix holds at most this many values per image (1 MiB of float32:
# ResNet-50's last two stages at 128 px, its last at 224 px; it won only on the last at 128 px, C12, C13, and timing
# it on larger maps costs seconds at every tuning) and in all (128 MiB).
MAX_PATCH_VALUES_PER_IMAGE = 1 << 18
MAX_PATCH_VALUES = 1 << 25
WINOGRAD = 'winograd'


@dataclasses.dataclass(frozen=True)
class Problem:
    """One convolution of float32 NHWC maps with an HWIO filter, shapes known."""
    batch: int
    height: int
    width: int
    in_channels: int
    filters: int
    kernel: Tuple[int, int]
    strides: Tuple[int, int]
    padding: str            # 'SAME' or 'VALID'

    @property
    def input_shape(self):
        return (self.batch, self.height, self.width, self.in_channels)

    @property
    def filter_shape(self):
        return (*self.kernel, self.in_channels, self.filters)

    @property
    def output_size(self) -> Tuple[int, int]:
        if self.padding == 'SAME':
            return tuple(-(-size // stride) for size, stride in zip((self.height, self.width), self.strides))
        return tuple((size - k) // stride + 1
                     for size, k, stride in zip((self.height, self.width), self.kernel, self.strides))

    @property
    def output_shape(self):
        return (self.batch, *self.output_size, self.filters)

    @property
    def multiply_adds(self) -> int:
        rows, columns = self.output_size
        return self.batch * rows * columns * self.filters * self.kernel[0] * self.kernel[1] * self.in_channels

    def paddings(self):
        """[(before, after)] rows and columns, as TensorFlow pads for SAME (nothing for VALID)."""
        if self.padding == 'VALID':
            return [(0, 0), (0, 0)]
        pads = []
        for size, k, stride, out in zip((self.height, self.width), self.kernel, self.strides, self.output_size):
            total = max((out - 1) * stride + k - size, 0)
            pads.append((total // 2, total - total // 2))
        return pads


def candidates(problem: Problem) -> Dict[str, Tuple[str, ...]]:
    """The formulations that apply to each computation of ``problem``; 'convolution' first."""
    if problem.kernel == (1, 1):
        return {'forward': (DEFAULT, 'matmul'), 'input_gradient': (DEFAULT, 'matmul'),
                'filter_gradient': (DEFAULT, 'matmul', 'matmul_swapped')}
    stride_one = problem.strides == (1, 1)
    taps = problem.kernel[0] * problem.kernel[1]
    rows, columns = problem.output_size

    def fits(per_image):
        return per_image <= MAX_PATCH_VALUES_PER_IMAGE and problem.batch * per_image <= MAX_PATCH_VALUES

    patches = fits(rows * columns * taps * problem.in_channels)
    output_patches = fits(problem.height * problem.width * taps * problem.filters)
    im2col = ('im2col',) if patches else ()
    winograd = (WINOGRAD,) if winograd_applies(problem) else ()
    return {'forward': (DEFAULT, *im2col, *winograd),
            'input_gradient': (DEFAULT, *(('im2col',) if stride_one and output_patches else ()), *winograd),
            'filter_gradient': (DEFAULT, 'swapped', *im2col, *winograd)}


@tf.autograph.experimental.do_not_convert     # Python that may build the kernels, also while a step is traced
def winograd_applies(problem: Problem) -> bool:
    """Whether 'winograd' computes ``problem``: a 3x3 filter, stride 1, SAME, where our kernels load (native.py)."""
    return (problem.kernel == (3, 3) and problem.strides == (1, 1) and problem.padding == 'SAME'
            and native.available())


@tf.autograph.experimental.do_not_convert
def _kernels():
    """Our kernels' ops (native.py), loaded by winograd_applies before any formulation runs."""
    return native.library()


def _strided(x, problem: Problem):
    """The input pixels a 1x1 filter reads (it reads from the first one, with SAME or VALID padding)."""
    if problem.strides == (1, 1):
        return x
    return x[:, ::problem.strides[0], ::problem.strides[1], :]


def _patch_rows(x, kernel, strides, padding):
    """The patches a filter of ``kernel`` reads from ``x``, one row of kh*kw*channels values (in the filter's HWI
    order) per output pixel: tf.image.extract_patches's values. Each tap's pixels are a plain slice of the padded
    map viewed as [batch, rows / sh, sh, columns / sw, sw, channels] (a strided slice, or extract_patches, copies
    more slowly); the taps are laid side by side."""
    batch, height, width, channels = x.shape
    (kh, kw), (sh, sw) = kernel, strides
    # The output size and padding of this filter on x (the filter count plays no part in them).
    shape = Problem(batch, height, width, channels, channels, (kh, kw), (sh, sw), padding)
    (out_h, out_w), ((top, _), (left, _)) = shape.output_size, shape.paddings()
    # Padded at the end to whole multiples of the strides that hold every tap's last pixel.
    rows = -(-max((out_h - 1) * sh + kh, height + top) // sh) * sh
    columns = -(-max((out_w - 1) * sw + kw, width + left) // sw) * sw
    x = tf.pad(x, [(0, 0), (top, rows - height - top), (left, columns - width - left), (0, 0)])
    x = tf.reshape(x, [batch, rows // sh, sh, columns // sw, sw, channels])
    taps = [x[:, i // sh:i // sh + out_h, i % sh, j // sw:j // sw + out_w, j % sw, :]
            for i in range(kh) for j in range(kw)]
    return tf.reshape(tf.concat(taps, axis=-1), [-1, kh * kw * channels])


def forward(formulation: str, x, w, problem: Problem):
    if formulation == DEFAULT:
        return tf.nn.conv2d(x, w, strides=problem.strides, padding=problem.padding)
    if formulation == 'im2col':
        rows = _patch_rows(x, problem.kernel, problem.strides, problem.padding)
        return tf.reshape(tf.matmul(rows, tf.reshape(w, [-1, problem.filters])), problem.output_shape)
    if formulation == WINOGRAD:
        kernels = _kernels()
        tiles = tf.matmul(kernels.imagenet_tpu_winograd_input(x), kernels.imagenet_tpu_winograd_filter(w))
        return kernels.imagenet_tpu_winograd_output(tiles, height=problem.height, width=problem.width)
    rows = tf.reshape(_strided(x, problem), [-1, problem.in_channels])
    return tf.reshape(tf.matmul(rows, tf.reshape(w, [problem.in_channels, problem.filters])), problem.output_shape)


def input_gradient(formulation: str, dy, w, problem: Problem):
    if formulation == DEFAULT:
        return tf.raw_ops.Conv2DBackpropInput(input_sizes=problem.input_shape, filter=w, out_backprop=dy,
                                              strides=[1, *problem.strides, 1], padding=problem.padding)
    if formulation == 'im2col':
        # Stride 1: dX[h, w] = sum over i, j of dY[h + pad_h - i, w + pad_w - j] W[i, j]^T, the VALID correlation of
        # dY padded by (k - 1 - before, k - 1 - after) with the filter turned by 180 degrees, its channels swapped.
        padded = tf.pad(dy, [(0, 0), *[(k - 1 - before, k - 1 - after)
                                       for k, (before, after) in zip(problem.kernel, problem.paddings())], (0, 0)])
        turned = tf.transpose(tf.reverse(w, axis=[0, 1]), [0, 1, 3, 2])
        rows = _patch_rows(padded, problem.kernel, (1, 1), 'VALID')
        return tf.reshape(tf.matmul(rows, tf.reshape(turned, [-1, problem.in_channels])), problem.input_shape)
    if formulation == WINOGRAD:
        # The adjoint of the forward pass's transforms and products: dv[k] = dm[k] u[k]^T.
        kernels = _kernels()
        tiles = tf.matmul(kernels.imagenet_tpu_winograd_output_grad(dy), kernels.imagenet_tpu_winograd_filter(w),
                          transpose_b=True)
        return kernels.imagenet_tpu_winograd_input_grad(tiles, height=problem.height, width=problem.width)
    rows = tf.matmul(tf.reshape(dy, [-1, problem.filters]), tf.reshape(w, [problem.in_channels, problem.filters]),
                     transpose_b=True)
    if problem.strides == (1, 1):
        return tf.reshape(rows, problem.input_shape)
    # A strided 1x1 filter read pixel (i * sh, j * sw) for output (i, j) (_strided) and nothing else: its gradient
    # there, zeros between, cut to the input's size.
    (rows_out, columns_out), (sh, sw) = problem.output_size, problem.strides
    spread = tf.pad(tf.reshape(rows, [problem.batch, rows_out, 1, columns_out, 1, problem.in_channels]),
                    [(0, 0), (0, 0), (0, sh - 1), (0, 0), (0, sw - 1), (0, 0)])
    spread = tf.reshape(spread, [problem.batch, rows_out * sh, columns_out * sw, problem.in_channels])
    if (rows_out * sh, columns_out * sw) != (problem.height, problem.width):
        spread = spread[:, :problem.height, :problem.width]
    return spread


def filter_gradient(formulation: str, x, dy, problem: Problem):
    if formulation == DEFAULT:
        return tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=problem.filter_shape, out_backprop=dy,
                                               strides=[1, *problem.strides, 1], padding=problem.padding)
    if formulation in ('matmul', 'matmul_swapped'):
        rows = tf.reshape(_strided(x, problem), [-1, problem.in_channels])
        gradients = tf.reshape(dy, [-1, problem.filters])
        product = (tf.matmul(rows, gradients, transpose_a=True) if formulation == 'matmul'
                   else tf.transpose(tf.matmul(gradients, rows, transpose_a=True)))
        return tf.reshape(product, problem.filter_shape)
    if formulation == 'im2col':
        rows = _patch_rows(x, problem.kernel, problem.strides, problem.padding)
        return tf.reshape(tf.matmul(rows, tf.reshape(dy, [-1, problem.filters]), transpose_a=True),
                          problem.filter_shape)
    if formulation == WINOGRAD:
        # du[k] = v[k]^T dm[k], then the adjoint of the filter's transform. v and dm are the same ops (same inputs)
        # as the forward pass's and the input gradient's, which TensorFlow's graph optimizer computes once.
        kernels = _kernels()
        return kernels.imagenet_tpu_winograd_filter_grad(tf.matmul(
            kernels.imagenet_tpu_winograd_input(x), kernels.imagenet_tpu_winograd_output_grad(dy), transpose_a=True))
    # dW[i, j, c, f] = sum over n, p, q of X_padded[n, p * sh + i, q * sw + j, c] dY[n, p, q, f]: a VALID
    # convolution of X_padded as [c, H, W, n] with dY as the filter [p, q, n, f], dilated by the strides.
    padded = tf.pad(x, [(0, 0), *problem.paddings(), (0, 0)])
    correlation = tf.nn.conv2d(tf.transpose(padded, [3, 1, 2, 0]), tf.transpose(dy, [1, 2, 0, 3]), strides=1,
                               padding='VALID', dilations=problem.strides)
    return tf.transpose(correlation[:, :problem.kernel[0], :problem.kernel[1], :], [1, 2, 0, 3])


def convolve(x, w, problem: Problem, choice: Dict[str, str]):
    """The convolution of ``problem`` with each computation done as ``choice`` says."""

    @tf.custom_gradient
    def convolution(x, w):
        def gradient(dy):
            return (input_gradient(choice['input_gradient'], dy, w, problem),
                    filter_gradient(choice['filter_gradient'], x, dy, problem))
        return forward(choice['forward'], x, w, problem), gradient

    return convolution(x, w)


@tf.autograph.experimental.do_not_convert     # Python that times, also when called while a step is traced
def measure(problem: Problem, repeats: int = 3) -> Dict[str, Dict[str, float]]:
    """Seconds of each applicable formulation of each computation of ``problem`` on random maps, each as a
    tf.function, as it runs inside a step (run eagerly, a formulation of several ops paid each op's dispatch:
    'im2col''s input gradient of ResNet-50's 4x4x512 3x3 convolution took 9.51 ms eagerly and 7.70 ms as a
    function, docs/benchmarks.md C19): shortest of ``repeats`` after a warm-up, a computation's formulations taking
    turns (tuning.shortest_in_turns)."""
    x = tf.random.normal(problem.input_shape)
    w = tf.random.normal(problem.filter_shape)
    dy = tf.random.normal(problem.output_shape)
    computations = {'forward': (forward, x, w), 'input_gradient': (input_gradient, dy, w),
                    'filter_gradient': (filter_gradient, x, dy)}

    def run(part, name):
        function, first, second = computations[part]
        # A concrete function, traced here: calls to it are not counted as retracing of one Python function.
        compiled = tf.function(lambda a, b: function(name, a, b, problem)).get_concrete_function(first, second)
        return lambda: compiled(first, second).numpy()

    return {part: tuning.shortest_in_turns({name: run(part, name) for name in names}, repeats)
            for part, names in candidates(problem).items()}


def fastest(seconds: Dict[str, Dict[str, float]]) -> Dict[str, str]:
    """For each computation, the formulation of least time, if it took at most MARGIN of 'convolution's time;
    'convolution' otherwise."""
    choice = {}
    for part, times in seconds.items():
        best = min(times, key=times.get)
        choice[part] = best if times[best] <= MARGIN * times[DEFAULT] else DEFAULT
    return choice


_choices: Dict[Problem, Dict[str, str]] = {}
_lock = threading.Lock()


def cache_key(problem: Problem) -> str:
    """``problem`` as the tuning cache names it."""
    return ','.join(str(value) for value in (*problem.input_shape, problem.filters, *problem.kernel,
                                              *problem.strides, problem.padding))


def _cached(problem: Problem) -> Optional[Dict[str, str]]:
    """The cache's choice for ``problem`` if it is a valid one (every computation, each an applicable name)."""
    choice = tuning.CACHE.get('convolution', cache_key(problem))
    options = candidates(problem)
    if isinstance(choice, dict) and set(choice) == set(PARTS) and all(choice[part] in options[part] for part in PARTS):
        return choice
    return None


def choose(problem: Problem, measure_fn: Optional[Callable] = None, may_measure: bool = True) -> Dict[str, str]:
    """The tuned choice for ``problem``: this process's, else the machine's cache's, else (``may_measure``)
    measured and remembered in both; else TensorFlow's op for every computation."""
    with _lock:
        if problem not in _choices:
            choice = _cached(problem)
            if choice is None:
                if not may_measure:
                    return {part: DEFAULT for part in PARTS}
                with tf.init_scope():          # eagerly, also while a tf.function is being traced
                    choice = fastest((measure_fn or measure)(problem))
                tuning.CACHE.put('convolution', cache_key(problem), choice)
            _choices[problem] = choice
        return _choices[problem]


def tuning_applies() -> bool:
    """Whether convolutions traced now may use tuned formulations: op determinism is off."""
    return not tf_config.is_op_determinism_enabled()


def may_measure_now() -> bool:
    """Whether a problem may be timed while a step is traced: one replica in this process (replicas traced side by
    side would time each other)."""
    return tf.distribute.get_strategy().num_replicas_in_sync == 1


@keras.utils.register_keras_serializable('imagenet_tpu')
class Conv2D(keras.layers.Conv2D):
    """keras.layers.Conv2D whose forward pass and gradients use the tuned formulations (module docstring) on a
    machine without GPU or TPU (``cpu_tuning=None`` decides so when the layer is built); anything tuning does not
    apply to is Keras's code."""

    def __init__(self, *args, cpu_tuning: Optional[bool] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.cpu_tuning = cpu_tuning
        self._tune = cpu_tuning

    def build(self, input_shape):
        super().build(input_shape)
        if self._tune is None:
            self._tune = cpu_only()

    def problem(self, inputs) -> Optional[Problem]:
        """The Problem of this layer on ``inputs``, or None where tuning does not apply."""
        return self.problem_for(inputs.shape, inputs.dtype)

    def problem_for(self, shape, dtype=tf.float32) -> Optional[Problem]:
        """The Problem of this layer on maps of ``shape`` and ``dtype``, or None where tuning does not apply."""
        shape = tf.TensorShape(shape)
        if not (self._tune and self.rank == 2 and self.data_format == 'channels_last' and self.groups == 1
                and self.dilation_rate == (1, 1) and self.padding in ('same', 'valid')
                and tf.as_dtype(dtype) == tf.float32 and self.compute_dtype == 'float32'
                and shape.rank == 4 and shape.is_fully_defined()):
            return None
        problem = Problem(batch=shape[0], height=shape[1], width=shape[2], in_channels=shape[3],
                          filters=self.filters, kernel=tuple(self.kernel_size), strides=tuple(self.strides),
                          padding=self.padding.upper())
        return problem if problem.multiply_adds >= MIN_MULTIPLY_ADDS else None

    def convolution_op(self, inputs, kernel):
        problem = self.problem(inputs)
        if problem is None or not tuning_applies():
            return super().convolution_op(inputs, kernel)
        choice = choose(problem, may_measure=may_measure_now())
        if all(name == DEFAULT for name in choice.values()):
            return super().convolution_op(inputs, kernel)
        return convolve(inputs, kernel, problem, choice)

    def get_config(self):
        config = super().get_config()
        config.update(cpu_tuning=self.cpu_tuning)
        return config


def tune_network(network: keras.Model, batch_size: int, num_replicas: int = 1) -> Dict[Problem, Dict[str, str]]:
    """Tunes every Conv2D of ``network`` for batches of ``batch_size`` per replica now, before training starts
    (rather than while its step is traced, beside the input pipeline's threads), for one replica or several (they
    share the shapes); returns the choices. Nothing is tuned with op determinism on, or where the layers' own
    rules say no."""
    del num_replicas     # every replica has the same problems; they are timed here, before any replica runs
    if tf_config.is_op_determinism_enabled():
        return {}
    choices = {}
    for layer in network.submodules:     # nested models too
        if isinstance(layer, Conv2D) and layer.built:
            try:
                shape = layer.input_shape        # one input shape: a layer called once
            except (AttributeError, RuntimeError):
                continue
            problem = layer.problem_for([batch_size, *shape[1:]])
            if problem is not None:
                choices[problem] = choose(problem)
    return choices
