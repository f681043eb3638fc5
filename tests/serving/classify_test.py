"""The classify command, in a real process: files, directories and patterns in; top-5 names and probabilities
out (text or JSON lines), equal to the SavedModel's own outputs; unreadable and non-image files skipped with a
line each, never a traceback."""

import io
import json
import os
import subprocess
import sys
import tempfile

import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.serving import classify
from imagenet_tpu.serving import export
from imagenet_tpu import train

NAMES = ['cat', 'dog', 'fish', 'bird']


def run_classify(*args):
    process = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.classify', *args], cwd=helpers.REPO,
                             env=helpers.subprocess_environment(), capture_output=True, text=True, timeout=300)
    return process.returncode, process.stdout, process.stderr


class ClassifyTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='classify-', dir=tf.compat.v1.test.get_temp_dir())
        config = helpers.tiny_config(norm='batch_norm', num_classes=4, image_size=32)
        keras.utils.set_random_seed(2)
        cls.saved_model = os.path.join(cls.root, 'saved_model')
        export.export_saved_model(train.build_network(config), cls.saved_model, NAMES,
                                  **train.export_settings(config))
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


if __name__ == '__main__':
    tf.test.main()
