"""The classify command, in a real process: files, directories and patterns in; top-5 names and probabilities
out (text or JSON lines), equal to the SavedModel's own outputs; unreadable and non-image files skipped with a
line each, never a traceback. Devices, FIFOs and oversized files are skipped without being read, images whose
header claims too many pixels without being decoded, and a SavedModel that cannot be loaded is one error line."""

import functools
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import socket
import tempfile

import numpy as np
from PIL import Image
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.serving import classify
from imagenet_tpu.serving import export
from imagenet_tpu import builders
from imagenet_tpu.data import preprocessing

NAMES = ['cat', 'dog', 'fish', 'bird']
MEMORY_LIMIT_KIB = 8 * 2 ** 20     # the command's address space: a regression that reads without end fails


def run_classify(*args, timeout=300):
    """The command in a child process of at most MEMORY_LIMIT_KIB of memory, stopped (TimeoutExpired, a failure)
    if it runs longer than ``timeout`` seconds."""
    command = [sys.executable, '-m', 'imagenet_tpu.commands.classify', *args]
    process = subprocess.run(['/bin/sh', '-c', f'ulimit -v {MEMORY_LIMIT_KIB} && exec "$@"', 'sh', *command],
                             cwd=helpers.REPO, env=helpers.subprocess_environment(), capture_output=True, text=True,
                             timeout=timeout)
    return process.returncode, process.stdout, process.stderr


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real JPEG of 36 x 44 pixels whose frame header (SOF0) claims ``width`` x ``height``."""
    data = bytearray(tf.io.encode_jpeg(helpers.photo_like(36, 44, seed=5)).numpy())
    start = data.index(b'\xff\xc0')     # marker, length (2 bytes), precision (1), height (2), width (2)
    data[start + 5:start + 9] = struct.pack('>HH', height, width)
    return bytes(data)


def png_claiming(width: int, height: int) -> bytes:
    data = bytearray(tf.io.encode_png(helpers.photo_like(36, 44, seed=6)).numpy())
    data[16:24] = struct.pack('>II', width, height)     # IHDR, the first chunk: width, height
    return bytes(data)


def bmp_claiming(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(helpers.photo_like(36, 44, seed=7)).save(buffer, 'BMP')
    data = bytearray(buffer.getvalue())
    data[18:26] = struct.pack('<ii', width, height)
    return bytes(data)


def gif(screen, frames, extension: bool = True) -> bytes:
    """A GIF's block structure (GIF89a specification): a logical screen of ``screen`` (width, height) with a
    2-colour table, an application extension, and one image descriptor per (width, height) of ``frames``, each
    with a local colour table and one data sub-block; the pixels themselves are not valid LZW."""
    data = b'GIF89a' + struct.pack('<HHBBB', *screen, 0x80, 0, 0) + bytes(6)
    if extension:
        data += b'\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00'
    for width, height in frames:
        data += b'\x2c' + struct.pack('<HHHHB', 0, 0, width, height, 0x81) + bytes(12) + b'\x02\x03\x84\x1d\x05\x00'
    return data + b'\x3b'


@functools.lru_cache(maxsize=None)
def exported_model() -> str:
    """A SavedModel of a small network (batch norm, 4 classes, 32 px, seed 2), exported once per process for the
    classes below (none of them changes it)."""
    root = tempfile.mkdtemp(prefix='classify-model-', dir=tf.compat.v1.test.get_temp_dir())
    config = helpers.tiny_config(norm='batch_norm', num_classes=4, image_size=32)
    keras.utils.set_random_seed(2)
    path = os.path.join(root, 'saved_model')
    export.export_saved_model(builders.build_network(config), path, NAMES, **builders.export_settings(config))
    return path


class ClassifyTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='classify-', dir=tf.compat.v1.test.get_temp_dir())
        cls.saved_model = exported_model()
        cls.photos = os.path.join(cls.root, 'photos')
        os.makedirs(os.path.join(cls.photos, 'more'))
        cls.images = {}
        for index, name in enumerate(('a.jpg', 'more/b.JPEG', 'c.png')):
            pixels = helpers.photo_like(36, 44, seed=index)
            encoded = (tf.io.encode_png(pixels) if name.endswith('png') else tf.io.encode_jpeg(pixels)).numpy()
            path = os.path.join(cls.photos, name)
            with open(path, 'wb') as f:
                f.write(encoded)
            cls.images[path] = encoded
        cls.notes = os.path.join(cls.root, 'notes.txt')
        with open(cls.notes, 'w') as f:
            f.write('not an image\n')
        cls.broken = os.path.join(cls.root, 'broken.jpg')
        with open(cls.broken, 'wb') as f:
            f.write(cls.images[os.path.join(cls.photos, 'a.jpg')][:300])

    def test_json_lines_equal_the_models_outputs_and_bad_files_are_skipped(self):
        code, out, err = run_classify(f'--saved_model={self.saved_model}', '--json', '--batch_size=2', self.photos,
                                      os.path.join(self.photos, '*.png'), self.notes, self.broken,
                                      os.path.join(self.root, 'missing.jpg'))
        self.assertEqual(code, 1, err)                      # some skipped
        self.assertNotIn('Traceback', err)
        rows = [json.loads(line) for line in out.splitlines()]
        # The directory (recursively, sorted) and then the pattern's match.
        self.assertEqual([row['file'] for row in rows], sorted(self.images) + [os.path.join(self.photos, 'c.png')])
        served = tf.saved_model.load(self.saved_model).signatures['serving_default']
        for row in rows:
            expected = served(images=tf.constant([self.images[row['file']]]))
            self.assertEqual([entry['name'] for entry in row['top_5']],
                             [name.decode() for name in expected['names'].numpy()[0]])
            self.assertAllClose([entry['probability'] for entry in row['top_5']], expected['scores'].numpy()[0],
                                atol=1e-5)
            self.assertAllClose(sum(entry['probability'] for entry in row['top_5']), 1.0, atol=1e-4)  # 4 classes
        skipped = sorted(line for line in err.splitlines() if line.startswith('skipped '))
        self.assertEqual(skipped, sorted([f'skipped {self.notes}: not a JPEG, PNG, GIF or BMP image',
                                          f'skipped {self.broken}: a damaged JPEG file',
                                          f'skipped {os.path.join(self.root, "missing.jpg")}: no such file, and no '
                                          'file matches it as a pattern']))
        self.assertIn('classified 4 images, skipped 3', err)

    def test_text_lines_and_a_missing_saved_model(self):
        served = classify.load(self.saved_model)
        out = io.StringIO()
        counts = classify.classify(served, [os.path.join(self.photos, 'a.jpg')], 4, as_json=False, out=out)
        self.assertEqual(counts, {'classified': 1, 'skipped': 0})
        self.assertRegex(out.getvalue().strip(), r'^\S+a\.jpg: (\w+ [01]\.\d{3}, ){3}\w+ [01]\.\d{3}$')
        with self.assertRaisesRegex(ValueError, f'--saved_model {self.root} holds no SavedModel'):
            classify.load(self.root)

    def test_expand_reports_what_gave_nothing(self):
        empty = os.path.join(self.root, 'empty')
        os.makedirs(empty, exist_ok=True)
        files, problems = classify.expand([self.photos, empty, os.path.join(self.root, 'nothing-*.jpg')])
        self.assertEqual(files, sorted(self.images))
        self.assertEqual([reason for _, reason in problems],
                         ['a directory without image files', 'no such file, and no file matches it as a pattern'])
        self.assertEqual(classify.read_image(self.notes), (None, 'not a JPEG, PNG, GIF or BMP image'))
        data, reason = classify.read_image(os.path.join(self.photos, 'c.png'))
        self.assertIsNone(reason)
        self.assertEqual(data, self.images[os.path.join(self.photos, 'c.png')])


class UntrustedInputTest(tf.test.TestCase):
    """Files that must not be read, or read whole, or decoded: devices, FIFOs, oversized files, images whose
    header claims more pixels than training decodes; and SavedModels that cannot be loaded."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='untrusted-', dir=tf.compat.v1.test.get_temp_dir())
        cls.saved_model = exported_model()
        cls.good = os.path.join(cls.root, 'good.jpg')
        cls.write(cls.good, tf.io.encode_jpeg(helpers.photo_like(36, 44, seed=1)).numpy())

    @staticmethod
    def write(path: str, data: bytes) -> str:
        with open(path, 'wb') as f:
            f.write(data)
        return path

    def folder(self, name: str) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(path)
        return path

    def test_devices_fifos_large_files_and_bombs_are_skipped_without_being_read(self):
        folder = self.folder('odd')
        os.symlink('/dev/zero', os.path.join(folder, 'zero.jpg'))        # read whole, it never ends
        os.mkfifo(os.path.join(folder, 'fifo.jpg'))                       # opened without a writer, it blocks
        os.symlink(self.good, os.path.join(folder, 'link.jpg'))           # a link to a regular file is fine
        with open(os.path.join(folder, 'huge.jpg'), 'wb') as f:           # sparse: 65 MiB, nothing on disk
            f.write(b'\xff\xd8\xff\xe0')
            f.truncate(65 * 2 ** 20)
        self.write(os.path.join(folder, 'bomb.jpg'), jpeg_claiming(13000, 13000))
        self.write(os.path.join(folder, 'bomb.png'), png_claiming(13000, 13000))
        code, out, err = run_classify(f'--saved_model={self.saved_model}', folder, timeout=120)
        self.assertEqual(code, 1, err)                                   # some skipped, the others classified
        self.assertNotIn('Traceback', err)
        self.assertEqual([line.split(':')[0] for line in out.splitlines()], [os.path.join(folder, 'link.jpg')])
        limit = f'{preprocessing.MAX_IMAGE_PIXELS:,}'
        self.assertEqual(sorted(line for line in err.splitlines() if line.startswith('skipped ')), sorted(
            f'skipped {os.path.join(folder, name)}: {reason}' for name, reason in (
                ('zero.jpg', 'not a regular file'), ('fifo.jpg', 'not a regular file'),
                ('huge.jpg', 'larger than 64 MiB'),
                ('bomb.jpg', f'image of 13000 x 13000 pixels is larger than the limit of {limit} pixels'),
                ('bomb.png', f'image of 13000 x 13000 pixels is larger than the limit of {limit} pixels'))))
        self.assertIn('classified 1 images, skipped 5', err)

    def test_read_image_checks_the_file_and_the_header(self):
        folder = self.folder('read')
        reasons = {}
        os.symlink(self.folder('elsewhere'), os.path.join(folder, 'folder.jpg'))
        self.addCleanup(os.remove, os.path.join(folder, 'folder.jpg'))    # tf.test's clean-up cannot remove it
        listening = socket.socket(socket.AF_UNIX)
        self.addCleanup(listening.close)
        listening.bind(os.path.join(folder, 'socket.jpg'))
        os.symlink(self.good, os.path.join(folder, 'link.jpg'))
        with open(os.path.join(folder, 'huge.png'), 'wb') as f:
            f.write(b'\x89PNG\r\n\x1a\n')
            f.truncate(classify.MAX_FILE_BYTES + 1)
        for name, data in (('bomb.jpg', jpeg_claiming(13000, 13000)), ('wide.jpg', jpeg_claiming(60000, 1500)),
                           ('bomb.png', png_claiming(9500, 9500)), ('bomb.bmp', bmp_claiming(13000, -13000)),
                           ('screen.gif', gif((13000, 13000), [(8, 8)])),
                           ('frame.gif', gif((8, 8), [(8, 8), (13000, 13000)])),
                           ('short.png', png_claiming(36, 44)[:20])):
            self.write(os.path.join(folder, name), data)
        for name in sorted(os.listdir(folder)):
            reasons[name] = classify.read_image(os.path.join(folder, name))[1]
        self.assertEqual(classify.MAX_FILE_BYTES, 64 * 2 ** 20)
        self.assertEqual(reasons, {
            'folder.jpg': 'not a regular file', 'socket.jpg': 'not a regular file', 'link.jpg': None,
            'huge.png': 'larger than 64 MiB',
            'bomb.jpg': 'image of 13000 x 13000 pixels is larger than the limit of 89,478,485 pixels',
            'wide.jpg': 'image of 60000 x 1500 pixels is larger than the limit of 89,478,485 pixels',
            'bomb.png': 'image of 9500 x 9500 pixels is larger than the limit of 89,478,485 pixels',
            'bomb.bmp': 'image of 13000 x 13000 pixels is larger than the limit of 89,478,485 pixels',
            'screen.gif': 'image of 13000 x 13000 pixels is larger than the limit of 89,478,485 pixels',
            'frame.gif': 'image of 13000 x 13000 pixels is larger than the limit of 89,478,485 pixels',
            'short.png': 'a damaged PNG file'})
        # A file longer than its size says (procfs says 0) is read up to the limit and one byte more, and skipped.
        self.assertEqual(os.stat('/proc/self/status').st_size, 0)
        limit = classify.MAX_FILE_BYTES
        try:
            classify.MAX_FILE_BYTES = 100
            self.assertEqual(classify.read_image('/proc/self/status'), (None, 'larger than 100 bytes'))
        finally:
            classify.MAX_FILE_BYTES = limit

    def test_headers_give_the_real_dimensions(self):
        pixels = helpers.photo_like(36, 44, seed=2)
        for kind in ('JPEG', 'PNG', 'GIF', 'BMP'):
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, kind)
            self.assertEqual(tuple(classify.image_dimensions(buffer.getvalue(), kind)), (44, 36), kind)
        # An animation: Pillow stores the later frames as the smaller rectangles that changed.
        frames = [Image.fromarray(pixels), Image.fromarray(np.where(np.arange(44)[:, None] < 10, pixels, 0))]
        buffer = io.BytesIO()
        frames[0].save(buffer, 'GIF', save_all=True, append_images=frames[1:], duration=100, loop=0)
        self.assertEqual(tuple(classify.image_dimensions(buffer.getvalue(), 'GIF')), (44, 36))
        self.assertEqual(classify.image_dimensions(gif((8, 8), [(20, 30), (5, 5)]), 'GIF'), (20, 30))
        self.assertEqual(classify.image_dimensions(gif((8, 8), [(20, 30)], extension=False), 'GIF'), (20, 30))
        self.assertIsNone(classify.image_dimensions(b'\xff\xd8\xff' + bytes(20), 'JPEG'))

    def test_a_saved_model_that_cannot_be_loaded_is_one_error_line_and_status_2(self):
        broken = os.path.join(self.root, 'broken_model')
        shutil.copytree(self.saved_model, broken)
        for name in os.listdir(os.path.join(broken, 'variables')):
            os.remove(os.path.join(broken, 'variables', name))
        code, _, err = run_classify(f'--saved_model={broken}', self.good)
        self.assertEqual(code, 2, err)       # an error; 1 is "some files skipped"
        self.assertRegex(err, f'(^|\n)error: --saved_model {broken} cannot be loaded [^\n]*\n$')
        with self.assertRaisesRegex(ValueError, f'^--saved_model {broken} cannot be loaded \\(.*variables.*\\); '
                                    'export it again$'):
            classify.load(broken)


if __name__ == '__main__':
    tf.test.main()
