"""The ImageNet converter on a tiny ImageNet-like tree: labels, odd files, boxes, skips and resume."""

import os
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu.data import labels as labels_lib
from imagenet_tpu.data import record_counts
from imagenet_tpu.data import tfrecord

helpers.use_eight_cpus()

REPO = helpers.REPO
TOOL = os.path.join(REPO, 'tools', 'data', 'imagenet_to_tfrecord.py')
sys.path.insert(0, os.path.dirname(TOOL))
import imagenet_to_tfrecord  # noqa: E402  pylint: disable=wrong-import-position
WNIDS = ('n01440764', 'n01443537', 'n01484850')


def _save(path, array, image_format, mode='RGB'):
    image = Image.fromarray(array).convert(mode)
    image.save(path, image_format, quality=90) if image_format == 'JPEG' else image.save(path, image_format)


def build_tree(root):
    """3 classes x 3 training images (one CMYK JPEG, one PNG named .JPEG, one greyscale JPEG among them),
    4 validation images with a synset label file, a box for one image, and one corrupt file."""
    odd = {}
    for c, wnid in enumerate(WNIDS):
        os.makedirs(os.path.join(root, 'train', wnid))
        for i in range(3):
            path = os.path.join(root, 'train', wnid, f'{wnid}_{i}.JPEG')
            array = helpers.photo_like(40 + 4 * i, 50, seed=10 * c + i)
            if (c, i) == (0, 1):
                _save(path, array, 'JPEG', 'CMYK')
                odd['cmyk'] = path
            elif (c, i) == (1, 2):
                _save(path, array, 'PNG')
                odd['png'] = path
            elif (c, i) == (2, 0):
                _save(path, array, 'JPEG', 'L')
            else:
                _save(path, array, 'JPEG')
    with open(os.path.join(root, 'train', WNIDS[2], 'broken.JPEG'), 'wb') as f:
        f.write(b'\xff\xd8\xff\xe0 not really a jpeg')
    os.makedirs(os.path.join(root, 'validation'))
    truth = [WNIDS[2], WNIDS[0], WNIDS[1], WNIDS[0]]
    for i in range(4):
        _save(os.path.join(root, 'validation', f'ILSVRC2012_val_{i + 1:08d}.JPEG'),
              helpers.photo_like(36, 48, seed=100 + i), 'JPEG')
    with open(os.path.join(root, 'validation_labels.txt'), 'w') as f:
        f.write('\n'.join(truth) + '\n')
    os.makedirs(os.path.join(root, 'bbox', WNIDS[0]))
    with open(os.path.join(root, 'bbox', WNIDS[0], f'{WNIDS[0]}_0.xml'), 'w') as f:
        f.write(BOX_XML)
    with open(os.path.join(root, 'bbox', WNIDS[0], f'{WNIDS[0]}_2.xml'), 'w') as f:
        f.write(BOX_XML[:40])   # cut short: the image is converted without boxes
    return truth, odd


# A box of pixels (5, 4)-(45, 30) on an image of 50x40: relative (ymin, xmin, ymax, xmax) = (0.1, 0.1, 0.75, 0.9).
BOX_XML = ('<annotation><size><width>50</width><height>40</height></size>'
           '<object><bndbox><xmin>5</xmin><ymin>4</ymin><xmax>45</xmax><ymax>30</ymax></bndbox></object>'
           '</annotation>')


def run_tool(raw, out, *extra):
    return subprocess.run(
        [sys.executable, TOOL, f'--raw_dir={raw}', f'--output_dir={out}', '--train_shards=3',
         '--validation_shards=2', '--num_workers=2', f'--validation_labels={raw}/validation_labels.txt',
         f'--bbox_dir={raw}/bbox', *extra], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))


def read_split(out, split):
    records = {}
    for path in sorted(tf.io.gfile.glob(tfrecord.file_pattern(out, split))):
        for serialized in tf.data.TFRecordDataset(path):
            raw = tf.train.Example.FromString(serialized.numpy()).features.feature
            records[raw['image/filename'].bytes_list.value[0].decode()] = (tfrecord.parse_example(serialized), raw)
    return records


class ConverterTest(tf.test.TestCase):

    @pytest.mark.slow
    def test_converts_resumes_and_reports(self):
        raw, out = os.path.join(self.get_temp_dir(), 'raw'), os.path.join(self.get_temp_dir(), 'out')
        truth, odd = build_tree(raw)
        words = os.path.join(raw, 'synset_words.txt')   # ILSVRC's format; the third class has no line
        with open(words, 'w') as f:
            f.write(f'{WNIDS[0]} tench, Tinca tinca\n{WNIDS[1]} goldfish, Carassius auratus\n')
        process = run_tool(raw, out, f'--synset_words={words}')
        self.assertEqual(process.returncode, 0, process.stderr)
        with open(os.path.join(out, 'labels.txt')) as f:
            self.assertEqual(f.read().splitlines(), [f'1\t{WNIDS[0]}\ttench, Tinca tinca',
                                                     f'2\t{WNIDS[1]}\tgoldfish, Carassius auratus',
                                                     f'3\t{WNIDS[2]}\t{WNIDS[2]}'])
        names, ids = labels_lib.class_names(3, 1, data_dir=out)
        self.assertEqual(names, ['tench, Tinca tinca', 'goldfish, Carassius auratus', WNIDS[2]])
        self.assertEqual(ids, list(WNIDS))
        self.assertIn('3 classes, 10 training and 4 validation images', process.stdout)
        self.assertRegex(process.stdout, r'shards \d/5, .* images/s, ETA')
        self.assertIn('skipped unreadable image', process.stdout)
        self.assertIn('broken.JPEG', open(os.path.join(out, 'skipped_images.txt')).read())
        self.assertIn(f'ignored malformed box file: {raw}/bbox/{WNIDS[0]}/{WNIDS[0]}_2.xml (not XML (', process.stdout)
        self.assertIn('done: 13 records in 5 new shards, 2 re-encoded, 1 skipped, 1 malformed box file ignored',
                      process.stdout)
        self.assertNotIn('Traceback', process.stderr)

        train = read_split(out, 'train')
        self.assertLen(train, 9)
        for name, (parsed, raw_feature) in train.items():
            wnid = name.split('_')[0]
            # Labels: sorted wnids, 1-based (tensorflow/tpu's convention).
            self.assertEqual(int(parsed['label']), WNIDS.index(wnid) + 1)
            self.assertEqual(raw_feature['image/class/synset'].bytes_list.value[0].decode(), wnid)
            # Every record decodes with the fused decode-and-crop used in training, CMYK and PNG included.
            image = tf.image.decode_and_crop_jpeg(parsed['encoded'], [0, 0, 8, 8], channels=3)
            self.assertEqual(image.shape, (8, 8, 3))
            height = raw_feature['image/height'].int64_list.value[0]
            self.assertEqual(tf.io.decode_jpeg(parsed['encoded']).shape[0], height)
        # The CMYK and PNG files were re-encoded with their pixels kept (JPEG tolerance).
        for key in ('cmyk', 'png'):
            parsed, _ = train[os.path.basename(odd[key])]
            reference = np.asarray(Image.open(odd[key]).convert('RGB'), np.float32)
            decoded = tf.io.decode_jpeg(parsed['encoded'], channels=3).numpy().astype(np.float32)
            self.assertLess(np.abs(decoded - reference).mean(), 8.0)
        # The box of n01440764_0: pixels (5, 4)-(45, 30) of 50x40 -> relative (ymin, xmin, ymax, xmax).
        self.assertAllClose(train[f'{WNIDS[0]}_0.JPEG'][0]['boxes'], [[0.1, 0.1, 0.75, 0.9]])
        self.assertEqual(train[f'{WNIDS[0]}_2.JPEG'][0]['boxes'].shape[0], 0)

        validation = read_split(out, 'validation')
        labels = [int(validation[f'ILSVRC2012_val_{i + 1:08d}.JPEG'][0]['label']) for i in range(4)]
        self.assertEqual(labels, [WNIDS.index(w) + 1 for w in truth])

        # Resume: complete shards are kept as they are, an interrupted one (no final name) is written again.
        shard = os.path.join(out, tfrecord.shard_name('train', 1, 3))
        kept = os.path.join(out, tfrecord.shard_name('train', 0, 3))
        before = os.stat(kept).st_mtime_ns
        os.remove(shard)
        open(shard + '.incomplete', 'w').close()
        process = run_tool(raw, out)
        self.assertEqual(process.returncode, 0, process.stderr)
        self.assertIn('4 of 5 shards already complete', process.stdout)
        self.assertEqual(os.stat(kept).st_mtime_ns, before)
        self.assertLen(read_split(out, 'train'), 9)
        # The record counts beside the shards: every shard, with the records TensorFlow's reader finds.
        counts = record_counts.read(record_counts.path_in(out))
        shards = sorted(os.path.basename(path) for path in tf.io.gfile.glob(os.path.join(out, '*-of-*')))
        self.assertEqual(sorted(counts), shards)
        for name, (records, size) in counts.items():
            path = os.path.join(out, name)
            self.assertEqual((records, size), (sum(1 for _ in tf.data.TFRecordDataset(path)), os.path.getsize(path)))

    def test_a_malformed_box_file_is_ignored_and_counted(self):
        folder = tempfile.mkdtemp(prefix='boxes-', dir=self.get_temp_dir())
        image = os.path.join(folder, 'n01440764_0.JPEG')
        _save(image, helpers.photo_like(40, 50, seed=1), 'JPEG')
        boxes = {'good': BOX_XML, 'cut_short': BOX_XML[:40], 'empty': '',
                 'no_size': BOX_XML.replace('<width>50</width>', ''),
                 'not_a_number': BOX_XML.replace('<xmax>45</xmax>', '<xmax>forty</xmax>'),
                 'zero_width': BOX_XML.replace('<width>50</width>', '<width>0</width>')}
        for name, content in boxes.items():
            with open(os.path.join(folder, f'{name}.xml'), 'w') as f:
                f.write(content)
        items = [imagenet_to_tfrecord.Item(image, 1, WNIDS[0], os.path.join(folder, f'{name}.xml'))
                 for name in boxes] + [imagenet_to_tfrecord.Item(image, 1, WNIDS[0], os.path.join(folder, 'gone.xml'))]
        shard = os.path.join(folder, tfrecord.shard_name('train', 0, 1))
        path, count, reencoded, skipped, bad_boxes = imagenet_to_tfrecord.write_task(
            imagenet_to_tfrecord.ShardTask(shard, items))
        self.assertEqual((path, count, reencoded, skipped), (shard, 7, [], []))   # every image, boxes or not
        reasons = {os.path.basename(box_file)[:-4]: reason for box_file, reason in bad_boxes}
        self.assertEqual(sorted(reasons), ['cut_short', 'empty', 'gone', 'no_size', 'not_a_number', 'zero_width'])
        self.assertRegex(reasons['cut_short'], r'^not XML \(.*line 1')
        self.assertEqual(reasons['no_size'], '<size/width> is missing, not a number')
        self.assertEqual(reasons['not_a_number'], "<xmax> is 'forty', not a number")
        self.assertEqual(reasons['zero_width'], 'image size 0x40')
        self.assertIn('No such file or directory', reasons['gone'])
        records = [tfrecord.parse_example(serialized) for serialized in tf.data.TFRecordDataset(shard)]
        self.assertAllClose(records[0]['boxes'], [[0.1, 0.1, 0.75, 0.9]])
        self.assertEqual([int(record['boxes'].shape[0]) for record in records[1:]], [0] * 6)
        stats = dict(records=7, reencoded=[], skipped=[], bad_boxes=bad_boxes, shards_written=1)
        self.assertEqual(imagenet_to_tfrecord.summary(stats),
                         'done: 7 records in 1 new shards, 0 re-encoded, 0 skipped, 6 malformed box files ignored')

    def test_bad_tree_is_a_one_line_error(self):
        process = subprocess.run([sys.executable, TOOL, f'--raw_dir={self.get_temp_dir()}/none',
                                  f'--output_dir={self.get_temp_dir()}/out'], capture_output=True, text=True,
                                 timeout=120)
        self.assertNotEqual(process.returncode, 0)
        self.assertNotIn('Traceback', process.stderr)
        self.assertRegex(process.stderr.strip().splitlines()[-1], r'^error: .*train does not exist')


if __name__ == '__main__':
    tf.test.main()
