"""A recipe rehearsed on one machine: its own settings, only the sizes shrunk, on simulated hosts (worker processes
on 127.0.0.1, each a host of logical CPU replicas), preempted, resumed, evaluated and exported.

What a rehearsal keeps as the recipe states it: the optimizer and its variant, the schedule's shape (warm-up and
decay as fractions of the run), the precision, label smoothing, the weight-decay rules, batch-norm inference
statistics, the all-reduce and its dtype, the space-to-depth stem. What it shrinks, and says so: the network (a
ResNet-10), the images (32 pixels, 10 classes, a few hundred synthetic JPEGs), the steps (STEPS, every
epoch-valued setting scaled with them), hosts and replicas (2 x 2), the per-replica batch (at most
MAX_PER_REPLICA), the batch-norm group (to what 4 replicas hold), the evaluation and checkpoint cadences (scaled
with the steps), the steps per host call (to an epoch). TPU meshes are not built: a TPU slice's placement is
tested in tests/distribute/mesh_test.py, and the torus's speed only a pod shows.

The phases: a reference run to the end; the same run with SIGTERM to worker 1 at a step drawn at random, which
every worker saves; the same command again, which resumes and must end with the reference's weights
(--deterministic); its evaluation (each host reads only its share of the validation files: eval_input.py); the
export to every format, each evaluated; and the planner's counts for the same hosts against the run's own.
"""

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from imagenet_tpu import config as config_lib
from imagenet_tpu import hardware
from imagenet_tpu.config import Config
from imagenet_tpu.data import eval_input, labels, record_counts, tfrecord
from imagenet_tpu.distribute import cluster
from imagenet_tpu.errors import RunError
from imagenet_tpu.plan import planner
from imagenet_tpu.serving import convert

WORKERS, REPLICAS_PER_WORKER = 2, 2
DEPTH, IMAGE_SIZE, CLASSES = 10, 32, 10
STEPS, STEPS_PER_EPOCH = 16, 4
MAX_PER_REPLICA = 16
PER_REPLICA_OF_GPU_CLUSTERS = 32     # the seeds' GPUs: Goyal et al. and Akiba et al. both ran 32 images per GPU
EVAL_STEPS = 2
RUN_TIMEOUT_SECONDS = 600
EPOCH_SETTINGS = ('warmup_epochs', 'alpha_sgd_center_epochs', 'alpha_sgd_period_epochs')


class RehearsalError(RunError):
    """A phase of the rehearsal failed; the message names it."""


class Setting(NamedTuple):
    name: str
    recipe: str
    rehearsal: str
    verdict: str      # 'kept' or 'shrunk'


def recipe_replicas(config: Config) -> int:
    """The replicas the recipe was written for: its --topology's, else 8 for one GPU host ('mirrored'), its
    logical devices ('cpu'), else a GPU cluster of PER_REPLICA_OF_GPU_CLUSTERS images per GPU."""
    if config.topology:
        return hardware.parse_topology(config.topology).replicas
    if config.strategy == 'mirrored':
        return 8
    if config.strategy == 'cpu':
        return config.num_cpu_devices
    return max(1, config.global_batch_size // PER_REPLICA_OF_GPU_CLUSTERS)


def shrink(config: Config, workers: int = WORKERS, replicas_per_worker: int = REPLICAS_PER_WORKER):
    """(the rehearsal's Config, the Settings: each setting of the recipe kept or shrunk and to what)."""
    replicas = workers * replicas_per_worker
    recipe_per_replica = max(1, config.global_batch_size // recipe_replicas(config))
    per_replica = min(recipe_per_replica, MAX_PER_REPLICA)
    global_batch = per_replica * replicas
    group = 1 if config.norm == 'none' else config.bn_group_size_for(recipe_replicas(config))
    rehearsal_group = max(g for g in range(1, replicas + 1) if replicas % g == 0 and g <= group)
    recipe_epochs = config.train_steps * config.global_batch_size / config.num_train_images
    epochs = STEPS / STEPS_PER_EPOCH
    scale = epochs / recipe_epochs
    recipe_per_call = config.steps_per_execution or (min(100, config.steps_per_epoch)
                                                     if config.strategy == 'tpu' else 1)
    values = dict(
        strategy='multi_worker', cpu_devices_per_worker=replicas_per_worker, tpu='', topology='', mesh_shape=None,
        depth=DEPTH, image_size=IMAGE_SIZE, num_classes=CLASSES + (1 - config.label_offset),
        num_train_images=global_batch * STEPS_PER_EPOCH, num_eval_images=EVAL_STEPS * global_batch,
        global_batch_size=global_batch, eval_batch_size=global_batch, total_steps=STEPS, train_epochs=epochs,
        bn_group_size=rehearsal_group, bn_span=None, shuffle_buffer=64, interleave_cycle_length=2,
        steps_per_execution=min(recipe_per_call, STEPS_PER_EPOCH),
        eval_every_epochs=max(1, round(config.eval_every_epochs * scale)),
        # Scaled with the steps, but at most one a host call's epoch: a save every step would be most of the run.
        checkpoint_every_steps=max(STEPS_PER_EPOCH, round(config.checkpoint_every_steps * STEPS / config.train_steps)),
        lr_decay_epochs=tuple(epoch * scale for epoch in config.lr_decay_epochs),
        log_every_steps=1, deterministic=True, seed=config.seed if config.seed is not None else 0,
        input_timeout_minutes=5.0, termination_grace_seconds=300.0, export_saved_model=False,
        data_dir=None, model_dir=None, data_service='', profile_steps=None, input_cache='none',
        **{name: getattr(config, name) * scale for name in EPOCH_SETTINGS})
    rehearsal = dataclasses.replace(config, **values)
    settings = []
    for field in dataclasses.fields(Config):
        before, after = getattr(config, field.name), getattr(rehearsal, field.name)
        if field.name in ('data_dir', 'model_dir', 'log_every_steps', 'input_timeout_minutes',
                          'termination_grace_seconds', 'export_saved_model', 'seed', 'deterministic'):
            continue
        settings.append(Setting(field.name, _text(before), _text(after), 'kept' if before == after else 'shrunk'))
    return rehearsal, settings


def _text(value) -> str:
    if isinstance(value, float):
        return f'{value:.4g}'
    if isinstance(value, tuple):
        return ','.join(_text(item) for item in value) or '-'
    return '-' if value in (None, '') else str(value)


def flag_arguments(config: Config) -> List[str]:
    """The training command's flags for ``config`` (every setting that differs from its default)."""
    arguments = []
    for field, _ in config_lib.settings():
        value = getattr(config, field.name)
        if value == field.default:
            continue
        if isinstance(value, bool):
            arguments.append(f'--{"" if value else "no"}{field.name}')
        elif value is None:
            continue
        elif field.name == 'mesh_shape':
            arguments.append(f'--mesh_shape={value[0]}x{value[1]}')
        elif isinstance(value, tuple):
            arguments.append(f'--{field.name}={",".join(str(item) for item in value)}')
        else:
            arguments.append(f'--{field.name}={value}')
    return arguments


def write_data(folder: str, config: Config, shards: int) -> None:
    """Synthetic photo-like JPEGs of config.num_classes classes, ImageNet's schema and label convention: enough
    training records for an epoch, config.num_eval_images held-out ones, ``shards`` files each."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:40, 0:48] / 40.0
    for split, count in ((tfrecord.TRAIN, config.num_train_images), (tfrecord.VALIDATION, config.num_eval_images)):
        examples = []
        for index in range(count):
            model_class = index % (config.num_classes - (1 - config.label_offset))
            phase = rng.uniform(0, 2 * np.pi)
            base = np.stack([np.sin((model_class + 1) * x * 3 + phase), np.cos((model_class + 1) * y * 3),
                             np.sin((x + y) * (model_class + 2))], -1)
            pixels = np.clip(128 + 100 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
            # On-disk labels 1..N as ImageNet's; --label_offset maps them to model classes (0 keeps class 0 unused).
            examples.append(tfrecord.make_example(tf.io.encode_jpeg(pixels, quality=90).numpy(), model_class + 1,
                                                  40, 48))
        for shard in range(shards):
            tfrecord.write_shard(os.path.join(folder, tfrecord.shard_name(split, shard, shards)),
                                 examples[shard::shards])
    record_counts.write_beside(folder)
    labels.write(labels.path_in(folder), [labels.Label(c + 1, f'c{c}', f'class {c}')
                                          for c in range(config.num_classes - (1 - config.label_offset))])


class Run(NamedTuple):
    status: int
    output: str
    seconds: float
    stopped_at: Optional[int]


def run_pod(arguments: List[str], workers: int, stop_after_step: Optional[int] = None) -> Run:
    """The training command as ``workers`` processes of a cluster on 127.0.0.1; with ``stop_after_step``,
    SIGTERM to worker 1 once the chief's progress lines pass that step."""
    addresses = cluster.local_workers(workers)
    logs = [tempfile.TemporaryFile('w+') for _ in range(workers)]
    processes = [subprocess.Popen([sys.executable, '-m', 'imagenet_tpu.commands.train', *arguments],
                                  env=dict(os.environ, TF_CONFIG=cluster.tf_config(addresses, index),
                                           TF_CPP_MIN_LOG_LEVEL='3', PYTHONUNBUFFERED='1'),
                                  stdout=log, stderr=subprocess.STDOUT, text=True)
                 for index, log in enumerate(logs)]
    started, stopped_at = time.monotonic(), None
    try:
        while any(process.poll() is None for process in processes):
            if time.monotonic() - started > RUN_TIMEOUT_SECONDS:
                raise RehearsalError(f'the pod did not finish in {RUN_TIMEOUT_SECONDS} s')
            if any(process.poll() not in (None, 0, 143) for process in processes):
                break
            if stop_after_step is not None and stopped_at is None:
                logs[0].seek(0)
                steps = [int(step) for step in re.findall(r'step (\d+)/', logs[0].read())]
                if steps and max(steps) >= stop_after_step:
                    stopped_at = max(steps)
                    processes[1].send_signal(signal.SIGTERM)
            time.sleep(0.2)
    finally:
        cluster.stop_processes(processes)
    output = ''
    for index, log in enumerate(logs):
        log.seek(0)
        output += ''.join(f'[worker {index}] {line}' for line in log.read().splitlines(keepends=True))
        log.close()
    statuses = [process.returncode for process in processes]
    status = next((code for code in statuses if code not in (0,)), 0)
    return Run(status, output, time.monotonic() - started, stopped_at)


def _last_error(output: str) -> str:
    errors = [line for line in output.splitlines() if 'error' in line.lower()]
    return errors[-1] if errors else output.strip().splitlines()[-1] if output.strip() else '(no output)'


def _weights(directory: str) -> dict:
    path = tf.train.latest_checkpoint(directory)
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if 'network' in name and np.issubdtype(np.asarray(reader.get_tensor(name)).dtype, np.floating)}


def rehearse(recipe: Config, name: str = '', folder: Optional[str] = None, workers: int = WORKERS,
             replicas_per_worker: int = REPLICAS_PER_WORKER, formats=convert.FORMATS,
             print_fn: Callable[[str], None] = print) -> dict:
    """Rehearses ``recipe`` (module docstring); returns the report (also for a rehearsal that failed: its
    'failed' entry names the phase). Nothing is written outside ``folder`` (default: a new temporary one)."""
    folder = folder or tempfile.mkdtemp(prefix='rehearsal-')
    config, settings = shrink(recipe, workers, replicas_per_worker)
    data_dir = os.path.join(folder, 'data')
    os.makedirs(data_dir, exist_ok=True)
    config = dataclasses.replace(config, data_dir=data_dir)
    report = {'recipe': name, 'folder': folder, 'settings': [s._asdict() for s in settings],
              'workers': workers, 'replicas_per_worker': replicas_per_worker, 'phases': {}}
    phases = report['phases']

    def phase(label: str, started: float, **facts):
        phases[label] = {'seconds': round(time.monotonic() - started, 1), **facts}
        print_fn(f'{name or "recipe"}: {label} passed in {phases[label]["seconds"]:.0f} s')

    try:
        started = time.monotonic()
        write_data(data_dir, config, shards=2 * workers)
        phase('data', started)
        started = time.monotonic()
        reference_dir = os.path.join(folder, 'reference')
        run = run_pod(flag_arguments(dataclasses.replace(config, model_dir=reference_dir)), workers)
        if run.status:
            raise RehearsalError(f'reference run: exit {run.status}: {_last_error(run.output)}')
        phase('reference run', started)
        started = time.monotonic()
        model_dir = os.path.join(folder, 'run')
        arguments = flag_arguments(dataclasses.replace(config, model_dir=model_dir))
        # Early in the run: the workers agree on the step to save a host call or two after the signal, and the
        # resume must have steps left to train.
        stop = random.Random(sum(map(ord, name))).randint(max(1, STEPS // 8), STEPS // 4)
        run = run_pod(arguments, workers, stop_after_step=stop)
        saved = [int(step) for step in re.findall(r'every worker saved step (\d+)', run.output)]
        if run.status != 143 or len(set(saved)) != 1 or len(saved) != workers:
            raise RehearsalError(f'preemption: exit {run.status}, saves {saved}: {_last_error(run.output)}')
        if saved[0] >= STEPS:
            raise RehearsalError(f'preemption: the workers saved step {saved[0]}, the last: nothing left to resume')
        phase('preempted', started, sigterm_after_step=run.stopped_at, saved_step=saved[0])
        started = time.monotonic()
        run = run_pod(arguments, workers)
        if run.status:
            raise RehearsalError(f'resumed run: exit {run.status}: {_last_error(run.output)}')
        reference, resumed = _weights(os.path.join(reference_dir, 'checkpoints')), \
            _weights(os.path.join(model_dir, 'checkpoints'))
        if set(reference) != set(resumed):
            raise RehearsalError('resumed run: its checkpoint holds other variables than the reference run\'s')
        difference = max(float(np.max(np.abs(reference[key] - resumed[key])) / (np.max(np.abs(reference[key]))
                                                                                   + 1e-12)) for key in reference)
        if difference > 1e-5:
            raise RehearsalError(f'resumed run: its weights differ from the reference run\'s by {difference:.3g} '
                                 'of the largest weight')
        phase('resumed', started, largest_weight_difference=difference)
        with open(os.path.join(model_dir, 'results.json')) as f:
            results = json.load(f)
        with open(os.path.join(reference_dir, 'results.json')) as f:
            reference_results = json.load(f)      # a run of its own from start to end: the counts to plan
        split = eval_input.validation_split(config, workers)
        sizes = [os.path.getsize(path) for path in split.paths]
        shares = [sum(sizes[i] for i in share) / sum(sizes) for share in split.shares] if split.shares else None
        if results.get('eval_images') != config.num_eval_images:
            raise RehearsalError(f'evaluation: {results.get("eval_images")} images evaluated of '
                                 f'{config.num_eval_images}')
        phases['evaluated'] = {'seconds': 0.0, 'top_1': results['top_1'], 'eval_images': results['eval_images'],
                               'evaluations': results['evaluations'], 'bytes_share_per_host': shares}
        started = time.monotonic()
        export = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.export', f'--model_dir={model_dir}',
                                 f'--formats={",".join(formats)}'], capture_output=True, text=True,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'), timeout=RUN_TIMEOUT_SECONDS)
        if export.returncode:
            raise RehearsalError(f'export: exit {export.returncode}: {_last_error(export.stderr)}')
        exported = json.loads(open(os.path.join(model_dir, 'export', os.path.basename(
            tf.train.latest_checkpoint(os.path.join(model_dir, 'checkpoints'))), 'export.json')).read())
        evaluation = exported.get('evaluation', {})
        served = evaluation.get('saved_model', {}).get('top_1')
        if served is None or abs(served - results['top_1']) > 1.5 / config.num_eval_images:
            raise RehearsalError(f'export: the SavedModel\'s top-1 {served} is not the run\'s {results["top_1"]}')
        phase('exported', started, top_1={kind: figures['top_1'] for kind, figures in evaluation.items()})
        plan = planner.plan(dataclasses.replace(config, topology=f'{workers}x{replicas_per_worker}xcpu'),
                            cpu_peak_tflops=1.0)
        report['counts'] = {name: {'planned': plan[key], 'run': reference_results.get(name)} for name, key in (
            ('replicas', 'replicas'), ('input_pipelines', 'input_pipelines'),
            ('per_replica_batch', 'per_replica_batch'), ('bn_group_images', 'bn_group_images'),
            ('evaluations', 'evaluations'))}
        report['counts']['steps_per_execution'] = {'planned': plan['steps_per_execution'],
                                                   'run': config.steps_per_execution}
        mismatched = [key for key, pair in report['counts'].items() if pair['planned'] != pair['run']]
        if mismatched:
            raise RehearsalError(f'the planner and the run disagree on {", ".join(mismatched)}')
    except (RehearsalError, RunError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as error:
        report['failed'] = f'{type(error).__name__}: {error}'
    report['only_a_pod_shows'] = ['compilation at the recipe\'s replica count', 'the collectives\' speed on the '
                                  'torus or network', 'memory (HBM) at the recipe\'s batch and image size',
                                  'TPU placement on a real slice (tested on topologies built in the tests)']
    return report


def describe(report: dict) -> str:
    """The report as text: settings kept and shrunk, phases and their times, counts, what only a pod shows."""
    lines = [f'rehearsal of {report["recipe"] or "a recipe"} on {report["workers"]} simulated hosts x '
             f'{report["replicas_per_worker"]} replicas ({report["folder"]})']
    kept = [s['name'] for s in report['settings'] if s['verdict'] == 'kept']
    lines.append(f'kept as the recipe states them: {", ".join(kept)}')
    for setting in report['settings']:
        if setting['verdict'] == 'shrunk':
            lines.append(f'  shrunk {setting["name"]}: {setting["recipe"]} -> {setting["rehearsal"]}')
    for label, facts in report['phases'].items():
        details = ', '.join(f'{key} {value}' for key, value in facts.items() if key != 'seconds')
        lines.append(f'passed {label} ({facts["seconds"]:.0f} s){": " + details if details else ""}')
    for key, pair in report.get('counts', {}).items():
        lines.append(f'  {key}: planned {pair["planned"]}, run {pair["run"]}')
    lines.append('only the real pod shows: ' + '; '.join(report['only_a_pod_shows']))
    if 'failed' in report:
        lines.append(f'FAILED: {report["failed"]}')
    return '\n'.join(lines)

