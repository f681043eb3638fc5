"""Images/s of the training input through a tf.data service on this machine, against the in-process pipeline.

    python tools/benchmarks/benchmark_data_service.py --data_dir data/benchmark --workers 1,2 --rounds 3

Starts one service per worker count (a dispatcher and N workers, each its own process, as
tools/launch/run_data_service.py does), then measures, alternately for --rounds rounds: the in-process pipeline
(input_pipeline.train_dataset, as benchmark_input.py's 'ours') and the same images through each service in
--mode (distributed_epoch: data_service.sharded_train_dataset; parallel_epochs: the in-process stream run by the
workers). Each measurement is a fresh iterator after untimed warm-up batches; figures are medians over rounds.
The service's workers share this machine's cores with the trainer, so on a small machine expect parity at best:
what the service adds is cores on other machines. The last line is one JSON object with every figure.
"""

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from imagenet_tpu import runtime  # noqa: E402  (before TensorFlow: the package's oneDNN setting)

tf = runtime.import_tensorflow()
from absl import app, flags  # noqa: E402

import benchmark_input  # noqa: E402  (tools/, beside this file)
from imagenet_tpu.distribute import cluster
from imagenet_tpu.data import data_service
from imagenet_tpu.data import input_pipeline  # noqa: E402

_DATA_DIR = flags.DEFINE_string('data_dir', 'data/benchmark', 'Directory of train-*-of-* TFRecord shards.')
_WORKERS = flags.DEFINE_string('workers', '1,2', 'Worker counts, one service each.')
_MODE = flags.DEFINE_enum('mode', 'distributed_epoch', data_service.MODES, 'Processing mode.')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 64, 'Images per batch.')
_IMAGE_SIZE = flags.DEFINE_integer('image_size', 224, 'Output side, in pixels.')
_NUM_IMAGES = flags.DEFINE_integer('num_images', 1280, 'Images timed per candidate and round.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Alternating rounds.')


def start_service(workers: int):
    """(address, processes) of a dispatcher and ``workers`` workers on this machine, once they serve."""
    port = cluster.free_ports(1)[0]
    command = [sys.executable, '-m', 'imagenet_tpu.commands.data_service']
    processes = [subprocess.Popen(command + ['dispatcher', f'--port={port}'], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)]
    processes += [subprocess.Popen(command + ['worker', f'--dispatcher=localhost:{port}', '--host=localhost'],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for _ in range(workers)]
    for process in processes:
        for line in iter(process.stdout.readline, ''):
            if line.startswith(('dispatcher at', 'worker at')):
                break
    time.sleep(2)     # the workers' first heartbeat
    return f'grpc://localhost:{port}', processes


def served_dataset(config, mode: str):
    if mode == 'distributed_epoch':
        dataset = data_service.sharded_train_dataset(config)
    else:
        dataset = input_pipeline.train_dataset(config, served=True)
    return data_service.distribute(dataset, config.data_service, mode).prefetch(tf.data.AUTOTUNE)


def main(argv):
    del argv
    runtime.limit_malloc_arenas()
    environment = runtime.report()
    print(runtime.describe(environment))
    config = benchmark_input.make_config(_DATA_DIR.value, _BATCH_SIZE.value, _IMAGE_SIZE.value, 0)
    services, candidates = [], {'in-process': input_pipeline.train_dataset(config)}
    try:
        for count in (int(value) for value in _WORKERS.value.split(',')):
            address, processes = start_service(count)
            services += processes
            served = config.__class__(**{**config.__dict__, 'data_service': address})
            candidates[f'service, {count} worker{"s" if count > 1 else ""}'] = served_dataset(served, _MODE.value)
        batches = max(1, _NUM_IMAGES.value // _BATCH_SIZE.value)
        figures = {name: [] for name in candidates}
        for round_number in range(_ROUNDS.value):
            for name, dataset in candidates.items():
                figures[name].append(benchmark_input.images_per_second(dataset, batches, _BATCH_SIZE.value))
            print(f'round {round_number + 1}/{_ROUNDS.value}: '
                  + ', '.join(f'{name} {values[-1]:.1f} images/s' for name, values in figures.items()), flush=True)
    finally:
        cluster.stop_processes(services, grace_seconds=5)
    medians = {name: round(statistics.median(values), 1) for name, values in figures.items()}
    result = {'images_per_second': medians, 'mode': _MODE.value, 'num_images': batches * _BATCH_SIZE.value,
              'rounds': _ROUNDS.value, 'image_size': _IMAGE_SIZE.value,
              'ratios_to_in_process': {name: round(value / medians['in-process'], 3)
                                       for name, value in medians.items() if name != 'in-process'},
              'environment': environment}
    print(json.dumps(result))
    return 0


if __name__ == '__main__':
    app.run(main)
