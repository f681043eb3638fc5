"""End-to-end training images/s: our command line against tf-models-official's own trainer, alternating.

Both train a ResNet-50 from TFRecords on disk with the same settings: image size, global batch, one device of
the machine (our --strategy=default, their one_device strategy), float32, XLA off unless --jit_compile, random
crops of 8-100% of the image area and flips, momentum SGD with L2 weight decay 1e-4, 1001 classes, shuffle buffer
and files read at once alike. Theirs is experiment `resnet_imagenet` run by `official.vision.train` (its parser,
its task's train step, orbit's loop with --report_every steps per loop); ours is `imagenet-tpu-train`.
Every process gets the same environment, the oneDNN setting included (printed first). By default the candidates
start once, as --turn_processes processes each, and take turns (--turn_reports=N, turns.py): one process runs N
report intervals while the others are stopped, so adjacent turns are seconds apart instead of minutes, no start-up
is timed, and each candidate's figure is a mean over processes whose speeds differ for their whole life
(docs/benchmarks.md T25). With --turn_reports=0 each run is instead a fresh process, the candidates alternating
every round. Either way every other round runs in reverse order (ours, tfm, tfm, ours, ...:
step_timing.round_order), for --rounds rounds; an even number of rounds gives each candidate each place equally
often.

Steady state: each process's progress reports (our progress lines every --report_every steps, orbit's
`train | step: N` lines every loop of --report_every steps) are timestamped as they arrive; a run's images/s is
(last reported step - first reported step) x batch / (time between those two lines), so start-up, tracing, the
first steps and the end (evaluation, export) are left out of both alike. Each figure is the median over rounds.
The last line printed is one JSON object with every run, the medians, ours/tfm (of the medians) and under
"round_by_round" the median of each round's ours/tfm.

    python tools/data/make_benchmark_data.py --output_dir data/benchmark --num_images 2000
    make peer    # tf-models-official in .venv-peer (BUILD.md)
    python tools/benchmarks/benchmark_trainer.py --data_dir data/benchmark --peer_python .venv-peer/bin/python
    python tools/benchmarks/benchmark_trainer.py ... --turn_reports=0 --steps=50 --report_every=10   # fresh processes
"""

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
from imagenet_tpu import runtime  # noqa: E402  (before TensorFlow: the package's oneDNN setting)
import step_timing  # noqa: E402  (this folder: the benchmarks' round order)
import turns  # noqa: E402  (this folder: processes taking turns)

_DATA_DIR = flags.DEFINE_string('data_dir', None, 'Directory of train-*-of-* and validation-*-of-* shards '
                                '(tools/data/make_benchmark_data.py writes both).')
_PEER_PYTHON = flags.DEFINE_string('peer_python', None, 'Python of an environment with tf-models-official '
                                   '(default: this one).')
_CANDIDATES = flags.DEFINE_list('candidates', ['ours', 'tfm'], "What to run, in this order each round: 'ours', "
                                "'tfm', or ours with extra flags after a colon, e.g. 'ours:--synthetic_data' (the "
                                "model without input) or 'ours:--steps_per_execution=10'.")
_IMAGE_SIZE = flags.DEFINE_integer('image_size', 128, 'Network input side, in pixels.')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 32, 'Global batch, in images.')
_STEPS = flags.DEFINE_integer('steps', 50, 'Training steps per run with --turn_reports=0 (in turns each process '
                               'runs as many as its turns need).')
_REPORT_EVERY = flags.DEFINE_integer('report_every', 5, 'Steps between progress reports (orbit: steps per loop).')
_ROUNDS = flags.DEFINE_integer('rounds', 4, 'Alternating rounds (every other one in reverse order).')
_JIT_COMPILE = flags.DEFINE_bool('jit_compile', False, 'XLA-compile both train steps.')
_SHUFFLE_BUFFER = flags.DEFINE_integer('shuffle_buffer', 10000, 'Records in the shuffle buffer of both.')
_CYCLE_LENGTH = flags.DEFINE_integer('cycle_length', 10, 'Training files read at once by both.')
_TURN_REPORTS = flags.DEFINE_integer(
    'turn_reports', 2, 'With N > 0, the candidates run in turns (turns.py): each process starts once, warms up '
    'for 2 reports and is paused; then every round each one resumes for N timed report intervals (after the '
    'report that closes the interval its pause cut), the others stopped. 0: one fresh process per candidate and '
    'round, --steps steps each.')
_TURN_PROCESSES = flags.DEFINE_integer(
    'turn_processes', 2, 'With --turn_reports: processes per candidate, each taking its own turns; a round\'s figure '
    'of a candidate is the mean over its processes. Identical training processes differ in speed for their whole '
    'life (docs/benchmarks.md T25), so one process per candidate measures that process as much as the candidate. '
    'Each ResNet-50 process holds about 2.5 GB.', lower_bound=1)
_OURS_FLAGS = flags.DEFINE_list('ours_flags', [], 'Extra flags for our command, e.g. --steps_per_execution=10.')

NUM_CLASSES = 1001   # tf-models-official's ImageNet convention; ours reads the same labels with --label_offset=0


def count_records(pattern: str) -> int:
    import tensorflow as tf
    return sum(1 for path in tf.io.gfile.glob(pattern) for _ in tf.data.TFRecordDataset(path))


def ours_command(data_dir: str, model_dir: str, num_eval_images: int, extra_flags=(), steps=None) -> list:
    steps, batch = steps or _STEPS.value, _BATCH_SIZE.value
    return [sys.executable, '-m', 'imagenet_tpu.commands.train', f'--data_dir={data_dir}', f'--model_dir={model_dir}',
            '--depth=50', f'--image_size={_IMAGE_SIZE.value}', f'--num_classes={NUM_CLASSES}', '--label_offset=0',
            f'--num_train_images={steps * batch}', f'--num_eval_images={num_eval_images}',
            f'--global_batch_size={batch}', f'--eval_batch_size={batch}', f'--total_steps={steps}',
            f'--log_every_steps={_REPORT_EVERY.value}', '--strategy=default', '--optimizer=sgd',
            '--momentum=0.9', '--weight_decay=1e-4', '--base_learning_rate=0.1', '--warmup_epochs=0',
            '--random_crop_min_area=0.08', f'--shuffle_buffer={_SHUFFLE_BUFFER.value}',
            f'--interleave_cycle_length={_CYCLE_LENGTH.value}', f'--checkpoint_every_steps={10 * steps}',
            f'--jit_compile={str(_JIT_COMPILE.value).lower()}', *_OURS_FLAGS.value, *extra_flags]


def tfm_command(data_dir: str, model_dir: str, steps=None) -> list:
    steps, size, batch = steps or _STEPS.value, _IMAGE_SIZE.value, _BATCH_SIZE.value
    overrides = {
        'runtime': {'distribution_strategy': 'one_device', 'num_gpus': 0, 'enable_xla': _JIT_COMPILE.value,
                    'mixed_precision_dtype': 'float32'},
        'task': {'model': {'num_classes': NUM_CLASSES, 'input_size': [size, size, 3]},
                 'train_data': {'input_path': os.path.join(data_dir, 'train-*'), 'global_batch_size': batch,
                                'dtype': 'float32', 'shuffle_buffer_size': _SHUFFLE_BUFFER.value,
                                'cycle_length': _CYCLE_LENGTH.value},
                 'validation_data': {'input_path': os.path.join(data_dir, 'validation-*'),
                                     'global_batch_size': batch}},
        'trainer': {'train_steps': steps, 'steps_per_loop': _REPORT_EVERY.value,
                    'summary_interval': _REPORT_EVERY.value, 'checkpoint_interval': 10 * steps,
                    'validation_interval': 10 * steps,
                    'optimizer_config': {'learning_rate': {'stepwise': {'boundaries': [10 * steps],
                                                                        'values': [0.0125, 0.00125]}},
                                         'warmup': {'linear': {'warmup_steps': 0}}}}}
    return [_PEER_PYTHON.value or sys.executable, '-m', 'official.vision.train', '--experiment=resnet_imagenet',
            '--mode=train', f'--model_dir={model_dir}', f'--params_override={json.dumps(overrides)}']


# A progress report: (reported step) from our progress line or from orbit's train loop line.
_REPORTS = {'ours': re.compile(r'^epoch [\d.]+ step (\d+)/\d+ '), 'tfm': re.compile(r'train \| step:\s*(\d+) \|')}


def run_once(name: str, command: list, environment: dict, print_fn=print) -> dict:
    """Runs one training process; returns its steady-state images/s from timestamped progress reports."""
    started = time.perf_counter()
    run = turns.LiveRun(name, command, _REPORTS[name.split(':')[0]], cwd=REPO, env=environment)
    try:
        status = run.finish(lambda step, now: print_fn(f'  {name}: step {step} at {now - started:.1f} s'))
    finally:
        run.end()       # a no-op once it has ended; kills it if this process is interrupted
    reports = run.reports
    if status != 0 or len(reports) < 2:
        raise RuntimeError(f'{name} exited with status {status} after {len(reports)} progress reports; its last '
                           f'lines:\n{"".join(run.tail)}')
    (first_step, first_time), (last_step, last_time) = reports[0], reports[-1]
    rate = (last_step - first_step) * _BATCH_SIZE.value / (last_time - first_time)
    return {'images_per_second': round(rate, 3), 'steps_timed': last_step - first_step,
            'from_step': first_step, 'wall_seconds': round(time.perf_counter() - started, 1)}


def main(argv):
    del argv
    data_dir = os.path.abspath(_DATA_DIR.value or '')
    for split in ('train', 'validation'):
        if not os.path.isdir(data_dir) or not any(n.startswith(f'{split}-') for n in os.listdir(data_dir)):
            print(f'error: no {split}-*-of-* files in --data_dir {_DATA_DIR.value} (make them with '
                  'tools/data/make_benchmark_data.py)', file=sys.stderr)
            return 2
    if _TURN_REPORTS.value < 0:
        print(f'error: --turn_reports={_TURN_REPORTS.value} must be 0 (separate runs) or more', file=sys.stderr)
        return 2
    if not _TURN_REPORTS.value and (_STEPS.value % _REPORT_EVERY.value or _STEPS.value < 2 * _REPORT_EVERY.value):
        # Our last report must be a step report, not the epoch-end line printed after evaluation.
        print(f'error: --steps={_STEPS.value} must be a multiple of --report_every={_REPORT_EVERY.value}, '
              'at least twice it', file=sys.stderr)
        return 2
    if _ROUNDS.value < 1:
        print(f'error: --rounds={_ROUNDS.value} must be at least 1', file=sys.stderr)
        return 2
    for name in _CANDIDATES.value:
        if name.split(':')[0] not in _REPORTS or (':' in name and not name.startswith('ours:')):
            print(f'error: unknown candidate {name!r}; choose from {", ".join(_REPORTS)}', file=sys.stderr)
            return 2
    facts = runtime.report()
    print(runtime.describe(facts), flush=True)
    # Both processes get this process's setting, whichever package they import first.
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=REPO,
                       **{runtime.ONEDNN_VARIABLE: '1' if facts['onednn'] else '0'})
    num_eval_images = count_records(os.path.join(data_dir, 'validation-*'))
    scratch = tempfile.mkdtemp(prefix='benchmark_trainer-')
    steps = (turns.steps_needed(_REPORT_EVERY.value, _ROUNDS.value, _TURN_REPORTS.value, 2)
             if _TURN_REPORTS.value else _STEPS.value)

    def command(name, model_dir):
        base, _, extra = name.partition(':')
        return (ours_command(data_dir, model_dir, num_eval_images, extra.split(), steps) if base == 'ours'
                else tfm_command(data_dir, model_dir, steps))

    try:
        if _TURN_REPORTS.value:
            print(f'in turns: {_ROUNDS.value} rounds of {_TURN_REPORTS.value} x {_REPORT_EVERY.value} steps each, '
                  f'{_TURN_PROCESSES.value} processes per candidate, {steps} steps per process', flush=True)
            processes = turns.process_names(_CANDIDATES.value, _TURN_PROCESSES.value)
            starts = {name: (lambda name=name, index=index: turns.LiveRun(
                name, command(turns.candidate_of(name), os.path.join(scratch, f'process{index}')),
                _REPORTS[turns.candidate_of(name).split(':')[0]], cwd=REPO, env=environment))
                for index, name in enumerate(processes)}
            rates = turns.by_candidate(turns.take_turns(starts, step_timing.round_order, _ROUNDS.value,
                                                        _TURN_REPORTS.value, _BATCH_SIZE.value))
            runs = {name: [{'images_per_second': round(rate, 3)} for rate in values] for name, values in rates.items()}
        else:
            runs = {name: [] for name in _CANDIDATES.value}
            for round_index in range(_ROUNDS.value):
                for name in step_timing.round_order(_CANDIDATES.value, round_index):
                    index = _CANDIDATES.value.index(name)
                    model_dir = os.path.join(scratch, f'round{round_index}-candidate{index}')
                    result = run_once(name, command(name, model_dir), environment)
                    runs[name].append(result)
                    print(f'round {round_index + 1}/{_ROUNDS.value}: {name} {result["images_per_second"]:.2f} '
                          f'images/s over steps {result["from_step"]}-{result["from_step"] + result["steps_timed"]}',
                          flush=True)
    except RuntimeError as error:
        print(f'error: {error}', file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rates = {name: [r['images_per_second'] for r in results] for name, results in runs.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, median in medians.items():
        print(f'{name}: {median:.2f} images/s (median of {len(runs[name])})')
    summary = {'environment': facts, 'image_size': _IMAGE_SIZE.value, 'batch_size': _BATCH_SIZE.value,
               'steps': steps, 'turn_reports': _TURN_REPORTS.value, 'jit_compile': _JIT_COMPILE.value, 'runs': runs,
               'images_per_second': {n: round(m, 3) for n, m in medians.items()}}
    if 'tfm' in medians:
        for name in medians:
            if name != 'tfm':
                summary[f'{name}/tfm'] = round(medians[name] / medians['tfm'], 3)
                paired = step_timing.paired_ratios({name: rates[name], 'tfm': rates['tfm']}, 'tfm')[name]
                summary.setdefault('round_by_round', {})[f'{name}/tfm'] = round(paired, 3)
                print(f"{name}/tfm: {summary[f'{name}/tfm']:.3f} (round by round: {paired:.3f})")
    print(json.dumps(summary))
    return 0


if __name__ == '__main__':
    app.run(main)
