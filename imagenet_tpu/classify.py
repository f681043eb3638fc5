"""Classify image files with an exported model: the top-5 classes, with names and probabilities, per image.

    imagenet-tpu-classify --saved_model=RUN/saved_model photo.jpg photos/ 'shots/*.png'
    imagenet-tpu-classify --saved_model=RUN/saved_model --json photos/ > predictions.jsonl

Arguments are files, directories (their image files, recursively) and glob patterns. A file that cannot be read
or is not a JPEG, PNG, GIF or BMP image is reported on stderr and skipped; the others are classified in batches
by the SavedModel's serving_default signature (export.py), which applies the evaluation preprocessing of training.
Exit status 0 when every file was classified, 1 when some were skipped, 2 when nothing could be.
"""

import glob
import json
import os
import sys
import time
from typing import List, Tuple

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from imagenet_tpu import runtime  # first: sets oneDNN before TensorFlow is imported (runtime.py)

tf = runtime.import_tensorflow()
from absl import app, flags  # noqa: E402

from imagenet_tpu.callbacks import format_duration  # noqa: E402

_SAVED_MODEL = flags.DEFINE_string('saved_model', None, 'A SavedModel written by --export_saved_model '
                                   '(MODEL_DIR/saved_model).')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 32, 'Images per call of the model.')
_JSON = flags.DEFINE_bool('json', False, 'One JSON object per image on stdout instead of a text line.')

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.gif', '.bmp')
_SIGNATURES = ((b'\xff\xd8\xff', 'JPEG'), (b'\x89PNG\r\n\x1a\n', 'PNG'), (b'GIF87a', 'GIF'), (b'GIF89a', 'GIF'),
               (b'BM', 'BMP'))
PROGRESS_SECONDS = 10.0


def expand(arguments: List[str]) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(files in the order given, [(argument, why nothing came of it)]): directories give their image files
    (recursively, sorted), patterns the files they match."""
    files, problems = [], []
    for argument in arguments:
        if os.path.isdir(argument):
            found = sorted(os.path.join(folder, name) for folder, _, names in os.walk(argument) for name in names
                           if name.lower().endswith(IMAGE_EXTENSIONS))
            if not found:
                problems.append((argument, 'a directory without image files'))
        elif os.path.exists(argument) or os.path.islink(argument):
            found = [argument]
        else:
            found = sorted(path for path in glob.glob(argument) if not os.path.isdir(path))
            if not found:
                problems.append((argument, 'no such file, and no file matches it as a pattern'))
        files.extend(found)
    return files, problems


def read_image(path: str):
    """(encoded bytes, None) for a decodable image, else (None, the reason)."""
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as error:
        return None, f'cannot read it ({error.strerror or type(error).__name__})'
    kind = next((name for magic, name in _SIGNATURES if data.startswith(magic)), None)
    if kind is None:
        return None, 'not a JPEG, PNG, GIF or BMP image'
    try:
        tf.io.decode_image(data, channels=3, expand_animations=False)
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError):
        return None, f'a damaged {kind} file'
    return data, None


def load(path: str):
    """The serving_default signature of the SavedModel at ``path``; ValueError with a one-line reason."""
    if not path:
        raise ValueError('--saved_model is not set (MODEL_DIR/saved_model of a run with --export_saved_model)')
    if not tf.saved_model.contains_saved_model(path):
        raise ValueError(f'--saved_model {path} holds no SavedModel (train with --export_saved_model)')
    signatures = tf.saved_model.load(path).signatures
    if 'serving_default' not in signatures or 'names' not in signatures['serving_default'].structured_outputs:
        raise ValueError(f'{path} was not exported by imagenet_tpu (no serving_default signature with class names)')
    return signatures['serving_default']


def describe(path: str, outputs: dict, row: int, as_json: bool) -> str:
    names = [name.decode() for name in outputs['names'][row].numpy()]
    scores = [float(score) for score in outputs['scores'][row].numpy()]
    classes = [int(index) for index in outputs['classes'][row].numpy()]
    if as_json:
        return json.dumps({'file': path, 'top_5': [{'class': index, 'name': name, 'probability': round(score, 6)}
                                                    for index, name, score in zip(classes, names, scores)]})
    return f'{path}: ' + ', '.join(f'{name} {score:.3f}' for name, score in zip(names, scores))


def classify(serve, files: List[str], batch_size: int, as_json: bool, out=sys.stdout, err=sys.stderr) -> dict:
    """Classifies ``files`` in batches, printing one line per image; returns {'classified': n, 'skipped': n}."""
    counts = {'classified': 0, 'skipped': 0}
    started = last_report = time.perf_counter()
    batch_paths, batch_data = [], []

    def flush():
        if not batch_data:
            return
        outputs = serve(images=tf.constant(batch_data))
        for row, path in enumerate(batch_paths):
            print(describe(path, outputs, row, as_json), file=out, flush=True)
        counts['classified'] += len(batch_paths)
        batch_paths.clear()
        batch_data.clear()

    for index, path in enumerate(files):
        data, reason = read_image(path)
        if data is None:
            counts['skipped'] += 1
            print(f'skipped {path}: {reason}', file=err, flush=True)
        else:
            batch_paths.append(path)
            batch_data.append(data)
        if len(batch_data) == batch_size:
            flush()
        now = time.perf_counter()
        if now - last_report >= PROGRESS_SECONDS and index + 1 < len(files):
            rate = (index + 1) / (now - started)
            print(f'{index + 1:,}/{len(files):,} files, {rate:,.1f} images/s, ETA '
                  f'{format_duration((len(files) - index - 1) / rate)}', file=err, flush=True)
            last_report = now
    flush()
    return counts


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
    app.run(main)


if __name__ == '__main__':
    run()
