"""Export of a trained network as a SavedModel that loads and runs with plain TensorFlow, without this package.

Signatures (each returns probabilities [N, classes], the top-5 classes [N, 5] (int32), their scores and names,
and the logits):
- ``serving_default``: ``images``, a batch of encoded JPEG, PNG, GIF or BMP files (tf.string [N]); inside the
  graph each is decoded and given exactly the evaluation preprocessing of training (centre crop, resize).
- ``serving_pixels``: ``pixels``, uint8 [N, image_size, image_size, 3], already cropped and resized.
- ``serving_preprocessed``: ``images``, float32 pixels on the 0..255 scale [N, image_size, image_size, 3], as the
  evaluation pipeline hands them to the network.
"""

import os
from typing import Sequence

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu import files
from imagenet_tpu.data import preprocessing
from imagenet_tpu.errors import OutputError

TOP_K = 5


def export_saved_model(network: keras.Model, path: str, class_names: Sequence[str], *, image_size: int,
                       crop_fraction: float, resize_method: str, space_to_depth: bool = False) -> None:
    """Writes ``network`` (inference mode, with the batch-norm statistics it holds) and its class names as a
    SavedModel at ``path``. Encoded images get the evaluation preprocessing of training: the central
    ``crop_fraction`` of the shorter side resized to ``image_size`` with ``resize_method``; ``space_to_depth``:
    the network takes 2x2 space-to-depth images (its stem; see model/resnet.py)."""
    size, top_k = image_size, min(TOP_K, len(class_names))
    names = tf.constant(list(class_names), tf.string)

    def outputs(pixels):
        images = tf.nn.space_to_depth(pixels, 2) if space_to_depth else pixels
        logits = tf.cast(network(tf.cast(images, network.input.dtype), training=False), tf.float32)
        probabilities = tf.nn.softmax(logits)
        top = tf.math.top_k(probabilities, k=top_k)
        return {'probabilities': probabilities, 'classes': top.indices, 'scores': top.values,
                'names': tf.gather(names, top.indices), 'logits': logits}

    def decode(encoded):
        return preprocessing.preprocess_any_for_eval(encoded, size, crop_fraction=crop_fraction,
                                                     resize_method=resize_method)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name='images')])
    def serve_encoded(images):
        pixels = tf.map_fn(decode, images, fn_output_signature=tf.TensorSpec([size, size, 3], tf.float32))
        return outputs(pixels)

    @tf.function(input_signature=[tf.TensorSpec([None, size, size, 3], tf.uint8, name='pixels')])
    def serve_pixels(pixels):
        return outputs(tf.cast(pixels, tf.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, size, size, 3], tf.float32, name='images')])
    def serve_preprocessed(images):
        return outputs(images)

    # The network's variables, not the Keras model: saving the model would make TensorFlow trace every layer's
    # call for Keras's own loader, which no signature needs (ResNet-10 at 16 px: 4.3 s instead of 1.6 s to save).
    module = tf.Module()
    module.network_variables = list(network.variables)
    module.class_names = tf.Variable(names, trainable=False, name='class_names')
    # Saved beside ``path`` and moved into place: a link at ``path`` is replaced, never written through, and a
    # save that fails (a full disk) leaves neither a half SavedModel nor the temporary folder behind.
    temporary = f'{path}.tmp-{os.getpid()}'
    try:
        files.remove_tree(temporary)
        tf.saved_model.save(module, temporary, signatures={
            'serving_default': serve_encoded, 'serving_pixels': serve_pixels,
            'serving_preprocessed': serve_preprocessed})
        files.remove_tree(path)
        tf.io.gfile.rename(temporary, path, overwrite=True)
    except (tf.errors.OpError, OSError) as error:
        files.remove_tree(temporary)
        raise OutputError(f'cannot write {path} ({files.describe_os_error(error)})') from None
