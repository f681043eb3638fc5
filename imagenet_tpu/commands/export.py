"""Export of a run's checkpoint for deployment: a SavedModel, TensorFlow Lite (float32, and int8 calibrated on
training images) and ONNX, each evaluated on the validation shards beside the SavedModel.

    imagenet-tpu-export --model_dir=RUN                                 # the latest checkpoint, every format
    imagenet-tpu-export --model_dir=RUN --checkpoint=ckpt-500 --formats=tflite,tflite_int8
    imagenet-tpu-export --model_dir=RUN --noevaluate --export_dir=/models/resnet50

The files go to RUN/export/CKPT/ (or --export_dir): saved_model/, model.tflite, model_int8.tflite, model.onnx and
export.json (the files, their sizes and the top-1 of each). The TensorFlow Lite and ONNX models take float32
pixels on the 0..255 scale, [N, image_size, image_size, 3], cropped and resized as in evaluation (the SavedModel's
serving_preprocessed signature), and return the logits. ONNX needs the 'onnx' extra (tf2onnx, onnxruntime). As for
imagenet-tpu-eval, the run's settings come from RUN/config.json and training flags override them (--data_dir of
the shards the representative set and the evaluation read).
"""

if __name__ == '__main__':   # python -m: SIGTERM taken over before TensorFlow starts threads (preemption.py)
    from imagenet_tpu.training import preemption
    preemption.listen()

from imagenet_tpu.commands import common  # first: a quiet TensorFlow start (common.py)
from absl import flags

from imagenet_tpu import deploy
from imagenet_tpu.commands import evaluate as evaluate_command
from imagenet_tpu.errors import RunError
from imagenet_tpu.serving import convert

_FORMATS = flags.DEFINE_string('formats', ','.join(convert.FORMATS), 'Formats to write beside the SavedModel, '
                               'comma-separated: ' + ', '.join(convert.FORMATS) + '.')
_EXPORT_DIR = flags.DEFINE_string('export_dir', None, 'Where the files go (default MODEL_DIR/export/CKPT).')
_REPRESENTATIVE = flags.DEFINE_integer('representative_images', deploy.REPRESENTATIVE_IMAGES,
                                       'Training images the int8 conversion calibrates on.')
_EVALUATE = flags.DEFINE_bool('evaluate', True, 'Evaluate every format on the validation shards.')


def main(argv):
    common.quiet_logs()
    if len(argv) > 1:
        common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
    try:
        formats = convert.parse_formats(_FORMATS.value)
        if _REPRESENTATIVE.value < 1:
            common.fail(f'--representative_images must be positive, got {_REPRESENTATIVE.value}')
        config = evaluate_command.run_settings()
        deploy.export_run(config, evaluate_command.checkpoint_flag(), formats, _EXPORT_DIR.value,
                          _REPRESENTATIVE.value, _EVALUATE.value, print_fn=lambda line: print(line, flush=True))
    except RunError as error:
        common.fail(str(error), common.exit_status(error))


def run(argv=None):
    """The console script imagenet-tpu-export."""
    common.run_with_help(main, __doc__, argv, command_flags=(
        'checkpoint', 'formats', 'export_dir', 'representative_images', 'evaluate'))


if __name__ == '__main__':
    run()
