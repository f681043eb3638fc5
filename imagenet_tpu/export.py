"""Export of a trained network as a SavedModel that loads and runs without this package or any strategy."""

import tensorflow as tf
import tf_keras as keras


def export_saved_model(network: keras.Model, path: str) -> None:
    """Writes ``network`` as a SavedModel whose serving signature maps images to logits (inference mode, with
    the batch-norm statistics chosen by the config); it loads and runs without any strategy."""
    image_size = network.input_shape[1]

    @tf.function(input_signature=[tf.TensorSpec([None, image_size, image_size, 3], tf.float32, name='images')])
    def serve(images):
        return {'logits': network(images, training=False)}

    tf.saved_model.save(network, path, signatures={'serving_default': serve})
