"""Classifying image files with an exported model (the imagenet-tpu-classify command is commands/classify.py):
arguments expanded to image files, files read and checked, the SavedModel's serving_default signature (export.py)
called in batches, one line or JSON object per image."""

import glob
import json
import os
import sys
import time
from typing import List, Tuple

import tensorflow as tf

from imagenet_tpu.training.callbacks import format_duration

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
