"""Shared test helpers: 8 logical CPU devices, made once per process; small data written on the fly; a tiny
training configuration; and training the same start under two settings (with and without a strategy, ...).

Logical devices cannot change after TensorFlow initializes, so every test module calls use_eight_cpus() at
import, before any test touches a device. Test modules share code only through this module.
"""

import dataclasses
import os
import tempfile
from typing import Optional

import numpy as np
import tensorflow as tf
import tf_keras as keras

from imagenet_tpu import builders
from imagenet_tpu.config import Config
from imagenet_tpu.data import tfrecord
from imagenet_tpu.distribute import strategy

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


NUM_GOOD_RECORDS = 16


def write_bad_dataset(data_dir: str) -> list:
    """Two train shards and two validation shards with the same content: 16 good records, labels 1..16 (one
    per image, so a label identifies an image), plus 3 bad records in shard 0 (a corrupt JPEG, a truncated JPEG,
    a record without image/encoded) and shard 1 cut mid-record. Returns the good labels."""
    os.makedirs(data_dir, exist_ok=True)
    good = [tfrecord.make_example(tf.io.encode_jpeg(photo_like(20, 24, i)).numpy(), i + 1, 20, 24)
            for i in range(NUM_GOOD_RECORDS)]
    jpeg = good[0].features.feature[tfrecord.ENCODED].bytes_list.value[0]
    corrupt = tfrecord.make_example(b'\xff\xd8' + b'garbage' * 50, 1, 20, 24)
    truncated = tfrecord.make_example(jpeg[:len(jpeg) // 2], 1, 20, 24)
    missing = tf.train.Example()
    missing.features.feature[tfrecord.LABEL].int64_list.value.append(1)   # no image/encoded
    for split in (tfrecord.TRAIN, tfrecord.VALIDATION):
        first = os.path.join(data_dir, tfrecord.shard_name(split, 0, 2))
        tfrecord.write_shard(first, good[:5] + [corrupt] + good[5:8] + [truncated, missing])
        second = os.path.join(data_dir, tfrecord.shard_name(split, 1, 2))
        # Shard 1: records 8..15 and a 9th whose bytes are cut in the middle.
        tfrecord.write_shard(second, good[8:] + [good[0]])
        with open(second, 'rb') as f:
            content = f.read()
        with open(second, 'wb') as f:
            f.write(content[:-200])
    return list(range(1, NUM_GOOD_RECORDS + 1))


def pixels(rng: np.random.Generator, shape) -> np.ndarray:
    """Random float32 images on the pixel scale the network expects (0..255 around ImageNet's mean): after
    its first layer (resnet.Standardize) they are about N(0, 1)."""
    return (117.0 + 58.0 * rng.normal(size=shape)).astype(np.float32)


def small_run_flags(**overrides) -> list:
    """Command-line flags of the tests' small runs: ResNet-10 on 16x16 images of 4 classes, 48 training and 20
    held-out images, batch 16. ``overrides`` (flag name=value) replace or add flags; True and False give
    --name and --noname."""
    settings = dict(depth=10, image_size=16, num_classes=4, num_train_images=48, num_eval_images=20,
                    global_batch_size=16, eval_batch_size=16)
    settings.update(overrides)
    return [(f'--{name}' if value else f'--no{name}') if isinstance(value, bool) else f'--{name}={value}'
            for name, value in settings.items()]


def tiny_config(**overrides) -> Config:
    """The tests' small training setting: ResNet-10 without normalization layers on 16x16 images of 10 classes,
    global batch 16, 48 training images (3 steps an epoch) and 20 held-out ones, cosine decay from 0.4 without
    warm-up, weight decay 1e-3, label smoothing 0.1, and with --strategy=cpu 2 replicas (each replica's copy of the
    step is traced, so 8 would trace 4x as much for nothing these tests look at; tests of more replicas pass their
    own strategy). ``overrides``: any Config fields, applied with dataclasses.replace (so they are validated as
    Config(...) would)."""
    base = Config(depth=10, norm='none', num_classes=10, image_size=16, global_batch_size=16, eval_batch_size=16,
                  num_train_images=48, num_eval_images=20, base_learning_rate=0.4, warmup_epochs=0,
                  lr_decay='cosine', train_epochs=1, weight_decay=1e-3, label_smoothing=0.1, momentum=0.9,
                  num_cpu_devices=2)
    return dataclasses.replace(base, **overrides)


def equivalence_batches(steps: int = 3, batch: int = 16, size: int = 16, classes: int = 10, seed: int = 0):
    """A fixed dataset of ``steps`` batches of random images and labels, for with/without-strategy tests."""
    rng = np.random.default_rng(seed)
    images = pixels(rng, (steps * batch, size, size, 3))
    labels = rng.integers(0, classes, size=steps * batch).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch)


def train_from(config, initial_weights, strategy, dataset, steps: int = 3) -> list:
    """Builds a classifier under ``strategy``, sets ``initial_weights``, trains ``steps`` steps of ``dataset``
    with model.fit and returns the network's weights.

    ``config``: a Config (the classifier is builders.build_classifier(config)) or a callable returning a compiled
    classifier_lib.Classifier; either is used inside ``strategy.scope()``."""
    with strategy.scope():
        classifier = config() if callable(config) else builders.build_classifier(config)
        classifier.network.set_weights(initial_weights)
    classifier.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    return classifier.network.get_weights()


def train_same_start(runs, *, steps: int = 3, dataset=None, initial=None) -> tuple:
    """Trains every run of ``runs``, (config, strategy) pairs, ``steps`` steps of the same batches from the
    same weights; returns (initial weights, [the network's weights after each run]).

    A run's config is a Config or a callable returning a compiled Classifier (see train_from). ``initial``:
    the starting weights, by default those of the first run's network (a Config) built with Keras seed 0.
    ``dataset``: by default equivalence_batches(steps)."""
    dataset = dataset if dataset is not None else equivalence_batches(steps)
    if initial is None:
        keras.utils.set_random_seed(0)
        initial = builders.build_network(runs[0][0]).get_weights()
    return initial, [train_from(config, initial, strategy, dataset, steps) for config, strategy in runs]


def assert_same_training(test, reference: list, other: list, initial: list, *, atol: float, rtol: float,
                         min_change: float = 1e-3, max_update_error: Optional[float] = None, msg: str = '') -> None:
    """Asserts that the reference run's training moved some weight by more than ``min_change`` away from
    ``initial`` (so that two runs which did nothing cannot pass as equal), and that ``other`` ends with the
    reference's weights, each within ``atol`` + ``rtol`` x |reference| (test.assertAllClose).

    ``max_update_error``: when set, also the change of each weight array, other - initial, must be the
    reference's within this relative error (norm of the difference / norm of the reference's change), for
    tolerances too wide to tell a run that trained from one that did not."""
    moved = max(float(np.abs(w - w0).max()) for w, w0 in zip(reference, initial))
    test.assertGreater(moved, min_change, f'training did not change the weights {msg}')
    test.assertLen(other, len(reference))
    for index, (a, b, w0) in enumerate(zip(reference, other, initial)):
        test.assertAllClose(a, b, atol=atol, rtol=rtol, msg=f'weight {index} {msg}')
        change = np.linalg.norm(a - w0)
        if max_update_error is not None and change > 0:
            test.assertLess(np.linalg.norm((b - w0) - (a - w0)) / change, max_update_error,
                            f'change of weight {index} {msg}')


def numpy_batch_norm(x, upstream, gamma, beta, epsilon):
    """Output, input gradient of sum(y * upstream), batch mean and (biased) variance over axes 0..2."""
    axes = (0, 1, 2)
    n = np.prod([x.shape[a] for a in axes])
    mean, variance = x.mean(axes), x.var(axes)
    normalized = (x - mean) / np.sqrt(variance + epsilon)
    y = gamma * normalized + beta
    dnormalized = upstream * gamma
    dx = (dnormalized - dnormalized.sum(axes) / n - normalized * (dnormalized * normalized).sum(axes) / n)
    return y, dx / np.sqrt(variance + epsilon), mean, variance


def run_layer(layer, x, upstream, strategy):
    """One training-mode call on each replica: (outputs, input gradients, local moving mean, moving variance)."""
    distributed = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.constant(x[ctx.replica_id_in_sync_group]), tf.constant(upstream[ctx.replica_id_in_sync_group])))

    @tf.function
    def step(inputs):
        def replica_fn(batch, weights):
            with tf.GradientTape() as tape:
                tape.watch(batch)
                y = layer(batch, training=True)
                loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
            return y, tape.gradient(loss, batch)
        return strategy.run(replica_fn, args=inputs)

    y, dx = step(distributed)
    local = lambda v: np.stack([np.asarray(t, np.float32) for t in strategy.experimental_local_results(v)])
    return local(y), local(dx), local(layer.moving_mean), local(layer.moving_variance)
