"""Per-example image operations: decode fused with the crop, flip, resize, normalize.

Every function takes one encoded JPEG (string scalar) and returns an image [size, size, 3] of pixels in 0..255
(float32, or bfloat16 for a bfloat16 model): the network's first layer (resnet.Standardize) subtracts ImageNet's
per-channel mean and divides by its standard deviation, on the accelerator. Decoding only the crop window
(tf.image.decode_and_crop_jpeg) skips the IDCT of the discarded pixels, the fused decode-and-crop of Ying et al.
Nothing is decoded whose header claims more than MAX_IMAGE_PIXELS: such an image is an InvalidArgumentError
('image too large: ...') before any pixel is allocated, a bad record to the input pipeline (record_io.py).
"""

import tensorflow as tf

from imagenet_tpu.config import RESIZE_METHODS

# ImageNet RGB statistics on the 0..255 scale.
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)

# libjpeg's accurate integer IDCT: the pixels PIL and other reference decoders produce (TensorFlow's default,
# the fast IDCT, differs by 1.3 grey levels on average and up to 18 on scikit-learn's china.jpg) at the same
# speed (docs/benchmarks.md).
DCT_METHOD = 'INTEGER_ACCURATE'

# The most pixels an image may have to be decoded, Pillow's limit against decompression bombs (Pillow,
# PIL/Image.py, MAX_IMAGE_PIXELS = 1024 * 1024 * 1024 // 4 // 3: Pillow warns above it, refuses twice as many):
# 268 MB of RGB pixels. A JPEG of about a kilobyte can claim 13,000 x 13,000 pixels, 507 MB decoded.
MAX_IMAGE_PIXELS = 89_478_485

# Evaluation keeps the central 87.5% of the shorter side (224 of 256, the usual ImageNet protocol).
EVAL_CROP_FRACTION = 0.875


def check_pixels(shape: tf.Tensor) -> tf.Tensor:
    """``shape`` ([height, width, ...], integers), after an assertion that it has at most MAX_IMAGE_PIXELS
    pixels: else InvalidArgumentError 'image too large: W x H pixels (at most ... are decoded)'."""
    height, width = tf.cast(shape[0], tf.int64), tf.cast(shape[1], tf.int64)
    check = tf.debugging.Assert(height * width <= MAX_IMAGE_PIXELS, [tf.strings.format(
        'image too large: {} x {} pixels (at most ' + f'{MAX_IMAGE_PIXELS:,} are decoded)', (width, height))])
    with tf.control_dependencies([check]):
        return tf.identity(shape)


def jpeg_shape(encoded: tf.Tensor) -> tf.Tensor:
    """[height, width, channels] (int32) of a JPEG from its header alone (tf.image.extract_jpeg_shape), checked
    against MAX_IMAGE_PIXELS (check_pixels): every JPEG decode here takes its size, or its window, from this.

    Bytes that do not start with a JPEG marker fail first, with 'not a JPEG': libjpeg would print "Not a JPEG
    file" to stderr for each, thousands of lines over a run of bad records that are skipped and counted anyway."""
    check = tf.debugging.Assert(tf.io.is_jpeg(encoded), ['not a JPEG: the record\'s image does not start with '
                                                          'a JPEG marker'])
    with tf.control_dependencies([check]):
        return check_pixels(tf.image.extract_jpeg_shape(encoded))


def decode_jpeg(encoded: tf.Tensor) -> tf.Tensor:
    """The whole JPEG as uint8 [height, width, 3] (the decoded-image cache), if its header passes jpeg_shape."""
    with tf.control_dependencies([jpeg_shape(encoded)]):
        return tf.io.decode_jpeg(encoded, channels=3, dct_method=DCT_METHOD)


def normalize(image: tf.Tensor, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """uint8 or float [H, W, 3] in 0..255 -> (image - mean) / stddev in ``dtype`` (what resnet.Standardize
    computes; for references and for models without that layer)."""
    image = (tf.cast(image, tf.float32) - MEAN_RGB) / STDDEV_RGB
    return tf.cast(image, dtype)


# Resize filters: TensorFlow's (half-pixel centres, no antialiasing). Bicubic is Keys' cubic convolution with
# a = -0.5; its pixels may overshoot 0..255 slightly at edges, and are kept so, as the MLPerf preprocessing does.


def _resize(image: tf.Tensor, image_size: int, dtype: tf.DType = tf.float32, method: str = 'bilinear') -> tf.Tensor:
    """Resize to [image_size, image_size] with ``method`` (float pixels on the 0..255 scale), cast to ``dtype``."""
    if method not in RESIZE_METHODS:
        raise ValueError(f'resize method must be one of {RESIZE_METHODS}, got {method!r}')
    image = tf.image.resize(image, [image_size, image_size], method=method)
    return tf.cast(image, dtype)


def random_seed() -> tf.Tensor:
    """A fresh seed for the stateless random ops below (when the caller does not need reproducibility)."""
    return tf.random.uniform([2], maxval=2**31 - 1, dtype=tf.int32)


def random_crop_window(encoded: tf.Tensor, boxes: tf.Tensor, min_area: float = 0.08,
                       aspect_ratio_range=(3 / 4, 4 / 3), max_attempts: int = 10,
                       seed: tf.Tensor = None) -> tf.Tensor:
    """Inception-style random crop window [y, x, height, width] (int32) sampled around ``boxes``.

    ``boxes``: float32 [num_boxes, 4] as (ymin, xmin, ymax, xmax) in [0, 1]; empty means the whole image.
    The window covers ``min_area``..1 of the image and at least 10% of some box; after ``max_attempts``
    failures it is the whole image. ``seed`` ([2] integers) makes the window a function of the seed.
    """
    return sample_crop_window(jpeg_shape(encoded), boxes, min_area, aspect_ratio_range,
                              max_attempts, seed)


def sample_crop_window(shape: tf.Tensor, boxes: tf.Tensor, min_area: float = 0.08,
                       aspect_ratio_range=(3 / 4, 4 / 3), max_attempts: int = 10,
                       seed: tf.Tensor = None) -> tf.Tensor:
    """random_crop_window for an image of ``shape`` [height, width, channels]."""
    boxes = tf.cond(tf.shape(boxes)[0] > 0, lambda: boxes, lambda: tf.constant([[0.0, 0.0, 1.0, 1.0]]))
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=boxes[tf.newaxis], seed=random_seed() if seed is None else seed,
        min_object_covered=0.1, aspect_ratio_range=aspect_ratio_range, area_range=(min_area, 1.0),
        max_attempts=max_attempts, use_image_if_no_bounding_boxes=True)
    return tf.stack([begin[0], begin[1], size[0], size[1]])


def preprocess_for_train(encoded: tf.Tensor, boxes: tf.Tensor, image_size: int, *, min_area: float = 0.08,
                         flip: bool = True, dtype: tf.DType = tf.float32, seed: tf.Tensor = None,
                         resize_method: str = 'bilinear') -> tf.Tensor:
    """Random-resized crop (decoded fused with the crop), random left-right flip, resize.

    ``seed`` ([2] integers; default: fresh): the same seed gives the same crop and flip, which is what makes a
    resumed run see exactly the images an uninterrupted one would.
    """
    crop_seed, flip_seed = _crop_and_flip_seeds(seed)
    window = random_crop_window(encoded, boxes, min_area=min_area, seed=crop_seed)
    image = tf.image.decode_and_crop_jpeg(encoded, window, channels=3, dct_method=DCT_METHOD)
    return _flip_and_resize(image, flip, flip_seed, image_size, dtype, resize_method)


def preprocess_decoded_for_train(image: tf.Tensor, image_size: int, *, min_area: float = 0.08,
                                 flip: bool = True, dtype: tf.DType = tf.float32, seed: tf.Tensor = None,
                                 resize_method: str = 'bilinear') -> tf.Tensor:
    """preprocess_for_train for an already decoded uint8 image (the decoded-image cache), whole image as box."""
    crop_seed, flip_seed = _crop_and_flip_seeds(seed)
    window = sample_crop_window(tf.shape(image), tf.zeros([0, 4]), min_area=min_area, seed=crop_seed)
    image = image[window[0]:window[0] + window[2], window[1]:window[1] + window[3]]
    return _flip_and_resize(image, flip, flip_seed, image_size, dtype, resize_method)


def decode_any(encoded: tf.Tensor) -> tf.Tensor:
    """A JPEG, PNG, GIF (first frame) or BMP as uint8 [height, width, 3], if its header passes check_pixels (JPEG,
    PNG, WebP headers; header_shape)."""
    def other_format():
        with tf.control_dependencies([check_pixels(header_shape(encoded))]):
            return tf.io.decode_image(encoded, channels=3, expand_animations=False)

    return tf.cond(tf.io.is_jpeg(encoded), lambda: decode_jpeg(encoded), other_format)


def preprocess_any_for_train(encoded: tf.Tensor, boxes: tf.Tensor, image_size: int, *, min_area: float = 0.08,
                             flip: bool = True, dtype: tf.DType = tf.float32, seed: tf.Tensor = None,
                             resize_method: str = 'bilinear') -> tf.Tensor:
    """preprocess_for_train for an encoded JPEG, PNG, GIF or BMP (tensorflow_datasets stores images given as
    arrays as PNG): JPEGs take exactly its path, other formats are decoded whole and cropped with the same
    seeds (without boxes)."""
    return tf.cond(tf.io.is_jpeg(encoded),
                   lambda: preprocess_for_train(encoded, boxes, image_size, min_area=min_area, flip=flip, dtype=dtype,
                                                seed=seed, resize_method=resize_method),
                   lambda: preprocess_decoded_for_train(decode_any(encoded), image_size, min_area=min_area,
                                                        flip=flip, dtype=dtype, seed=seed,
                                                        resize_method=resize_method))


def _crop_and_flip_seeds(seed):
    """Two independent seeds from ``seed`` (a fresh one when None): one for the crop, one for the flip."""
    seed = random_seed() if seed is None else seed
    return tf.unstack(tf.random.experimental.stateless_split(seed, 2))


def _flip_and_resize(image, flip: bool, flip_seed, image_size: int, dtype: tf.DType,
                     resize_method: str) -> tf.Tensor:
    if flip:
        image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    return _resize(image, image_size, dtype, resize_method)


def center_crop_window(encoded: tf.Tensor, fraction: float = EVAL_CROP_FRACTION) -> tf.Tensor:
    """Square window [y, x, side, side] (int32) of ``fraction`` of the shorter side, centred, of a JPEG."""
    return center_crop_window_of_shape(jpeg_shape(encoded), fraction)


def center_crop_window_of_shape(shape: tf.Tensor, fraction: float = EVAL_CROP_FRACTION) -> tf.Tensor:
    """center_crop_window for an image of ``shape`` [height, width, ...]."""
    height, width = shape[0], shape[1]
    side = tf.cast(fraction * tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
    side = tf.maximum(side, 1)
    return tf.stack([(height - side + 1) // 2, (width - side + 1) // 2, side, side])


def preprocess_for_eval(encoded: tf.Tensor, image_size: int, *, crop_fraction: float = EVAL_CROP_FRACTION,
                        dtype: tf.DType = tf.float32, resize_method: str = 'bilinear') -> tf.Tensor:
    """Central crop of ``crop_fraction`` of the shorter side (decoded fused with the crop), resize."""
    image = tf.image.decode_and_crop_jpeg(encoded, center_crop_window(encoded, crop_fraction), channels=3,
                                         dct_method=DCT_METHOD)
    return _resize(image, image_size, dtype, resize_method)


def header_shape(encoded: tf.Tensor) -> tf.Tensor:
    """[height, width] (int64) the header of a PNG (IHDR, the first chunk) or a WebP (its VP8, VP8L or VP8X
    chunk) claims, read from its first 30 bytes; [0, 0] for other formats. GIF is not read: TensorFlow's canvas is
    its largest frame, found only by walking every block (serving/classify.py does, in Python); a BMP, not
    compressed, fails to decode unless the file holds every pixel."""
    head = tf.strings.substr(tf.strings.join([tf.strings.substr(encoded, 0, 30), b'\0' * 30]), 0, 30)
    octets = tf.cast(tf.io.decode_raw(head, tf.uint8), tf.int64)

    def number(start: int, count: int, big_endian: bool = False) -> tf.Tensor:
        value = tf.constant(0, tf.int64)
        for index in (range(start, start + count) if big_endian else reversed(range(start, start + count))):
            value = value * 256 + octets[index]
        return value

    def starts(start: int, magic: bytes) -> tf.Tensor:
        return tf.equal(tf.strings.substr(head, start, len(magic)), magic)

    lossless = number(21, 4)      # VP8L: 14 bits width - 1, 14 bits height - 1, from the lowest bit
    webp = tf.logical_and(starts(0, b'RIFF'), starts(8, b'WEBP'))
    shape = tf.zeros([2], tf.int64)
    for kind, claimed in ((starts(0, b'\x89PNG\r\n\x1a\n'), [number(20, 4, True), number(16, 4, True)]),
                          (tf.logical_and(webp, starts(12, b'VP8 ')), [number(28, 2) % 16384, number(26, 2) % 16384]),
                          (tf.logical_and(webp, starts(12, b'VP8L')), [lossless // 16384 % 16384 + 1,
                                                                       lossless % 16384 + 1]),
                          (tf.logical_and(webp, starts(12, b'VP8X')), [number(27, 3) + 1, number(24, 3) + 1])):
        shape = tf.where(kind, tf.stack(claimed), shape)
    return shape


def preprocess_any_for_eval(encoded: tf.Tensor, image_size: int, *, crop_fraction: float = EVAL_CROP_FRACTION,
                            dtype: tf.DType = tf.float32, resize_method: str = 'bilinear') -> tf.Tensor:
    """preprocess_for_eval for an encoded JPEG, PNG, GIF or BMP: JPEGs take exactly the evaluation path (decode
    fused with the crop), other formats are decoded whole, then cropped and resized the same way. A JPEG, PNG or
    WebP whose header claims more than MAX_IMAGE_PIXELS is an InvalidArgumentError before it is decoded."""
    def other_format():
        image = decode_any(encoded)
        window = center_crop_window_of_shape(tf.shape(image), crop_fraction)
        image = image[window[0]:window[0] + window[2], window[1]:window[1] + window[3]]
        return _resize(image, image_size, dtype, resize_method)

    return tf.cond(tf.io.is_jpeg(encoded),
                   lambda: preprocess_for_eval(encoded, image_size, crop_fraction=crop_fraction, dtype=dtype,
                                               resize_method=resize_method),
                   other_format)
