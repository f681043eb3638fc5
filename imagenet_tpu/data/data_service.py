"""Training input on a tf.data service cluster (tf.data.experimental.service): a dispatcher and any number of
workers, on other machines, read, decode, crop and batch the training images; the trainer only receives the
batches and prefetches them to its devices. Evaluation stays in the trainer's process (every image once).

    python -m imagenet_tpu.commands.data_service dispatcher --port=5050
    python -m imagenet_tpu.commands.data_service worker --dispatcher=HOST:5050 [--port=5051]
    imagenet-tpu-train ... --data_service=grpc://HOST:5050 [--data_service_mode=distributed_epoch]

Processing modes (--data_service_mode):
  distributed_epoch  The dispatcher hands each data epoch's files to the workers one at a time (dynamic
                     sharding): every training image is seen once per epoch. A worker that dies loses the files
                     it was reading at that moment for that epoch: at most once, never twice. Batches reach the
                     trainer in the order workers finish them, so a run is not repeatable record by record, and
                     a resumed run starts its interrupted data epoch again (--deterministic still fixes each
                     image's crop and flip, which depend on the image, its epoch and the seed, not on timing).
  parallel_epochs    Every worker runs this host's whole training stream, the one input_pipeline.train_dataset
                     builds. With one worker per trainer host that stream arrives exactly, up to the rounding of
                     pixels to uint8 for the transfer (--deterministic and exact resume hold as without the
                     service); with N workers every image comes N times per epoch, with the same crops.
The files' paths are sent to the workers as they are: they must reach the same files (a shared file system or
gs://). Bad records are skipped on the workers (bad_records='skip') but not counted on the trainer.

The dispatcher and the workers listen on every interface of their machine and authenticate no one (TensorFlow
has no setting for either; commands/data_service.py cites its source): run them on a private network or behind
a firewall.
"""

import socket

import tensorflow as tf

from imagenet_tpu.config import SERVICE_MODES as MODES, SERVICE_PROTOCOL as PROTOCOL
from imagenet_tpu.config import parse_service_address as parse_address
from imagenet_tpu.data import input_pipeline
from imagenet_tpu.data import record_counts
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord
from imagenet_tpu.errors import ConfigError


def check_reachable(address: str, timeout_seconds: float = 5.0) -> None:
    """ConfigError naming the address when nothing accepts connections there (TensorFlow's client would wait
    for the dispatcher indefinitely, retrying)."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f'cannot reach the tf.data service dispatcher at {address} ({reason}); start it with '
                          'tools/launch/run_data_service.py or python -m imagenet_tpu.commands.data_service '
                          'dispatcher') from None


def distribute(dataset, address: str, mode: str):
    """``dataset`` of (images, labels, ...) batches, built here and run on the service's workers, read from the
    service at ``address``.

    Images travel as uint8 (rounded and clipped to 0..255, the pixel scale the pipeline works in) and are cast
    back here: a quarter of float32's bytes, and uncompressed (they compress poorly and the codec costs CPU):
    the fastest of the three through a local service (docs/benchmarks.md,
    tools/benchmarks/benchmark_data_service.py)."""
    if mode not in MODES:
        raise ConfigError(f'--data_service_mode must be one of {", ".join(MODES)}, got {mode!r}')
    service = tf.data.experimental.service
    processing_mode = service.ShardingPolicy.DYNAMIC if mode == 'distributed_epoch' else service.ShardingPolicy.OFF
    dtype = dataset.element_spec[0].dtype
    wire = dataset.map(lambda images, *rest: (to_pixels(images), *rest), num_parallel_calls=tf.data.AUTOTUNE)
    served = wire.apply(service.distribute(processing_mode=processing_mode, service=address, compression=None))
    return served.map(lambda images, *rest: (tf.cast(images, dtype), *rest), num_parallel_calls=tf.data.AUTOTUNE)


def to_pixels(images):
    """Images on the 0..255 scale as uint8: rounded, clipped (a bicubic resize overshoots a little)."""
    return tf.cast(tf.clip_by_value(tf.round(tf.cast(images, tf.float32)), 0.0, 255.0), tf.uint8)


FILE_KEYS = 2 ** 24     # a record's key in distributed_epoch mode: file number * FILE_KEYS + its index in the file


@record_io.traced_as_written
def sharded_train_dataset(config, context=None, dtype=None, start_step: int = 0, epochs=None, log=print,
                          with_keys: bool = False):
    """The training batches of distributed_epoch mode, as the service's workers compute them.

    Its source is the sequence of file numbers (epoch * files + i: the i-th file of that epoch's shuffled
    order), which the dispatcher hands out to the workers one at a time. Each worker reads the files it gets,
    interleave_cycle_length at a time, shuffles their records through a buffer of shuffle_buffer, crops and
    flips each with the seed (seed, pipeline, file number, index in the file), decodes and batches them.
    Endless, or ``epochs`` data epochs; ``start_step`` > 0 starts the data epoch that step falls in from its
    beginning (which records of it were used depends on the workers' timing, and is not known). ``with_keys``
    adds each image's key (file number * FILE_KEYS + index in the file) to its batch: which epoch and file it
    came from."""
    dtype = dtype or input_pipeline.image_dtype(config)
    paths = input_pipeline.pipeline_files(record_io.list_shards(config.data_dir, tfrecord.TRAIN), context)
    sizes = record_io.file_sizes(paths)
    base_seed = input_pipeline.pipeline_seed(config, context)
    first_epoch = 0
    if start_step:
        counts = record_counts.lookup(paths, sizes, config.data_dir, config.model_dir, log)
        first_epoch, _ = input_pipeline.resume_position(config, start_step, context, sum(counts))
    count = len(paths)
    paths_tensor, sizes_tensor = tf.constant(paths), tf.constant(sizes, tf.int64)

    def read(number):
        chosen = input_pipeline.file_order(base_seed, number // count, count)[number % count]
        records = record_io.file_records(tf.gather(paths_tensor, chosen), tf.gather(sizes_tensor, chosen), 0,
                                         **input_pipeline.reader_settings(config))
        return records.enumerate().map(lambda index, record: (number * FILE_KEYS + index, record))

    end = (first_epoch + epochs) * count if epochs else 2 ** 62
    # A worker that dies loses every file it has claimed: it claims one only when it starts reading it.
    records = record_io.interleave_without_prefetch(tf.data.Dataset.range(first_epoch * count, end), read,
                                                    min(config.interleave_cycle_length, count), block_length=1,
                                                    sloppy=True)
    parse = input_pipeline.record_parser(config, dtype, base_seed)

    def decode(index, element):
        key = (element[0],) if with_keys else ()
        return (index, *parse(*element), *key)

    decoded = records.shuffle(config.shuffle_buffer).enumerate().map(decode, num_parallel_calls=tf.data.AUTOTUNE,
                                                                     deterministic=False)
    examples = input_pipeline.skip_bad_records(decoded, config)
    batch = input_pipeline.per_replica_batch(config.global_batch_size, context)
    batches = input_pipeline.space_to_depth(examples.batch(batch, drop_remainder=True), config)
    return batches.with_options(input_pipeline.dataset_options(False, config.input_threads))


@record_io.traced_as_written
def train_dataset(config, context=None, start_step: int = 0, log=print):
    """The training batches of this input pipeline, computed by the service at config.data_service in
    config.data_service_mode and prefetched here."""
    if config.data_service_mode == 'distributed_epoch':
        dataset = sharded_train_dataset(config, context, start_step=start_step, log=log)
    else:
        dataset = input_pipeline.train_dataset(config, context, start_step=start_step, log=log, served=True)
    return distribute(dataset, config.data_service, config.data_service_mode).prefetch(tf.data.AUTOTUNE)


def serve_dispatcher(port: int, worker_timeout_ms: int = 0):
    """Starts a dispatcher on ``port`` (0: any free one) of every interface of this machine, without
    authentication (TensorFlow's servers have no setting for either); returns the server (its target is
    grpc://localhost:PORT)."""
    config = tf.data.experimental.service.DispatcherConfig(port=port, protocol=PROTOCOL,
                                                           worker_timeout_ms=worker_timeout_ms or None)
    return tf.data.experimental.service.DispatchServer(config)


def serve_worker(dispatcher: str, port: int = 0, host: str = 'localhost', heartbeat_interval_ms: int = 1000):
    """Starts a worker of the dispatcher at ``dispatcher`` ('HOST:PORT'), reachable by trainers at host:port.
    ``host`` is only the name the dispatcher hands to trainers: the worker listens on ``port`` of every interface,
    without authentication, as the dispatcher does. A worker learns of a new job's task at its next heartbeat;
    TensorFlow's default interval (30 s) would leave a worker idle that long at the start of every run."""
    config = tf.data.experimental.service.WorkerConfig(
        dispatcher_address=dispatcher, worker_address=f'{host}:%port%', port=port, protocol=PROTOCOL,
        heartbeat_interval_ms=heartbeat_interval_ms)
    return tf.data.experimental.service.WorkerServer(config)
