"""Shared test helper: 8 logical CPU devices, made once per process, and small data written on the fly.

Logical devices cannot change after TensorFlow initializes, so every test module calls use_eight_cpus() at
import, before any test touches a device.
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

from imagenet_tpu import strategy, tfrecord

NUM_DEVICES = 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_eight_cpus() -> None:
    strategy.use_logical_cpus(NUM_DEVICES)


def mirrored(replicas: int = NUM_DEVICES, collective_ops: bool = False) -> tf.distribute.MirroredStrategy:
    """The --strategy=cpu strategy over ``replicas`` logical devices (reductions on one device), or with
    ``collective_ops`` TensorFlow's default for CPU devices: ring collectives, as MultiWorkerMirroredStrategy uses."""
    if not collective_ops:
        return strategy.cpu_strategy(replicas)
    devices = [device.name for device in tf.config.list_logical_devices('CPU')][:replicas]
    return strategy.mirrored_strategy(devices)


def subprocess_environment(**extra) -> dict:
    """Environment for a child process running this checkout's package and tools (quiet TensorFlow)."""
    return {**os.environ, 'PYTHONPATH': REPO, 'TF_CPP_MIN_LOG_LEVEL': '3', **extra}


def class_folder(test_class) -> str:
    """A new folder for one test class's files, with the small dataset written in its 'data' subfolder.

    tf.test's temporary folder is shared by every test in the process, so classes that write runs under fixed
    names (model_dir 'killed', ...) need folders of their own."""
    root = tempfile.mkdtemp(prefix=f'{test_class.__name__}-', dir=tf.compat.v1.test.get_temp_dir())
    write_dataset(os.path.join(root, 'data'))
    return root


def checkpoint_variables(directory: str) -> dict:
    """Every variable of the latest checkpoint in ``directory``, by name (network, optimizer, step)."""
    reader = tf.train.load_checkpoint(directory)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith('_CHECKPOINTABLE_OBJECT_GRAPH')}


def latest_checkpoint_step(directory: str) -> int:
    """The step of the latest ckpt-STEP in ``directory``; 0 when there is none."""
    path = tf.train.latest_checkpoint(directory)
    return int(path.rsplit('-', 1)[1]) if path else 0


def photo_like(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth uint8 RGB image with structure (gradients and blobs), not flat and not noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(3, max(height, width))
        channels.append(127 + 100 * np.cos(((y - cy) ** 2 + (x - cx) ** 2) ** 0.5 / r * np.pi))
    return np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)


def write_dataset(data_dir: str, num_train: int = 48, num_validation: int = 20, num_classes: int = 4,
                  size: int = 24, train_shards: int = 4, validation_shards: int = 2, label_offset: int = 1) -> dict:
    """Writes ImageNet-format shards of photo-like JPEGs; returns {split: (images uint8, disk labels)}."""
    os.makedirs(data_dir, exist_ok=True)
    written = {}
    for split, count, shards, seed in ((tfrecord.TRAIN, num_train, train_shards, 0),
                                       (tfrecord.VALIDATION, num_validation, validation_shards, 1000)):
        images = np.stack([photo_like(size, size + 4, seed + i) for i in range(count)])
        labels = np.arange(count) % num_classes + label_offset
        for shard in range(shards):
            examples = [tfrecord.make_example(tf.io.encode_jpeg(images[i], quality=95).numpy(), int(labels[i]),
                                              size, size + 4, filename=f'{split}_{i}.JPEG')
                        for i in range(shard, count, shards)]
            tfrecord.write_shard(os.path.join(data_dir, tfrecord.shard_name(split, shard, shards)), examples)
        written[split] = (images, labels)
    return written


def pixels(rng: np.random.Generator, shape) -> np.ndarray:
    """Random float32 images on the pixel scale the network expects (0..255 around ImageNet's mean): after
    its first layer (resnet.Standardize) they are about N(0, 1)."""
    return (117.0 + 58.0 * rng.normal(size=shape)).astype(np.float32)


def equivalence_batches(steps: int = 3, batch: int = 16, size: int = 16, classes: int = 10, seed: int = 0):
    """A fixed dataset of ``steps`` batches of random images and labels, for with/without-strategy tests."""
    rng = np.random.default_rng(seed)
    images = pixels(rng, (steps * batch, size, size, 3))
    labels = rng.integers(0, classes, size=steps * batch).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch)


def train_from(config, initial_weights, strategy, dataset, steps: int = 3) -> list:
    """Builds config's classifier under ``strategy``, sets ``initial_weights``, trains ``steps`` steps of
    ``dataset`` with model.fit and returns the network's weights."""
    from imagenet_tpu import train
    with strategy.scope():
        classifier = train.build_classifier(config)
        classifier.network.set_weights(initial_weights)
    classifier.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    return classifier.network.get_weights()
