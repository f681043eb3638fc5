"""Keras ResNet v1.5 (He et al. 2016, with the stride on the 3x3 convolution), depths 10 to 200.

The normalization layer is passed in as a factory, so the same network runs with Keras batch norm, replica-group
batch norm or none at all. The last normalization of every residual branch starts with gamma = 0, so each block
starts as the identity (Goyal et al. 2017), as in the large-batch recipes.

ResNet-50 at 1000 classes has 25,557,032 parameters (torchvision's count for the same network).
"""

import functools
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.data import preprocessing

# depth -> (block kind, blocks per stage)
DEPTHS = {
    10: ('basic', (1, 1, 1, 1)),    # the smallest of the family: quick tests and demos
    18: ('basic', (2, 2, 2, 2)),
    34: ('basic', (3, 4, 6, 3)),
    50: ('bottleneck', (3, 4, 6, 3)),
    101: ('bottleneck', (3, 4, 23, 3)),
    152: ('bottleneck', (3, 8, 36, 3)),
    200: ('bottleneck', (3, 24, 36, 3)),
}
STAGE_WIDTHS = (64, 128, 256, 512)
BOTTLENECK_EXPANSION = 4

# NormFactory(name, zero_gamma) -> a Keras layer applied to channels-last feature maps.
NormFactory = Callable[[str, bool], keras.layers.Layer]


def batch_norm_factory(momentum: float = 0.9, epsilon: float = 1e-5) -> NormFactory:
    """Keras's BatchNormalization with the recipes' momentum and epsilon (per replica under a strategy)."""
    def make(name: str, zero_gamma: bool) -> keras.layers.Layer:
        return keras.layers.BatchNormalization(
            momentum=momentum, epsilon=epsilon, name=name,
            gamma_initializer='zeros' if zero_gamma else 'ones')
    return make


def no_norm_factory(name: str, zero_gamma: bool) -> keras.layers.Layer:
    """No normalization: an identity layer (for tests that need replica-independent forward passes)."""
    del zero_gamma
    return keras.layers.Identity(name=name)


_CONV_INITIALIZER = {'class_name': 'VarianceScaling',
                     'config': {'scale': 2.0, 'mode': 'fan_out', 'distribution': 'truncated_normal'}}


def _conv(filters: int, kernel_size: int, strides: int, name: str) -> keras.layers.Layer:
    return keras.layers.Conv2D(filters, kernel_size, strides=strides, padding='same', use_bias=False, name=name,
                               kernel_initializer=keras.initializers.get(_CONV_INITIALIZER))


def _basic_block(x, filters: int, strides: int, norm: NormFactory, name: str):
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = _conv(filters, 1, strides, f'{name}_proj')(x)
        shortcut = norm(f'{name}_proj_bn', False)(shortcut)
    x = _conv(filters, 3, strides, f'{name}_conv1')(x)
    x = keras.layers.ReLU(name=f'{name}_relu1')(norm(f'{name}_bn1', False)(x))
    x = _conv(filters, 3, 1, f'{name}_conv2')(x)
    x = norm(f'{name}_bn2', True)(x)
    return keras.layers.ReLU(name=f'{name}_out')(keras.layers.Add(name=f'{name}_add')([x, shortcut]))


def _bottleneck_block(x, filters: int, strides: int, norm: NormFactory, name: str):
    out_filters = filters * BOTTLENECK_EXPANSION
    shortcut = x
    if strides != 1 or x.shape[-1] != out_filters:
        shortcut = _conv(out_filters, 1, strides, f'{name}_proj')(x)
        shortcut = norm(f'{name}_proj_bn', False)(shortcut)
    x = _conv(filters, 1, 1, f'{name}_conv1')(x)
    x = keras.layers.ReLU(name=f'{name}_relu1')(norm(f'{name}_bn1', False)(x))
    x = _conv(filters, 3, strides, f'{name}_conv2')(x)  # v1.5: the stride sits on the 3x3 convolution
    x = keras.layers.ReLU(name=f'{name}_relu2')(norm(f'{name}_bn2', False)(x))
    x = _conv(out_filters, 1, 1, f'{name}_conv3')(x)
    x = norm(f'{name}_bn3', True)(x)
    return keras.layers.ReLU(name=f'{name}_out')(keras.layers.Add(name=f'{name}_add')([x, shortcut]))


def space_to_depth_kernel(kernel: np.ndarray) -> np.ndarray:
    """The 7x7 stride-2 stem kernel [7, 7, C, F] as the equivalent 4x4 stride-1 kernel [4, 4, 4C, F] that acts
    on 2x2 space-to-depth input (tf.nn.space_to_depth(images, 2), channels ordered (row, column, channel)).

    With SAME padding the 7x7 stride-2 convolution reads input rows 2i - 2 ... 2i + 4. Padding the kernel with a
    zero 8th row and column makes that 2i - 2 ... 2i + 5: four 2x2 blocks, i - 1 ... i + 2, which is what a
    4x4 stride-1 SAME convolution over the blocks reads (1 before, 2 after). Exact, so checkpoints convert.
    """
    size, _, channels, filters = kernel.shape
    if size != 7:
        raise ValueError(f'expected a 7x7 kernel, got {size}x{size}')
    padded = np.zeros((8, 8, channels, filters), kernel.dtype)
    padded[:7, :7] = kernel
    # [8, 8] -> [4 (block row), 2 (row in block), 4 (block column), 2 (column in block)]
    blocks = padded.reshape(4, 2, 4, 2, channels, filters).transpose(0, 2, 1, 3, 4, 5)
    return blocks.reshape(4, 4, 4 * channels, filters)


class SpaceToDepthStem(keras.layers.Layer):
    """MLPerf v0.7's space-to-depth stem: a 7x7 stride-2 convolution computed as a 4x4 stride-1 one on 2x2
    space-to-depth images, and exactly that, also after training.

    The variable is the kernel padded to 8x8 [8, 8, C, F]; every call masks its 8th row and column and folds it
    to [4, 4, 4C, F] (space_to_depth_kernel), as the v0.7 submission's resnet_model.py does (lines 58-85 of
    Google/benchmarks/resnet/implementations/resnet-research-TF-tpu-v3-8192/, mlcommons/training_results_v0.7).
    The masked entries get no gradient; ours also start at 0 (the submission initializes all 64 positions), so
    the stem's norm, and its LARS trust ratio, are those of the 7x7 kernel, whose initializer it uses too.
    """

    def __init__(self, filters: int, kernel_initializer, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        channels = int(input_shape[-1]) // 4

        def initializer(shape, dtype=None):
            kernel = self.kernel_initializer((7, 7, channels, self.filters), dtype=dtype)
            return tf.pad(kernel, [[0, 1], [0, 1], [0, 0], [0, 0]])

        self.kernel = self.add_weight('kernel', shape=(8, 8, channels, self.filters), initializer=initializer)
        self.built = True

    def folded_kernel(self) -> tf.Tensor:
        """The masked kernel as [4, 4, 4C, F]: blocks (row, column) of 2x2 pixels, channels (row, column, C)."""
        kernel = tf.convert_to_tensor(self.kernel)
        mask = tf.constant([1.0] * 7 + [0.0], kernel.dtype)
        kernel = kernel * mask[:, None, None, None] * mask[None, :, None, None]
        channels = kernel.shape[2]
        blocks = tf.transpose(tf.reshape(kernel, [4, 2, 4, 2, channels, self.filters]), [0, 2, 1, 3, 4, 5])
        return tf.reshape(blocks, [4, 4, 4 * channels, self.filters])

    def call(self, images):
        return tf.nn.conv2d(images, self.folded_kernel(), strides=1, padding='SAME')

    def get_config(self):
        return {**super().get_config(), 'filters': self.filters,
                'kernel_initializer': keras.initializers.serialize(self.kernel_initializer)}


class Standardize(keras.layers.Layer):
    """(pixels - mean) / stddev per channel, the network's first layer: images enter as pixels in 0..255.

    Standardizing on the accelerator rather than in the input pipeline (as Google's TPU ResNet does) takes a
    third of the pipeline's work per image off the host's CPU cores (docs/benchmarks.md), and a SavedModel then
    takes plain pixels. With space-to-depth images the statistics repeat for each of the 4
    pixels folded into the channels.
    """

    def __init__(self, mean, stddev, **kwargs):
        super().__init__(**kwargs)
        self.mean, self.stddev = [float(m) for m in mean], [float(s) for s in stddev]

    def call(self, images):
        channels = images.shape[-1]
        repeat = channels // len(self.mean)
        mean = tf.constant(self.mean * repeat, self.compute_dtype)
        scale = tf.constant([1.0 / s for s in self.stddev] * repeat, self.compute_dtype)
        return (tf.cast(images, self.compute_dtype) - mean) * scale

    def get_config(self):
        return {**super().get_config(), 'mean': self.mean, 'stddev': self.stddev}


def resnet(depth: int = 50, num_classes: int = 1000, *, image_size: int = 224,
           norm: Optional[NormFactory] = None, space_to_depth: bool = False,
           input_dtype: Optional[str] = None,
           name: Optional[str] = None) -> keras.Model:
    """A ResNet v1.5 classifier: images -> logits [batch, num_classes] (float32).

    Images are pixels in 0..255 (the first layer standardizes them with ImageNet's channel statistics),
    [batch, image_size, image_size, 3], or with ``space_to_depth`` (Google's MLPerf v0.7 TPU stem)
    [batch, image_size / 2, image_size / 2, 12] = tf.nn.space_to_depth(images, 2), met by a 4x4 stride-1
    convolution that stays exactly the 7x7 stride-2 one (SpaceToDepthStem). ``norm`` makes each normalization
    layer (default: batch_norm_factory()). ``input_dtype``: the images' dtype (default: the policy's compute
    dtype, so bfloat16 images from the input pipeline are not cast twice).
    """
    if depth not in DEPTHS:
        raise ValueError(f'unsupported ResNet depth {depth}; choose one of {sorted(DEPTHS)}')
    kind, stage_blocks = DEPTHS[depth]
    block = _basic_block if kind == 'basic' else _bottleneck_block
    norm = norm or batch_norm_factory()
    input_dtype = input_dtype or keras.mixed_precision.global_policy().compute_dtype

    if space_to_depth:
        if image_size % 2:
            raise ValueError(f'space-to-depth needs an even image size, got {image_size}')
        images = keras.Input((image_size // 2, image_size // 2, 12), name='images', dtype=input_dtype)
        x = SpaceToDepthStem(64, _CONV_INITIALIZER, name='stem_conv')(_standardize(images))
    else:
        images = keras.Input((image_size, image_size, 3), name='images', dtype=input_dtype)
        x = _conv(64, 7, 2, 'stem_conv')(_standardize(images))
    x = keras.layers.ReLU(name='stem_relu')(norm('stem_bn', False)(x))
    x = keras.layers.MaxPool2D(3, strides=2, padding='same', name='stem_pool')(x)
    for stage, (blocks, filters) in enumerate(zip(stage_blocks, STAGE_WIDTHS)):
        for index in range(blocks):
            strides = 2 if index == 0 and stage > 0 else 1
            x = block(x, filters, strides, norm, f'stage{stage + 1}_block{index + 1}')
    x = keras.layers.GlobalAveragePooling2D(name='pool')(x)
    logits = keras.layers.Dense(
        num_classes, name='logits', kernel_initializer=keras.initializers.RandomNormal(stddev=0.01))(x)
    # Logits in float32 also under a mixed-precision policy, so the loss and softmax are computed in float32.
    logits = keras.layers.Activation('linear', dtype='float32', name='logits_float32')(logits)
    return keras.Model(images, logits, name=name or f'resnet{depth}')


def _standardize(images):
    return Standardize(preprocessing.MEAN_RGB, preprocessing.STDDEV_RGB, name='standardize')(images)


ResNet18 = functools.partial(resnet, 18)
ResNet50 = functools.partial(resnet, 50)
