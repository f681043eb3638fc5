"""Classifying image files with an exported model (the imagenet-tpu-classify command is commands/classify.py):
arguments expanded to image files, files read and checked, the SavedModel's serving_default signature (export.py)
called in batches, one line or JSON object per image.

Only regular files are read (a link is followed; a device, FIFO, socket or directory is skipped), never more
than MAX_FILE_BYTES of one, and nothing is decoded whose header claims more than the MAX_IMAGE_PIXELS of
training's preprocessing (a decompression bomb: a small file that decodes to gigabytes).
"""

import errno
import glob
import json
import os
import stat
import struct
import sys
import time
from typing import List, Optional, Tuple

import tensorflow as tf

from imagenet_tpu.data.preprocessing import MAX_IMAGE_PIXELS
from imagenet_tpu.training.callbacks import format_duration

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.gif', '.bmp')
_SIGNATURES = ((b'\xff\xd8\xff', 'JPEG'), (b'\x89PNG\r\n\x1a\n', 'PNG'), (b'GIF87a', 'GIF'), (b'GIF89a', 'GIF'),
               (b'BM', 'BMP'))
PROGRESS_SECONDS = 10.0
# The largest file read; a larger one is skipped unread (and a file that grows past it while read, at this size).
MAX_FILE_BYTES = 64 * 2 ** 20


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


def read_file(path: str) -> Tuple[Optional[bytes], Optional[str]]:
    """(the bytes of the regular file at ``path``, None), or (None, the reason) for anything else: a device,
    FIFO, socket or directory (a link is followed), a file larger than MAX_FILE_BYTES, one that cannot be read.
    Opening never blocks (O_NONBLOCK, for a FIFO made in place of the file after the check), the opened file
    itself is checked again, and at most MAX_FILE_BYTES + 1 bytes are read, so a growing file stops there."""
    too_large = 'larger than ' + (f'{MAX_FILE_BYTES // 2 ** 20} MiB' if MAX_FILE_BYTES % 2 ** 20 == 0
                                  else f'{MAX_FILE_BYTES:,} bytes')
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None, 'not a regular file'
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, 'O_CLOEXEC', 0))
    except OSError as error:
        if error.errno == errno.ENXIO:     # a socket made in place of the file after the check
            return None, 'not a regular file'
        return None, f'cannot read it ({error.strerror or type(error).__name__})'
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            return None, 'not a regular file'
        if status.st_size > MAX_FILE_BYTES:
            return None, too_large
        with os.fdopen(descriptor, 'rb', closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        return None, f'cannot read it ({error.strerror or type(error).__name__})'
    finally:
        os.close(descriptor)
    return (None, too_large) if len(data) > MAX_FILE_BYTES else (data, None)


def _gif_color_table(flags: int) -> int:
    """Bytes of the colour table that a GIF's packed field ``flags`` announces."""
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0


def _gif_skip_sub_blocks(data: bytes, position: int) -> int:
    """The position after the data sub-blocks (length byte, bytes; a zero length ends them) at ``position``."""
    while position < len(data) and data[position]:
        position += data[position] + 1
    return position + 1


def _gif_dimensions(data: bytes) -> Optional[Tuple[int, int]]:
    """The largest of a GIF's logical screen and frames: TensorFlow's canvas is the largest frame, which may
    exceed the screen. The blocks are walked to the trailer or to the first byte that is not a block."""
    if len(data) < 13:
        return None
    width, height = struct.unpack_from('<HH', data, 6)
    position = 13 + _gif_color_table(data[10])
    while position < len(data) and data[position] != 0x3B:          # trailer
        if data[position] == 0x21:                                   # extension: label, data sub-blocks
            position = _gif_skip_sub_blocks(data, position + 2)
        elif data[position] == 0x2C and position + 10 <= len(data):  # image: left, top, width, height, flags
            left, top, frame_width, frame_height = struct.unpack_from('<4H', data, position + 1)
            width, height = max(width, left + frame_width), max(height, top + frame_height)
            # After the local colour table, one byte (the LZW code size), then the image's data sub-blocks.
            position = _gif_skip_sub_blocks(data, position + 10 + _gif_color_table(data[position + 9]) + 1)
        else:
            break
    return width, height


def image_dimensions(data: bytes, kind: str) -> Optional[Tuple[int, int]]:
    """(width, height) the header of an image of ``kind`` (JPEG, PNG, GIF or BMP) claims, read without decoding
    it; None when the header cannot be read. JPEG: libjpeg's own header reader (tf.image.extract_jpeg_shape);
    PNG: the IHDR chunk, which must come first; GIF: _gif_dimensions; BMP: the signed 32-bit width and height
    of its info header (a negative height is a top-down image)."""
    if kind == 'JPEG':
        try:
            height, width, _ = tf.image.extract_jpeg_shape(data).numpy()
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError):
            return None
        return int(width), int(height)
    if kind == 'PNG':
        return struct.unpack_from('>II', data, 16) if len(data) >= 24 and data[12:16] == b'IHDR' else None
    if kind == 'GIF':
        return _gif_dimensions(data)
    if kind == 'BMP' and len(data) >= 26:
        width, height = struct.unpack_from('<ii', data, 18)
        return abs(width), abs(height)
    return None


def read_image(path: str) -> Tuple[Optional[bytes], Optional[str]]:
    """(encoded bytes, None) for a decodable image, else (None, the reason): read_file's reasons, not an image,
    an image whose header claims more than MAX_IMAGE_PIXELS (checked before decoding), a damaged image."""
    data, reason = read_file(path)
    if data is None:
        return None, reason
    kind = next((name for magic, name in _SIGNATURES if data.startswith(magic)), None)
    if kind is None:
        return None, 'not a JPEG, PNG, GIF or BMP image'
    dimensions = image_dimensions(data, kind)
    if dimensions is None:
        return None, f'a damaged {kind} file'
    width, height = dimensions
    if width * height > MAX_IMAGE_PIXELS:
        return None, f'image of {width} x {height} pixels is larger than the limit of {MAX_IMAGE_PIXELS:,} pixels'
    try:
        tf.io.decode_image(data, channels=3, expand_animations=False)
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError):
        return None, f'a damaged {kind} file'
    return data, None


def load(path: str):
    """The serving_default signature of the SavedModel at ``path``; ValueError with a one-line reason, also when
    the SavedModel is there but cannot be loaded (its variables missing or damaged, ...)."""
    if not path:
        raise ValueError('--saved_model is not set (MODEL_DIR/saved_model of a run with --export_saved_model)')
    if not tf.saved_model.contains_saved_model(path):
        raise ValueError(f'--saved_model {path} holds no SavedModel (train with --export_saved_model)')
    try:
        signatures = tf.saved_model.load(path).signatures
    except Exception as error:  # pylint: disable=broad-except  # TensorFlow's loader raises many kinds
        raise ValueError(f'--saved_model {path} cannot be loaded ({_first_line(error)}); export it again') from None
    if 'serving_default' not in signatures or 'names' not in signatures['serving_default'].structured_outputs:
        raise ValueError(f'{path} was not exported by imagenet_tpu (no serving_default signature with class names)')
    return signatures['serving_default']


def _first_line(error: Exception) -> str:
    """What an exception says, on one line: its first line that is not empty (else its type)."""
    message = error.message if isinstance(error, tf.errors.OpError) else str(error)
    return next((line.strip() for line in message.splitlines() if line.strip()), type(error).__name__)


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
