"""Converts the standard ImageNet layout into TFRecord shards in imagenet_tpu's schema (that of tensorflow/tpu's
imagenet_to_gcs, so either tool's shards work with both).

Input (--raw_dir):
    train/<wnid>/*.JPEG                 1000 class folders
    validation/*.JPEG (or val/)         50,000 images, labelled by --validation_labels: one wnid per line in
                                        sorted file-name order (tensorflow/tpu's
                                        imagenet_2012_validation_synset_labels.txt), or lines "<file name> <wnid>";
                                        or validation/<wnid>/*.JPEG like train/, with no label file
    --bbox_dir (optional)               ILSVRC bounding-box XML files (<image stem>.xml, any folder depth)
Output (--output_dir): train-00000-of-01024 ... and validation-00000-of-00128 ..., labels.txt (on-disk
label, wnid, name: --synset_words gives ILSVRC's names, else the wnid is the name) and record_counts.txt (each
shard's records and bytes, which lets a resumed training run find its place without reading the data).

Labels are 1..1000 on disk: the wnids sorted, the first is 1. The known odd files (one PNG and 22 CMYK JPEGs in
the training set) are re-encoded as RGB JPEG; an image that cannot be read at all is skipped and listed at the
end. A bounding-box file that is not ILSVRC XML (cut short, no image size, ...) is ignored, its image written
without boxes, and counted at the end. Each shard is written under a temporary name and renamed when complete,
so re-running an interrupted conversion skips the shards already done.

    python tools/data/imagenet_to_tfrecord.py --raw_dir /data/imagenet --output_dir /data/imagenet-tfrecord \
        --validation_labels imagenet_2012_validation_synset_labels.txt --bbox_dir /data/imagenet/bbox
"""

import io
import multiprocessing
import os
import random
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import List, NamedTuple, Optional

IMAGE_EXTENSIONS = ('.jpeg', '.jpg', '.png')


class Item(NamedTuple):
    path: str
    label: int           # on-disk label, 1-based
    synset: str
    bbox_xml: Optional[str]


class ShardTask(NamedTuple):
    path: str
    items: List[Item]


class ConversionError(Exception):
    """A problem with the input tree; printed as one line."""


def _images_in(folder: str) -> List[str]:
    return sorted(name for name in os.listdir(folder) if name.lower().endswith(IMAGE_EXTENSIONS))


def index_boxes(bbox_dir: Optional[str]) -> dict:
    """{image stem: xml path} for every XML file under bbox_dir."""
    boxes = {}
    if bbox_dir:
        for folder, _, names in os.walk(bbox_dir):
            for name in names:
                if name.endswith('.xml'):
                    boxes[name[:-4]] = os.path.join(folder, name)
    return boxes


def find_train(raw_dir: str, boxes: dict):
    """(items, wnids): every training image with its 1-based label from the sorted wnids."""
    train_dir = os.path.join(raw_dir, 'train')
    if not os.path.isdir(train_dir):
        raise ConversionError(f'{train_dir} does not exist (expected train/<wnid>/*.JPEG)')
    wnids = sorted(name for name in os.listdir(train_dir) if os.path.isdir(os.path.join(train_dir, name)))
    if not wnids:
        raise ConversionError(f'{train_dir} has no class folders')
    items = []
    for label, wnid in enumerate(wnids, start=1):
        for name in _images_in(os.path.join(train_dir, wnid)):
            items.append(Item(os.path.join(train_dir, wnid, name), label, wnid,
                              boxes.get(os.path.splitext(name)[0])))
    return items, wnids


def find_validation(raw_dir: str, wnids: List[str], labels_file: Optional[str], boxes: dict) -> List[Item]:
    folder = next((os.path.join(raw_dir, name) for name in ('validation', 'val')
                   if os.path.isdir(os.path.join(raw_dir, name))), None)
    if folder is None:
        raise ConversionError(f'{raw_dir} has neither validation/ nor val/')
    label_of = {wnid: label for label, wnid in enumerate(wnids, start=1)}
    class_folders = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
    if class_folders and not labels_file:
        pairs = [(os.path.join(folder, wnid, name), wnid) for wnid in class_folders
                 for name in _images_in(os.path.join(folder, wnid))]
    else:
        if not labels_file:
            raise ConversionError('--validation_labels is required when validation/ has no class folders')
        names = _images_in(folder)
        with open(labels_file) as f:
            lines = [line.split() for line in f if line.strip()]
        if all(len(line) == 2 for line in lines):
            wnid_of = {name: wnid for name, wnid in lines}
            missing = [name for name in names if name not in wnid_of]
            if missing:
                raise ConversionError(f'{labels_file} has no label for {len(missing)} images, e.g. {missing[0]}')
            pairs = [(os.path.join(folder, name), wnid_of[name]) for name in names]
        else:
            if len(lines) != len(names):
                raise ConversionError(f'{labels_file} has {len(lines)} labels but {folder} has {len(names)} images')
            pairs = [(os.path.join(folder, name), line[0]) for name, line in zip(names, lines)]
    unknown = sorted({wnid for _, wnid in pairs if wnid not in label_of})
    if unknown:
        raise ConversionError(f'validation wnids not among the training classes: {", ".join(unknown[:5])}')
    return [Item(path, label_of[wnid], wnid, boxes.get(os.path.splitext(os.path.basename(path))[0]))
            for path, wnid in pairs]


def read_boxes(xml_path: Optional[str]) -> list:
    """Boxes of an ILSVRC XML file as relative (xmin, ymin, xmax, ymax), clipped to [0, 1]; [] when absent.
    ValueError, in one line, for a file that is not such XML (cut short, no image size, a coordinate that is no
    number); OSError for one that cannot be read."""
    if not xml_path:
        return []
    try:
        root = ElementTree.parse(xml_path).getroot()
    except ElementTree.ParseError as error:
        raise ValueError(f'not XML ({error})') from None

    def number(element, key: str) -> float:
        text = element.findtext(key)
        try:
            return float(text)
        except (TypeError, ValueError):
            raise ValueError(f'<{key}> is {"missing" if text is None else repr(text)}, not a number') from None

    width, height = number(root, 'size/width'), number(root, 'size/height')
    if width <= 0 or height <= 0:
        raise ValueError(f'image size {width:g}x{height:g}')
    boxes = []
    for box in root.iter('bndbox'):
        xmin, ymin, xmax, ymax = (number(box, key) for key in ('xmin', 'ymin', 'xmax', 'ymax'))
        xmin, xmax = max(0.0, xmin / width), min(1.0, xmax / width)
        ymin, ymax = max(0.0, ymin / height), min(1.0, ymax / height)
        if xmin < xmax and ymin < ymax:
            boxes.append((xmin, ymin, xmax, ymax))
    return boxes


def load_jpeg(path: str):
    """(RGB or greyscale JPEG bytes, height, width, re-encoded?). PNGs and CMYK JPEGs are re-encoded, since
    tf.image.decode_and_crop_jpeg reads neither."""
    from PIL import Image
    with open(path, 'rb') as f:
        data = f.read()
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # decodes fully: raises on truncated or corrupt files
        width, height = image.size
        if image.format == 'JPEG' and image.mode in ('RGB', 'L'):
            return data, height, width, False
        output = io.BytesIO()
        image.convert('RGB').save(output, 'JPEG', quality=95)
        return output.getvalue(), height, width, True


def write_task(task: ShardTask):
    """Worker: encodes one shard. Returns (path, records written, re-encoded paths, [(path, reason) skipped],
    [(box file, reason) of malformed box files]: their images are written without boxes)."""
    from imagenet_tpu import runtime
    runtime.import_tensorflow()   # a quiet start in each worker process (no CUDA-probe line without a GPU)
    from imagenet_tpu.data import tfrecord
    reencoded, skipped, bad_boxes = [], [], []

    def examples():
        for item in task.items:
            try:
                encoded, height, width, converted = load_jpeg(item.path)
            except Exception as error:  # pylint: disable=broad-except  (any undecodable file is skipped, listed)
                skipped.append((item.path, f'{type(error).__name__}: {error}'))
                continue
            if converted:
                reencoded.append(item.path)
            try:
                boxes = read_boxes(item.bbox_xml)
            except (ValueError, OSError) as error:
                bad_boxes.append((item.bbox_xml, str(error)))
                boxes = []
            yield tfrecord.make_example(encoded, item.label, height, width, synset=item.synset,
                                        filename=os.path.basename(item.path),
                                        boxes=[tfrecord.Box(*b) for b in boxes])

    count = tfrecord.write_shard(task.path, examples())
    return task.path, count, reencoded, skipped, bad_boxes


def make_tasks(output_dir: str, split: str, items: List[Item], num_shards: int) -> List[ShardTask]:
    from imagenet_tpu import runtime
    runtime.import_tensorflow()
    from imagenet_tpu.data import tfrecord
    return [ShardTask(os.path.join(output_dir, tfrecord.shard_name(split, index, num_shards)),
                      items[index * len(items) // num_shards:(index + 1) * len(items) // num_shards])
            for index in range(num_shards)]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else f'{seconds // 60}m{seconds % 60:02d}s'


def write_labels(output_dir: str, wnids: List[str], synset_words: Optional[str] = None) -> str:
    """labels.txt beside the shards: on-disk label, wnid and name (from synset_words.txt, else the wnid)."""
    from imagenet_tpu.data import labels
    names = labels.synset_words(synset_words) if synset_words else {}
    path = labels.path_in(output_dir)
    with open(path, 'w') as f:
        f.write(labels.format_lines(labels.Label(label, wnid, names.get(wnid, wnid))
                                    for label, wnid in enumerate(wnids, start=1)))
    return path


def convert(raw_dir: str, output_dir: str, *, validation_labels: Optional[str] = None,
            bbox_dir: Optional[str] = None, train_shards: int = 1024, validation_shards: int = 128,
            num_workers: int = 1, seed: int = 0, synset_words: Optional[str] = None, print_fn=print) -> dict:
    """Writes all missing shards, labels.txt and record_counts.txt (record_counts.py); returns counts: records,
    reencoded, skipped (list of (path, reason)), bad_boxes (list of (box file, reason): malformed box files, whose
    images are written without boxes), shards_written, shards_skipped."""
    boxes = index_boxes(bbox_dir)
    train_items, wnids = find_train(raw_dir, boxes)
    validation_items = find_validation(raw_dir, wnids, validation_labels, boxes)
    random.Random(seed).shuffle(train_items)  # mixes classes within each shard; fixed, so a resume matches
    os.makedirs(output_dir, exist_ok=True)
    write_labels(output_dir, wnids, synset_words)
    tasks = (make_tasks(output_dir, 'train', train_items, train_shards)
             + make_tasks(output_dir, 'validation', validation_items, validation_shards))
    todo = [task for task in tasks if not os.path.exists(task.path)]
    print_fn(f'{len(wnids)} classes, {len(train_items)} training and {len(validation_items)} validation images; '
             f'{len(tasks) - len(todo)} of {len(tasks)} shards already complete')
    stats = dict(records=0, reencoded=[], skipped=[], bad_boxes=[], shards_written=0,
                 shards_skipped=len(tasks) - len(todo))
    total_images = sum(len(task.items) for task in todo)
    started, images_done, written = time.perf_counter(), 0, {}
    context = multiprocessing.get_context('spawn')  # TensorFlow does not survive fork
    with context.Pool(max(1, num_workers)) as pool:
        for path, count, reencoded, skipped, bad_boxes in pool.imap_unordered(write_task, todo):
            stats['records'] += count
            stats['reencoded'] += reencoded
            stats['skipped'] += skipped
            stats['bad_boxes'] += bad_boxes
            stats['shards_written'] += 1
            written[path] = count
            images_done += count + len(skipped)
            rate = images_done / (time.perf_counter() - started)
            eta = (total_images - images_done) / max(rate, 1e-9)
            print_fn(f'shards {stats["shards_written"]}/{len(todo)}, {images_done:,} images, {rate:,.0f} images/s, '
                     f'ETA {_duration(eta)}  ({os.path.basename(path)})')
    for path in stats['reencoded']:
        print_fn(f're-encoded as RGB JPEG: {path}')
    if stats['skipped']:
        # Kept beside the shards, so the loss is still on record after a later resumed run.
        with open(os.path.join(output_dir, 'skipped_images.txt'), 'a') as log:
            for path, reason in stats['skipped']:
                print_fn(f'skipped unreadable image: {path} ({reason})')
                log.write(f'{path}\t{reason}\n')
    for path, reason in stats['bad_boxes']:
        print_fn(f'ignored malformed box file: {path} ({reason}); its image has no boxes')
    from imagenet_tpu.data import record_counts
    record_counts.write_beside(output_dir, written)
    print_fn(summary(stats))
    return stats


def summary(stats: dict) -> str:
    """The last line of a conversion: records and shards written, images re-encoded and skipped, box files
    ignored."""
    return (f'done: {stats["records"]:,} records in {stats["shards_written"]} new shards, '
            f'{len(stats["reencoded"])} re-encoded, {len(stats["skipped"])} skipped, '
            f'{len(stats["bad_boxes"])} malformed box file{"s" if len(stats["bad_boxes"]) != 1 else ""} ignored')


def main(argv):
    if len(argv) > 1:
        sys.exit(f'error: unexpected arguments: {" ".join(argv[1:])}')
    if not _RAW_DIR.value or not _OUTPUT_DIR.value:
        sys.exit('error: --raw_dir and --output_dir are required')
    try:
        convert(_RAW_DIR.value, _OUTPUT_DIR.value, validation_labels=_VALIDATION_LABELS.value,
                        bbox_dir=_BBOX_DIR.value, train_shards=_TRAIN_SHARDS.value,
                        validation_shards=_VALIDATION_SHARDS.value, num_workers=_NUM_WORKERS.value,
                        seed=_SEED.value, synset_words=_SYNSET_WORDS.value)
    except (ConversionError, OSError) as error:
        sys.exit(f'error: {error}')


if __name__ == '__main__':
    # Flags only when run as a script: the tests import this module beside the training flags (--seed, ...).
    from absl import app, flags
    _RAW_DIR = flags.DEFINE_string('raw_dir', None, 'ImageNet root holding train/ and validation/ (or val/).')
    _OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where the TFRecord shards are written.')
    _VALIDATION_LABELS = flags.DEFINE_string('validation_labels', None,
                                             'Validation ground truth: one wnid per line in sorted file order, or '
                                             '"<file> <wnid>" lines. Not needed when validation/ has class folders.')
    _BBOX_DIR = flags.DEFINE_string('bbox_dir', None, 'Folder of ILSVRC bounding-box XML files (optional).')
    _TRAIN_SHARDS = flags.DEFINE_integer('train_shards', 1024, 'Training shards (tensorflow/tpu: 1024).')
    _VALIDATION_SHARDS = flags.DEFINE_integer('validation_shards', 128, 'Validation shards (tensorflow/tpu: 128).')
    _NUM_WORKERS = flags.DEFINE_integer('num_workers', os.cpu_count(), 'Processes encoding shards in parallel.')
    _SEED = flags.DEFINE_integer('seed', 0, 'Seed of the order of training images across shards.')
    _SYNSET_WORDS = flags.DEFINE_string('synset_words', None, "ILSVRC's synset_words.txt ('n01440764 tench, Tinca "
                                        "tinca' per line): the class names written to labels.txt (else the wnids).")
    app.run(main)
