"""A trained network for phones and ONNX runtimes: TensorFlow Lite (float32, and int8 calibrated on training
images) and ONNX (tf2onnx), each evaluated on the validation shards beside the SavedModel it was made with.

Every format takes what the SavedModel's ``serving_preprocessed`` signature takes (export.py): float32 pixels on
the 0..255 scale, [N, image_size, image_size, 3], already given the evaluation preprocessing of training (the
central crop, resized), and returns the logits [N, classes]. Decoding stays outside the model: TensorFlow Lite's
built-in operators have no JPEG decoder, and a phone decodes with its own. The int8 model keeps float32 input and
output (it quantizes and dequantizes at its edges), so all formats are fed the same pixels.

The files: EXPORT_DIR/saved_model, model.tflite, model_int8.tflite, model.onnx and export.json (what was written,
and the top-1 of each on the validation shards).
"""

import os
import time
import warnings
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np
import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.errors import ConfigError
from imagenet_tpu.files import write_atomically

FORMATS = ('tflite', 'tflite_int8', 'onnx')
FILE_NAMES = {'tflite': 'model.tflite', 'tflite_int8': 'model_int8.tflite', 'onnx': 'model.onnx'}
ONNX_OPSET = 17
INPUT_NAME = 'images'


def logits_function(network: keras.Model, image_size: int, space_to_depth: bool = False):
    """The network's inference logits as a tf.function of float32 pixels [N, image_size, image_size, 3] (its one
    input signature)."""

    @tf.function(input_signature=[tf.TensorSpec([None, image_size, image_size, 3], tf.float32, name=INPUT_NAME)])
    def logits(images):
        if space_to_depth:
            images = tf.nn.space_to_depth(images, 2)
        return tf.cast(network(tf.cast(images, network.input.dtype), training=False), tf.float32)

    return logits


def to_tflite(function, network: keras.Model, representative: Optional[Callable[[], Iterable]] = None) -> bytes:
    """A TensorFlow Lite flatbuffer of ``function``: float32, or with ``representative`` (a callable yielding
    [pixels] batches of one image) int8 weights and activations with float32 input and output."""
    # The converter saves the function with the object holding its variables before converting: the variables
    # alone, since with the Keras model TensorFlow would trace every layer's call as well (4x the time).
    holder = tf.Module()
    holder.network_variables = list(network.variables)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], holder)
    if representative is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = representative
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    return converter.convert()


def to_onnx(function, path: str) -> None:
    """``function`` as an ONNX model at ``path`` (tf2onnx, the 'onnx' extra)."""
    try:
        import tf2onnx  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise ConfigError("the ONNX export needs tf2onnx and onnxruntime: pip install 'imagenet-tpu[onnx]'") from None
    model, _ = tf2onnx.convert.from_function(function, input_signature=function.input_signature, opset=ONNX_OPSET)
    write_atomically(path, model.SerializeToString())


class TFLiteModel:
    """A .tflite file run by TensorFlow Lite's interpreter, on batches of any size."""

    def __init__(self, path: str, threads: Optional[int] = None):
        with warnings.catch_warnings():   # TensorFlow 2.20 points to the ai_edge_litert package: the same runtime
            warnings.simplefilter('ignore', UserWarning)
            self.interpreter = tf.lite.Interpreter(model_path=path, num_threads=threads)
        self.input = self.interpreter.get_input_details()[0]['index']
        self.output = self.interpreter.get_output_details()[0]['index']
        self.batch = None

    def __call__(self, images: np.ndarray) -> np.ndarray:
        if self.batch != len(images):
            self.interpreter.resize_tensor_input(self.input, list(images.shape))
            self.interpreter.allocate_tensors()
            self.batch = len(images)
        self.interpreter.set_tensor(self.input, images.astype(np.float32))
        self.interpreter.invoke()
        return self.interpreter.get_tensor(self.output).copy()


class ONNXModel:
    """A .onnx file run by onnxruntime on the CPU."""

    def __init__(self, path: str):
        import onnxruntime  # pylint: disable=import-outside-toplevel
        self.session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
        self.input = self.session.get_inputs()[0].name

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input: images.astype(np.float32)})[0]


class SavedModel:
    """The SavedModel of export.py through its serving_preprocessed signature: the logits."""

    def __init__(self, path: str):
        self.signature = tf.saved_model.load(path).signatures['serving_preprocessed']

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return self.signature(images=tf.constant(images, tf.float32))['logits'].numpy()


def load(kind: str, path: str):
    """A callable pixels -> logits for a file of ``kind`` ('saved_model' or one of FORMATS)."""
    if kind == 'saved_model':
        return SavedModel(path)
    if kind == 'onnx':
        return ONNXModel(path)
    return TFLiteModel(path)


def top_1(models: Dict[str, Callable], batches: Iterable, log: Callable[[str], None] = print,
          total: Optional[int] = None) -> Dict[str, dict]:
    """{name: {'top_1', 'images', 'seconds'}} of each model over ``batches`` of (pixels, model labels, weights):
    the images of weight 0 (the padding of evaluation batches) are left out. Progress every 10 s."""
    correct = {name: 0 for name in models}
    seconds = {name: 0.0 for name in models}
    images, last = 0, time.monotonic()
    for pixels, labels, weights in batches:
        keep = np.asarray(weights) > 0
        if not keep.any():
            continue
        pixels, labels = np.asarray(pixels, np.float32)[keep], np.asarray(labels)[keep]
        for name, model in models.items():
            started = time.perf_counter()
            logits = model(pixels)
            seconds[name] += time.perf_counter() - started
            correct[name] += int(np.sum(np.argmax(logits, axis=1) == labels))
        images += len(labels)
        if time.monotonic() - last > 10:
            last = time.monotonic()
            log(f'evaluated {images}' + (f' of {total}' if total else '') + ' images')
    return {name: {'top_1': correct[name] / max(images, 1), 'images': images, 'seconds': seconds[name]}
            for name in models}


def parse_formats(text: str) -> List[str]:
    """'tflite,onnx' -> ['tflite', 'onnx']; ConfigError for a format that is not one of FORMATS."""
    formats = [item.strip() for item in text.split(',') if item.strip()]
    unknown = [item for item in formats if item not in FORMATS]
    if unknown:
        raise ConfigError(f'--formats: unknown {", ".join(unknown)}; the formats are {", ".join(FORMATS)}')
    return formats


def file_path(export_dir: str, kind: str) -> str:
    return os.path.join(export_dir, 'saved_model' if kind == 'saved_model' else FILE_NAMES[kind])
