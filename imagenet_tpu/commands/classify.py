"""Classify image files with an exported model: the top-5 classes, with names and probabilities, per image.

    imagenet-tpu-classify --saved_model=RUN/saved_model photo.jpg photos/ 'shots/*.png'
    imagenet-tpu-classify --saved_model=RUN/saved_model --json photos/ > predictions.jsonl

Arguments are files, directories (their image files, recursively) and glob patterns. A file that cannot be read,
is not a regular file (a link to one is followed; a device, FIFO, socket or directory is not read), is larger
than 64 MiB, is not a JPEG, PNG, GIF or BMP image, or whose header claims more pixels than training decodes (a
decompression bomb) is reported on stderr and skipped; the others are classified in batches by the SavedModel's
serving_default signature (export.py), which applies the evaluation preprocessing of training.

Exit status:
    0  every file was classified;
    1  some files were skipped, the others classified (the skips are on stderr, and counted at the end);
    2  an error, one ``error:`` line on stderr: no arguments, an unknown or malformed flag, a --batch_size below
       1, a SavedModel that is missing or cannot be loaded (its variables deleted or damaged, ...); or no file
       could be classified.
"""

import sys

if __name__ == '__main__':   # python -m: SIGTERM taken over before TensorFlow starts threads (preemption.py)
    from imagenet_tpu.training import preemption
    preemption.listen()

from imagenet_tpu.commands import common  # first: a quiet TensorFlow start (common.py)
from absl import flags

from imagenet_tpu.serving.classify import classify, expand, load

_SAVED_MODEL = flags.DEFINE_string('saved_model', None, 'A SavedModel written by --export_saved_model '
                                   '(MODEL_DIR/saved_model).')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 32, 'Images per call of the model.')
_JSON = flags.DEFINE_bool('json', False, 'One JSON object per image on stdout instead of a text line.')


def main(argv):
    files, problems = expand(argv[1:])
    for argument, reason in problems:
        print(f'skipped {argument}: {reason}', file=sys.stderr)
    if not argv[1:]:
        print('error: name the images to classify: files, directories or glob patterns', file=sys.stderr)
        sys.exit(2)
    if _BATCH_SIZE.value < 1:
        print(f'error: --batch_size must be positive, got {_BATCH_SIZE.value}', file=sys.stderr)
        sys.exit(2)
    try:
        serve = load(_SAVED_MODEL.value)
    except ValueError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
    counts = classify(serve, files, _BATCH_SIZE.value, _JSON.value)
    skipped = counts['skipped'] + len(problems)
    if skipped:
        print(f'classified {counts["classified"]} images, skipped {skipped}', file=sys.stderr)
    sys.exit(0 if not skipped else 1 if counts['classified'] else 2)


def run(argv=None):
    """The console script imagenet-tpu-classify. A bad flag or --flagfile is one ``error:`` line and exit status 2
    (absl's own parser exits with 1, which here means that files were skipped)."""
    common.run_with_help(main, __doc__, argv, command_flags=('saved_model', 'batch_size', 'json'),
                         training_flags=False)


if __name__ == '__main__':
    run()
