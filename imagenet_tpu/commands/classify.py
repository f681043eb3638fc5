"""Classify image files with an exported model: the top-5 classes, with names and probabilities, per image.

    imagenet-tpu-classify --saved_model=RUN/saved_model photo.jpg photos/ 'shots/*.png'
    imagenet-tpu-classify --saved_model=RUN/saved_model --json photos/ > predictions.jsonl

Arguments are files, directories (their image files, recursively) and glob patterns. A file that cannot be read
or is not a JPEG, PNG, GIF or BMP image is reported on stderr and skipped; the others are classified in batches
by the SavedModel's serving_default signature (export.py), which applies the evaluation preprocessing of training.
Exit status 0 when every file was classified, 1 when some were skipped, 2 when nothing could be.
"""

import sys

from imagenet_tpu.commands import common  # noqa: F401  first: a quiet TensorFlow start (common.py)
from absl import app, flags

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


def run():
    """The console script imagenet-tpu-classify."""
    app.run(main)


if __name__ == '__main__':
    run()
