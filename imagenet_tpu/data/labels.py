"""Class names: the labels file written beside the shards, and the model classes' names read from it.

``labels.txt`` has one line per class, tab-separated: the on-disk label (the record's image/class/label), the
synset id (ImageNet's wnid, or any short id) and a human-readable name. The converter writes it (with names from
ILSVRC's synset_words.txt when given, else the wnid), the demo data writes the digit names. Model class c is the
on-disk label c + label_offset, as in training; a class the file does not name is called by its id. In a
tensorflow_datasets folder without labels.txt, its class-name file (``label.labels.txt``: one name per line, TFDS
label 0 first) names the classes, each line l being on-disk label l + 1 (tfrecord.py).
"""

import os
from typing import Iterable, List, NamedTuple, Optional, Tuple

import tensorflow as tf

from imagenet_tpu.data import tfrecord
from imagenet_tpu.errors import DataError

FILE_NAME = 'labels.txt'


class Label(NamedTuple):
    label: int      # on-disk label
    synset: str
    name: str


def path_in(data_dir: str) -> str:
    return os.path.join(data_dir, FILE_NAME)


def format_lines(labels: Iterable[Label]) -> str:
    """The text of a labels.txt (tabs and new lines inside a name become spaces)."""
    return ''.join(f'{int(label.label)}\t{label.synset}\t{" ".join(str(label.name).split())}\n' for label in labels)


def write(path: str, labels: Iterable[Label]) -> None:
    import tensorflow as tf   # here, not at the top: the converter's main process runs without TensorFlow
    with tf.io.gfile.GFile(path, 'w') as f:
        f.write(format_lines(labels))


def read(path: str) -> List[Label]:
    """The rows of a labels.txt; DataError naming the line when one is malformed."""
    import tensorflow as tf
    labels = []
    with tf.io.gfile.GFile(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.rstrip('\n').split('\t')
            try:
                labels.append(Label(int(fields[0]), fields[1], fields[2] if len(fields) > 2 else fields[1]))
            except (ValueError, IndexError):
                raise DataError(f'{path} line {number} is not "label<TAB>id<TAB>name": {line.strip()!r}') from None
    return labels


def synset_words(path: str) -> dict:
    """{wnid: name} from ILSVRC's synset_words.txt ("n01440764 tench, Tinca tinca" per line)."""
    names = {}
    with open(path) as f:
        for line in f:
            wnid, _, name = line.strip().partition(' ')
            if wnid:
                names[wnid] = name.strip() or wnid
    return names


def _tfds_labels(data_dir: str) -> List[Label]:
    """The labels of a tensorflow_datasets folder's class-name file, as on-disk labels (TFDS label + 1)."""
    path = tfrecord.layout_of(data_dir).class_names_path(data_dir)
    if not path or not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        names = [line.strip() for line in f if line.strip()]
    return [Label(index + 1, name, name) for index, name in enumerate(names)]


def class_names(num_classes: int, label_offset: int, data_dir: Optional[str] = None,
                path: Optional[str] = None) -> Tuple[List[str], List[str]]:
    """(names, ids) of model classes 0..num_classes-1 from labels.txt (``path``, or the one in ``data_dir``, else a
    tensorflow_datasets folder's class-name file);
    without a file every class is called 'class C'."""
    import tensorflow as tf
    path = path or (path_in(data_dir) if data_dir else None)
    by_label = {}
    if path and tf.io.gfile.exists(path):
        by_label = {label.label: label for label in read(path)}
    if not by_label and data_dir:
        by_label = {label.label: label for label in _tfds_labels(data_dir)}
    names, ids = [], []
    for model_class in range(num_classes):
        label = by_label.get(model_class + label_offset)
        names.append(label.name if label else f'class {model_class}')
        ids.append(label.synset if label else str(model_class))
    return names, ids
