"""Images/s of a training input pipeline alone (no model), on the given TFRecords.

    python tools/benchmarks/benchmark_input.py --data_dir data/benchmark --pipeline ours --batch_size 64 \
        --image_size 224 --num_images 2000 --threads 2
    python tools/benchmarks/benchmark_input.py --data_dir data/benchmark --pipeline all --threads 1,2

Pipelines, each reading the same files with the same interleave, shuffle, batch and tf.data options:
  ours   imagenet_tpu.data.input_pipeline.train_dataset: decode fused with the random crop, bad records counted.
  naive  decodes the whole JPEG, then crops the same random window, flips and resizes (pixels out, as ours).
  tfm    tf-models-official's classification parser (official.vision.dataloaders.classification_input) with
         the same crop range, output size, flip and float32 output (needs tf-models-official; see BUILD.md).
         It also standardizes the pixels, which ours leaves to the network's first layer on the accelerator.
Each measurement is a fresh iterator (after 4 untimed batches), so no idle pipeline works in the background.
With one pipeline and one thread count, the last line printed is one JSON object {"pipeline", "images_per_second",
"threads", "num_images"}; with several, they run alternately (A B C, then C B A, ...: step_timing.round_order) for
--rounds rounds, each figure is the median over rounds, and the last line is a JSON object with every figure, the
ratios to ours, and under "round_by_round" the medians of the same ratios taken within each round.
--epochs E instead reads E passes over --num_images images and prints images/s and memory after each.
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from imagenet_tpu import runtime  # noqa: E402  (before TensorFlow: the package's oneDNN setting)

tf = runtime.import_tensorflow()
import step_timing  # noqa: E402  (this folder: the benchmarks' round order)
from imagenet_tpu.data import input_pipeline
from imagenet_tpu.data import preprocessing
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord  # noqa: E402
from imagenet_tpu.config import Config  # noqa: E402
from imagenet_tpu.training.callbacks import resident_memory_mb  # noqa: E402

PIPELINES = ('ours', 'naive', 'tfm')


def make_config(data_dir: str, batch_size: int, image_size: int, threads: int) -> Config:
    return Config(data_dir=data_dir, global_batch_size=batch_size, image_size=image_size, input_threads=threads,
                  num_classes=1000, label_offset=1, shuffle_buffer=1024, seed=0)


def _plain_records(config: Config) -> tf.data.Dataset:
    """The peers' reader: our interleave (record_io.read_records) without the bad-record accounting of
    bad_records='skip', repeated, then the same shuffle."""
    paths = record_io.list_shards(config.data_dir, tfrecord.TRAIN)
    records = record_io.read_records(paths, record_io.file_sizes(paths), deterministic=False, fatal_errors=True,
                                     cycle_length=min(config.interleave_cycle_length, len(paths)),
                                     buffer_bytes=int(config.read_buffer_mb * 2 ** 20))
    return records.repeat().shuffle(config.shuffle_buffer, seed=0)


def _batched(examples: tf.data.Dataset, config: Config) -> tf.data.Dataset:
    batches = examples.batch(config.global_batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return batches.with_options(input_pipeline.dataset_options(False, config.input_threads))


def naive_dataset(config: Config) -> tf.data.Dataset:
    """Whole-image decode, then the same random-resized crop in pixels."""
    def parse(record):
        example = tfrecord.parse_example(record)
        image = tf.io.decode_jpeg(example['encoded'], channels=3, dct_method=preprocessing.DCT_METHOD)
        window = preprocessing.sample_crop_window(tf.shape(image), example['boxes'],
                                                  min_area=config.random_crop_min_area)
        image = image[window[0]:window[0] + window[2], window[1]:window[1] + window[3]]
        image = tf.image.random_flip_left_right(image)
        image = tf.image.resize(image, [config.image_size, config.image_size])
        return image, example['label'] - config.label_offset

    return _batched(_plain_records(config).map(parse, num_parallel_calls=tf.data.AUTOTUNE), config)


def tfm_dataset(config: Config) -> tf.data.Dataset:
    """tf-models-official's ImageNet training parser, configured like ours."""
    from official.vision.dataloaders import classification_input  # pylint: disable=import-outside-toplevel
    decoder = classification_input.Decoder()
    parser = classification_input.Parser(
        output_size=[config.image_size, config.image_size], num_classes=config.num_classes,
        decode_jpeg_only=True, aug_rand_hflip=True, aug_crop=True, dtype='float32',
        crop_area_range=(config.random_crop_min_area, 1.0))
    parse = parser.parse_fn(is_training=True)
    return _batched(_plain_records(config).map(lambda record: parse(decoder.decode(record)),
                                               num_parallel_calls=tf.data.AUTOTUNE), config)


def build(pipeline: str, config: Config) -> tf.data.Dataset:
    if pipeline == 'ours':
        return input_pipeline.train_dataset(config)
    if pipeline == 'naive':
        return naive_dataset(config)
    if pipeline == 'tfm':
        return tfm_dataset(config)
    raise ValueError(f'unknown pipeline {pipeline!r}; choose from {", ".join(PIPELINES)}')


WARM_UP_BATCHES = 4      # untimed at the start of each measurement: buffers fill, autotuning starts


def images_per_second(dataset: tf.data.Dataset, batches: int, batch_size: int) -> float:
    """Images/s of ``batches`` batches from a fresh iterator of ``dataset``, after WARM_UP_BATCHES untimed
    ones. A fresh iterator per measurement: an idle iterator kept between rounds would go on filling its
    prefetch buffers while another pipeline is measured, and hand the next measurement a head start."""
    iterator = iter(dataset)
    for _ in range(WARM_UP_BATCHES):
        next(iterator)
    started = time.perf_counter()
    for _ in range(batches):
        images, _ = next(iterator)
    images.numpy()
    elapsed = time.perf_counter() - started
    del iterator
    return batches * batch_size / elapsed


def run(data_dir: str, pipelines, threads, batch_size: int, image_size: int, num_images: int, rounds: int,
        print_fn=print) -> dict:
    """Every (pipeline, threads) pair, alternately for ``rounds`` rounds of ``num_images`` images each."""
    candidates = {}
    for pipeline in pipelines:
        for count in threads:
            name = pipeline if len(threads) == 1 else f'{pipeline}@{count}'
            try:
                dataset = build(pipeline, make_config(data_dir, batch_size, image_size, count))
            except ImportError as error:
                print_fn(f'skipping {pipeline}: {error} (install the peer extra, see BUILD.md)')
                continue
            candidates[name] = (pipeline, count, dataset)
    batches = max(1, num_images // batch_size)
    figures = {name: [] for name in candidates}
    for round_index in range(rounds):
        for name in step_timing.round_order(candidates, round_index):
            figures[name].append(images_per_second(candidates[name][2], batches, batch_size))
        print_fn(f'round {round_index + 1}/{rounds}: '
                 + ', '.join(f'{name} {values[-1]:.1f} images/s' for name, values in figures.items()))
    medians = {name: statistics.median(values) for name, values in figures.items()}
    for name, value in medians.items():
        print_fn(f'{name}: {value:.1f} images/s (median of {rounds})')
    if len(candidates) == 1:
        (name, (pipeline, count, _)), = candidates.items()
        return {'pipeline': pipeline, 'images_per_second': round(medians[name], 1), 'threads': count,
                'num_images': batches * batch_size}
    result = {'images_per_second': {name: round(value, 1) for name, value in medians.items()},
              'num_images': batches * batch_size, 'rounds': rounds}
    result['round_by_round'] = {}
    for name, value in medians.items():
        pipeline, count, _ = candidates[name]
        ours = f'ours@{count}' if len(threads) > 1 else 'ours'
        if pipeline != 'ours' and ours in medians:
            result[f'{ours}/{name}'] = round(medians[ours] / value, 3)
            paired = step_timing.paired_ratios({ours: figures[ours], name: figures[name]}, name)[ours]
            result['round_by_round'][f'{ours}/{name}'] = round(paired, 3)
            print_fn(f'{ours}/{name}: {medians[ours] / value:.3f} (round by round: {paired:.3f})')
    if len(threads) > 1 and 'ours@1' in medians:
        for count in threads[1:]:
            if f'ours@{count}' in medians:
                result[f'ours@{count}/ours@1'] = round(medians[f'ours@{count}'] / medians['ours@1'], 3)
    return result


def run_epochs(data_dir: str, pipeline: str, threads: int, batch_size: int, image_size: int, num_images: int,
               epochs: int, print_fn=print) -> dict:
    """``epochs`` passes of ``num_images`` images: images/s and resident memory after each."""
    iterator = iter(build(pipeline, make_config(data_dir, batch_size, image_size, threads)))
    batches = max(1, num_images // batch_size)
    memory, rates = [], []
    for epoch in range(epochs):
        started = time.perf_counter()
        for _ in range(batches):
            images, _ = next(iterator)
        images.numpy()
        rates.append(batches * batch_size / (time.perf_counter() - started))
        memory.append(resident_memory_mb())
        print_fn(f'epoch {epoch + 1}/{epochs}: {rates[-1]:.1f} images/s, memory {memory[-1]:,.0f} MiB')
    return {'pipeline': pipeline, 'images_per_second': round(statistics.median(rates), 1), 'threads': threads,
            'num_images': batches * batch_size * epochs, 'memory_mb_by_epoch': [round(m) for m in memory]}


def main(argv):
    del argv
    runtime.limit_malloc_arenas()   # as the training command does
    environment = runtime.report()  # every pipeline runs in this process, so with this one setting
    print(runtime.describe(environment))
    if not tf.io.gfile.glob(os.path.join(_DATA_DIR.value or '', 'train-*-of-*')):
        print(f'error: no train-*-of-* files in --data_dir {_DATA_DIR.value} (make them with '
              'tools/data/make_benchmark_data.py)', file=sys.stderr)
        return 2
    pipelines = PIPELINES if _PIPELINE.value == 'all' else _PIPELINE.value.split(',')
    threads = [int(t) for t in _THREADS.value.split(',')]
    for name in pipelines:
        if name not in PIPELINES:
            print(f'error: unknown pipeline {name!r}; choose from {", ".join(PIPELINES)} or all', file=sys.stderr)
            return 2
    if _EPOCHS.value:
        result = run_epochs(_DATA_DIR.value, pipelines[0], threads[0], _BATCH_SIZE.value, _IMAGE_SIZE.value,
                            _NUM_IMAGES.value, _EPOCHS.value)
    else:
        result = run(_DATA_DIR.value, pipelines, threads, _BATCH_SIZE.value, _IMAGE_SIZE.value, _NUM_IMAGES.value,
                     _ROUNDS.value)
    print(json.dumps({**result, 'environment': environment}))
    return 0


if __name__ == '__main__':
    from absl import app, flags
    _DATA_DIR = flags.DEFINE_string('data_dir', None, 'Directory of train-*-of-* TFRecord shards.')
    _PIPELINE = flags.DEFINE_string('pipeline', 'ours', 'ours, naive, tfm, a comma list of them, or all.')
    _BATCH_SIZE = flags.DEFINE_integer('batch_size', 64, 'Images per batch.')
    _IMAGE_SIZE = flags.DEFINE_integer('image_size', 224, 'Output side, in pixels.')
    _NUM_IMAGES = flags.DEFINE_integer('num_images', 2000, 'Images timed per pipeline and round (or epoch).')
    _THREADS = flags.DEFINE_string('threads', '0', "Private thread-pool size(s), comma-separated (0: TensorFlow's "
                                   'shared pool).')
    _ROUNDS = flags.DEFINE_integer('rounds', 3, 'Alternating rounds when several candidates run.')
    _EPOCHS = flags.DEFINE_integer('epochs', 0, 'Instead of rounds: passes over --num_images of one pipeline, '
                                   'with memory after each.')
    app.run(main)
