"""A run's checkpoint for deployment (the imagenet-tpu-export command is commands/export.py): the SavedModel,
TensorFlow Lite float32 and int8 and ONNX files of serving/convert.py, written together, and the top-1 of each on
the validation shards beside the SavedModel's, so a conversion that changes what the network computes is seen
before it ships.
"""

import dataclasses
import os
import time
from typing import Optional, Sequence

import tensorflow as tf

from imagenet_tpu import builders, evaluate
from imagenet_tpu.config import Config
from imagenet_tpu.data import eval_input, labels
from imagenet_tpu.errors import ConfigError
from imagenet_tpu.files import real_directory, write_atomically, write_json
from imagenet_tpu.serving import convert, export
from imagenet_tpu.training import run_folder

REPRESENTATIVE_IMAGES = 256


def export_run(config: Config, which: str = 'latest', formats: Sequence[str] = convert.FORMATS,
               export_dir: Optional[str] = None, representative_images: int = REPRESENTATIVE_IMAGES,
               evaluate_formats: bool = True, strategy: Optional[tf.distribute.Strategy] = None,
               print_fn=print) -> dict:
    """Writes the checkpoint ``which`` names (latest or ckpt-N) of config.model_dir as a SavedModel and each of
    ``formats`` into ``export_dir`` (MODEL_DIR/export/CKPT), evaluates each on the validation shards with
    ``evaluate_formats``, and returns (and writes to export.json) what it did: the files, their sizes and the
    top-1 of each."""
    paths = evaluate.select_checkpoints(config.model_dir, which)
    if len(paths) != 1:
        raise ConfigError(f'--checkpoint={which}: export one checkpoint (latest or a name such as ckpt-500)')
    path = paths[0]
    run_folder.check_model_settings(config, config.model_dir, resuming=False)
    if 'onnx' in formats:
        try:
            import tf2onnx, onnxruntime  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except ImportError:
            raise ConfigError("the ONNX export needs tf2onnx and onnxruntime: pip install 'imagenet-tpu[onnx]' "
                              '(or --formats=tflite,tflite_int8)') from None
    if not export_dir:      # inside the run folder: links planted there are removed, not followed
        export_dir = os.path.join(config.model_dir, 'export', os.path.basename(path))
        real_directory(os.path.dirname(export_dir))
        real_directory(export_dir)
    tf.io.gfile.makedirs(export_dir)
    evaluator = evaluate.Evaluator(config, strategy)
    evaluator.prepare(path)
    network = builders.build_export_network(config, evaluator.classifier.network)
    names, _ = labels.class_names(config.num_classes, config.label_offset, config.data_dir)
    files = {'saved_model': convert.file_path(export_dir, 'saved_model')}
    export.export_saved_model(network, files['saved_model'], names, **builders.export_settings(config))
    print_fn(f'wrote {files["saved_model"]}')
    function = convert.logits_function(network, config.image_size, config.space_to_depth)
    for kind in formats:
        started = time.perf_counter()
        files[kind] = convert.file_path(export_dir, kind)
        if kind == 'onnx':
            convert.to_onnx(function, files[kind])
        else:
            representative = None
            if kind == 'tflite_int8':
                images = eval_input.calibration_dataset(config, representative_images).batch(1)
                representative = lambda: ([batch] for batch in images.as_numpy_iterator())   # noqa: E731
            write_atomically(files[kind], convert.to_tflite(function, network, representative))
        print_fn(f'wrote {files[kind]} ({size_mib(files[kind]):.1f} MiB, {time.perf_counter() - started:.1f} s)')
    result = {'checkpoint': os.path.basename(path), 'step': evaluate.checkpoint_step(path),
              'files': {kind: {'path': file, 'mib': round(size_mib(file), 2)} for kind, file in files.items()}}
    if evaluate_formats:
        result['evaluation'] = evaluate_files(config, files, print_fn)
    write_json(os.path.join(export_dir, 'export.json'), result)
    return result


def evaluate_files(config: Config, files: dict, print_fn=print) -> dict:
    """{kind: {'top_1', 'images', 'seconds'}} of each file of ``files`` ({kind: path}, 'saved_model' among them)
    on every validation image once, run by TensorFlow (the SavedModel), TensorFlow Lite's interpreter and
    onnxruntime; prints a line per kind with its difference to the SavedModel's top-1."""
    models = {kind: convert.load(kind, path) for kind, path in files.items()}
    # The pixels the formats take: the evaluation preprocessing, float32, without the stem's space-to-depth.
    eval_config = dataclasses.replace(config, space_to_depth=False)
    batches = eval_input.eval_dataset(eval_config, dtype=tf.float32).as_numpy_iterator()
    results = convert.top_1(models, batches, print_fn, total=config.num_eval_images)
    reference = results['saved_model']['top_1']
    for kind, result in results.items():
        change = '' if kind == 'saved_model' else f' ({100 * (result["top_1"] - reference):+.2f} points)'
        print_fn(f'{kind}: top-1 {100 * result["top_1"]:.2f}%{change} on {result["images"]} images, '
                 f'{1000 * result["seconds"] / max(result["images"], 1):.2f} ms per image')
    return results


def size_mib(path: str) -> float:
    if tf.io.gfile.isdir(path):
        return sum(tf.io.gfile.stat(os.path.join(folder, name)).length
                   for folder, _, names in tf.io.gfile.walk(path) for name in names) / 2 ** 20
    return tf.io.gfile.stat(path).length / 2 ** 20
