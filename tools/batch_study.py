"""The papers' effects observed: a batch-size study on real images (the demo digits by default).

Two grids of short trainings, each point a train_and_evaluate run of its own model_dir under OUTPUT_DIR/runs/ (a
finished point is not run again; an interrupted one resumes), several seeds per point, with progress and an ETA:

  scaling   momentum SGD, LARS and RMSprop warm-up at global batches from small to the largest the set allows, for a
            fixed epoch budget on 2 logical CPU replicas with --gradient_noise_scale: held-out top-1 after every
            epoch, so the steps and epochs to reach --target and the top-1 at the budget, and the run's noise scale;
  bn        a fixed tiny per-replica batch on 8 logical replicas: batch norm per replica against groups of 2, 4
            and 8, and per replica with --bn_inference_statistics moving_average, last_batch and reestimate.

The rules of each optimizer (nothing is tuned per point):
  sgd             Goyal et al. 2017: peak rate 0.1 x B / 256 (linear scaling), momentum 0.9;
  lars            square-root scaling anchored at the MLPerf v0.6 recipe (flags/tpu_v3_1024_bs32k.cfg: 31.2 at batch
                  32,768): 31.2 x sqrt(B / 32768), momentum 0.9, trust coefficient 0.001;
  rmsprop_warmup  Akiba et al. 2017 (flags/gpu_1024_bs32k_akiba.cfg): 0.1 x B / 256, RMSprop rate 3e-4, the switch to
                  SGD centred at 10/90 of the budget over 5/90 of it (their 10 and 5 of 90 epochs), and no linear
                  warm-up of the rate (the source has none: the RMSprop phase is its warm-up);
and for all: --warmup_fraction of the budget of linear warm-up for SGD and LARS (Goyal et al.: 5 of 90 epochs;
default 0.1), then cosine decay, weight decay 5e-4 on kernels, the demo's augmentation. The decay is the same for
all three so that only the optimizer, its rate rule and its warm-up differ.

Outputs in OUTPUT_DIR: study.csv (one row per run), study.md (a table of the points: mean and spread over seeds),
scaling.png (steps to the target against batch on log-log axes with the perfect-scaling line; beside it MLPerf's
reference convergence points, epochs to 75.9% against batch) and bn.png (top-1 against the images each batch norm
normalizes over).

    python tools/data/make_demo_data.py --output_dir data/demo
    python tools/batch_study.py --data_dir data/demo --output_dir runs/batch_study
    python tools/batch_study.py --data_dir data/demo --output_dir runs/batch_study --points=lars-b256-s1  # one point
    python tools/batch_study.py --smoke --data_dir data/demo --output_dir /tmp/study     # a few seconds a point
"""

import csv
import dataclasses
import fnmatch
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'plots'))   # plot_metrics

from absl import app, flags, logging  # noqa: E402

# MLPerf Training's reference convergence points for ResNet-50 (mlcommons/logging,
# mlperf_logging/rcp_checker/training_4.0.0/rcps_resnet.json, commit 0a0a659): epochs to 75.9% top-1 of every
# reference run, by global batch.
MLPERF_EPOCHS = {
    1632: [34, 34, 34, 35, 35, 37, 35, 35, 33, 35, 35, 37, 37, 35, 35, 34, 35],
    3264: [36, 35, 34, 34, 36, 35, 35, 35, 35, 37, 35, 35, 35, 36, 35],
    4096: [39, 42, 40, 41, 39, 40, 41, 39, 40, 39],
    8192: [42, 44, 43, 41, 41, 41, 42, 42, 43, 41],
    13056: [46, 46, 44, 46, 45, 46, 45, 45, 45, 46],
    32768: [56, 56, 55, 56, 56, 56, 56, 56, 57, 56],
    49152: [68, 68, 68, 68, 69, 68, 68, 67, 69, 67],
    58880: [80, 81, 80, 78, 80, 80, 81, 79, 80, 80],
    65536: [83, 85, 84, 86, 85, 85, 83, 84, 85, 85],
    67840: [86, 87, 86, 87, 86, 85, 86, 86, 86, 85, 86, 86, 86, 86, 86, 85, 86, 86, 87, 85, 85, 86, 85, 87, 86, 85,
            85, 86],
}
OPTIMIZERS = ('sgd', 'lars', 'rmsprop_warmup')
BN_POINTS = (('group', 1, 'moving_average'), ('group', 2, 'moving_average'), ('group', 4, 'moving_average'),
             ('group', 8, 'moving_average'), ('statistics', 1, 'last_batch'), ('statistics', 1, 'reestimate'))
FIELDS = ('part', 'name', 'optimizer', 'global_batch', 'replicas', 'bn_group_size', 'bn_statistics', 'seed',
          'epochs', 'warmup_epochs', 'steps', 'steps_per_epoch', 'peak_learning_rate', 'top_1', 'epochs_to_target',
          'steps_to_target', 'noise_scale', 'noise_scale_at_target', 'seconds')


def define_flags():
    flags.DEFINE_string('data_dir', 'data/demo', 'Shards of the study (ImageNet-format or TFDS), the demo digits by '
                        'default.')
    flags.DEFINE_string('output_dir', 'runs/batch_study', 'Where the runs, CSV, table and plots go.')
    flags.DEFINE_list('batches', ['32', '64', '128', '256', '512', '1024'], 'Global batches of the scaling part.')
    flags.DEFINE_list('optimizers', list(OPTIMIZERS), 'Optimizers of the scaling part.')
    flags.DEFINE_list('seeds', ['1', '2'], 'Seeds of every point.')
    flags.DEFINE_list('parts', ['scaling', 'bn'], 'Which parts to run.')
    flags.DEFINE_float('epochs', 10, 'Epoch budget of every run of the scaling part.')
    flags.DEFINE_float('bn_epochs', 5, 'Epoch budget of every run of the batch-norm part.')
    flags.DEFINE_float('warmup_fraction', 0.1, 'Share of the budget of linear warm-up.')
    flags.DEFINE_float('target', 0.9, 'Held-out top-1 whose first reaching counts the steps and epochs.')
    flags.DEFINE_integer('depth', 10, 'ResNet depth (docs/benchmarks.md: the default study at 10 and its time, and '
                         'a slower study at 18).')
    flags.DEFINE_integer('image_size', 16, 'Network input side (the demo stores 32 px; at 16 px the differences '
                         'between the optimizers exceed the spread over seeds at 10 epochs).')
    flags.DEFINE_integer('num_classes', 10, 'Classes.')
    flags.DEFINE_integer('num_train_images', 1438, 'Training images (the demo: 1,438).')
    flags.DEFINE_integer('num_eval_images', 359, 'Held-out images (the demo: 359).')
    flags.DEFINE_integer('bn_per_replica', 4, 'Per-replica batch of the batch-norm part (8 replicas).')
    flags.DEFINE_list('points', [], 'Only the points whose names match one of these shell patterns (the names of '
                      'study.csv, e.g. lars-b256-s1 or "bn-*-s2"); the CSV, table and plots then hold those alone.')
    flags.DEFINE_bool('smoke', False, 'A tiny study (ResNet-10, 16 px, 2 epochs, 2 batches, SGD, groups of 2, '
                      'one seed): checks the tool, shows nothing.')


def peak_rate(optimizer: str, batch: int) -> float:
    """The optimizer's source rule for the peak learning rate at global ``batch`` (module docstring)."""
    if optimizer == 'lars':
        return 31.2 * math.sqrt(batch / 32768)
    return 0.1 * batch / 256


def base_config(f, data_dir: str):
    from imagenet_tpu.config import Config
    return Config(data_dir=data_dir, num_classes=f.num_classes, label_offset=1, num_train_images=f.num_train_images,
                  num_eval_images=f.num_eval_images, image_size=f.image_size, depth=f.depth,
                  random_crop_min_area=0.5, random_flip=False, shuffle_buffer=2048, bn_momentum=0.9,
                  train_epochs=f.epochs, warmup_epochs=f.warmup_fraction * f.epochs, lr_decay='cosine',
                  weight_decay=5e-4, strategy='cpu', eval_every_epochs=1, log_every_steps=0,
                  checkpoint_every_steps=10 ** 6, deterministic=False,
                  eval_batch_size=-(-f.num_eval_images // 8) * 8)   # divisible by the 2 or 8 replicas


def points(f) -> list:
    """(part, name, Config overrides) of every run, in the order they are run (seeds innermost)."""
    found = []
    seeds = [int(seed) for seed in f.seeds]
    if 'scaling' in f.parts:
        for optimizer in f.optimizers:
            for batch in (int(b) for b in f.batches):
                for seed in seeds:
                    overrides = dict(optimizer=optimizer, global_batch_size=batch, num_cpu_devices=2, seed=seed,
                                     learning_rate=peak_rate(optimizer, batch), gradient_noise_scale=True)
                    if optimizer == 'lars':
                        overrides.update(momentum=0.9, lars_eeta=0.001)
                    if optimizer == 'rmsprop_warmup':
                        overrides.update(rms_learning_rate=3e-4, alpha_sgd_center_epochs=f.epochs * 10 / 90,
                                         alpha_sgd_period_epochs=f.epochs * 5 / 90, warmup_epochs=0.0)
                    found.append(('scaling', f'{optimizer}-b{batch}-s{seed}', overrides))
    if 'bn' in f.parts:
        for kind, group, statistics_ in (BN_POINTS if not f.smoke else BN_POINTS[1:2]):
            for seed in seeds:
                replicas = 8 if not f.smoke else 2
                found.append(('bn', f'bn-{kind}-g{group}-{statistics_}-s{seed}',
                              dict(optimizer='sgd', global_batch_size=f.bn_per_replica * replicas,
                                   train_epochs=f.bn_epochs, warmup_epochs=f.warmup_fraction * f.bn_epochs,
                                   num_cpu_devices=replicas, bn_group_size=group, bn_inference_statistics=statistics_,
                                   learning_rate=peak_rate('sgd', f.bn_per_replica * replicas), seed=seed)))
    if f.points:
        found = [point for point in found if any(fnmatch.fnmatchcase(point[1], pattern) for pattern in f.points)]
    return found


def epoch_scalars(model_dir: str, split: str, tag: str) -> list:
    """[(epoch, value)] of one of a run's per-epoch TensorBoard scalars (epochs from 1), from its logs of ``split``
    ('train' or 'validation')."""
    import plot_metrics  # pylint: disable=import-outside-toplevel
    scalars = plot_metrics.read_scalars(os.path.join(model_dir, 'logs', split))
    return [(epoch + 1, value) for epoch, value in scalars.get(tag, [])]


def held_out_curve(model_dir: str) -> list:
    """[(epoch, held-out top-1)] of a run, from its TensorBoard validation logs."""
    return epoch_scalars(model_dir, 'validation', 'epoch_top_1')


def noise_scale_curve(model_dir: str) -> dict:
    """{epoch: the run's smoothed gradient noise scale at its end}, from its TensorBoard training logs."""
    return dict(epoch_scalars(model_dir, 'train', 'epoch_noise_scale'))


def fit_knee(points_: list):
    """McCandlish et al. 2018 (eq. 2.11): steps to a target S(B) = S_min (1 + B_crit / B), fitted to [(B, S)] by
    least squares on the relative error (S - S_min - S_min B_crit / B) / S, linear in S_min and S_min B_crit.
    {'steps_min', 'critical_batch', 'batches'}, or None with fewer than 3 batches or no knee in the range
    (S_min <= 0: the steps still fall as fast as 1/B, or faster, at the largest batch; S_min B_crit <= 0: they do
    not fall with the batch at all)."""
    import numpy as np
    if len({batch for batch, _ in points_}) < 3:
        return None
    batches = np.array([batch for batch, _ in points_], dtype=float)
    steps = np.array([steps for _, steps in points_], dtype=float)
    design = np.stack([np.ones_like(batches), 1 / batches], axis=1) / steps[:, None]
    (steps_min, slope), *_ = np.linalg.lstsq(design, np.ones_like(steps), rcond=None)
    if steps_min <= 1e-6 * steps.min() or slope <= 0:     # 1e-6: a pure 1/B curve fits S_min to round-off
        return None
    return {'steps_min': float(steps_min), 'critical_batch': float(slope / steps_min),
            'batches': sorted({int(batch) for batch in batches})}


def finished(config, model_dir: str):
    """The results of a point whose run ended (results.json of all its steps), else None."""
    path = os.path.join(model_dir, 'results.json')
    if os.path.exists(path):
        with open(path) as f:
            done = json.load(f)
        if done.get('steps') == config.train_steps:
            return done
    return None


def run_point(config, model_dir: str) -> dict:
    """Trains one point (resuming it if it was cut short) unless it is finished; its results."""
    from imagenet_tpu import train
    import tf_keras as keras
    done = finished(config, model_dir)
    if done:
        return done
    keras.backend.clear_session()
    started = time.perf_counter()
    results = train.train_and_evaluate(dataclasses.replace(config, model_dir=model_dir), print_fn=lambda line: None)
    results['seconds'] = time.perf_counter() - started
    with open(os.path.join(model_dir, 'results.json'), 'w') as f:
        json.dump(results, f)
    return results


def eta_seconds(trained: list, to_do: list) -> float:
    """Seconds the points of ``to_do`` [(part, steps)] will take, from the points of ``trained`` [(part, steps,
    seconds)]: per part, seconds = a + b x steps fitted to its trained points (a: start-up, evaluations and the
    part's images, the same at every batch; b: a step's fixed cost), a mean per point where the steps do not vary
    (or the fit is not positive), and the other parts' points where a part has none trained yet."""
    import numpy as np
    total = 0.0
    for part in dict.fromkeys(part for part, _ in to_do):
        points_ = [(steps, seconds) for trained_part, steps, seconds in trained if trained_part == part]
        if not points_:
            points_ = [(steps, seconds) for _, steps, seconds in trained]
        steps = np.array([steps for steps, _ in points_], dtype=float)
        seconds = np.array([seconds for _, seconds in points_], dtype=float)
        remaining = np.array([steps_ for part_, steps_ in to_do if part_ == part], dtype=float)
        if len(set(steps)) >= 2:
            (start, per_step), *_ = np.linalg.lstsq(np.stack([np.ones_like(steps), steps], axis=1), seconds,
                                                    rcond=None)
            if start >= 0 and per_step >= 0:
                total += float(np.sum(start + per_step * remaining))
                continue
        total += float(seconds.mean()) * len(remaining)
    return total


def resolved(noise_scale):
    """A noise scale the estimate resolved (positive, finite), rounded; None for NaN or a non-positive value (the
    averaged |G|^2 estimate was not positive: optim/noise_scale.py)."""
    if noise_scale is None or not math.isfinite(noise_scale) or noise_scale <= 0:
        return None
    return round(noise_scale, 1)


def row(part: str, name: str, config, results: dict, curve: list, target: float, noise: dict) -> dict:
    reached = next((epoch for epoch, top_1 in curve if top_1 >= target), None)
    steps = reached * config.steps_per_epoch if reached else None    # Keras's epochs are config.steps_per_epoch steps
    return {'part': part, 'name': name, 'optimizer': config.optimizer, 'global_batch': config.global_batch_size,
            'replicas': config.num_cpu_devices, 'bn_group_size': config.bn_group_size,
            'bn_statistics': config.bn_inference_statistics, 'seed': config.seed, 'epochs': config.train_epochs,
            'warmup_epochs': config.warmup_epochs,
            'steps': results.get('steps'), 'steps_per_epoch': config.steps_per_epoch,
            'peak_learning_rate': round(config.peak_learning_rate, 6), 'top_1': results.get('top_1'),
            'epochs_to_target': round(steps * config.global_batch_size / config.num_train_images, 2) if steps else None,
            'steps_to_target': steps,
            'noise_scale': resolved(results.get('noise_scale')),
            'noise_scale_at_target': resolved(noise.get(reached)),
            'seconds': round(results.get('seconds', 0.0), 1)}


def knees(rows: list) -> dict:
    """{optimizer: fit_knee of its scaling runs that reached the target} (every seed a point of the fit)."""
    found = {}
    for optimizer in dict.fromkeys(item['optimizer'] for item in rows if item['part'] == 'scaling'):
        fit = fit_knee([(item['global_batch'], item['steps_to_target']) for item in rows
                        if item['part'] == 'scaling' and item['optimizer'] == optimizer and item['steps_to_target']])
        if fit:
            found[optimizer] = fit
    return found


def _spread(values: list, digits: int = 1) -> str:
    """'mean (min-max)' of ``values``, or '' for none."""
    if not values:
        return ''
    return f'{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})'


def summarize(rows: list, target: float) -> str:
    """The study's tables: each point's mean and spread (min-max) over seeds; the knee of each optimizer's
    steps-to-target curve beside its noise scale."""
    groups = {}
    for item in rows:
        key = (item['part'], item['optimizer'], item['global_batch'], item['bn_group_size'], item['bn_statistics'])
        groups.setdefault(key, []).append(item)
    lines = [f'| part | optimizer | batch | BN group | BN statistics | held-out top-1 at the budget (mean, min-max) | '
             f'steps to {100 * target:g}% (each seed) | noise scale at the end (mean) | noise scale when the target '
             f'was reached (mean) |', '|---|---|---|---|---|---|---|---|---|']
    for (part, optimizer, batch, group, statistics_), items in groups.items():
        steps = ', '.join(str(item['steps_to_target']) if item['steps_to_target'] else 'not reached' for item in items)
        noise = [item['noise_scale'] for item in items if item['noise_scale'] is not None]
        at_target = [item['noise_scale_at_target'] for item in items if item['noise_scale_at_target'] is not None]
        means = [f'{statistics.mean(values):.0f}' if values else '' for values in (noise, at_target)]
        if part == 'scaling' and len(noise) < len(items):      # the estimate of some runs was not resolved
            means[0] = f'{means[0]} ({len(items) - len(noise)} of {len(items)} not resolved)'.lstrip()
        lines.append(f'| {part} | {optimizer} | {batch} | {group} | {statistics_} | '
                     f'{_spread([100 * item["top_1"] for item in items])} | {steps} | {means[0]} | {means[1]} |')
    fits = knees(rows)
    if fits:
        lines += ['', f'| optimizer | batches fitted | S_min (steps) | critical batch, fitted | noise scale when '
                  f'{100 * target:g}% was reached (mean, min-max) |', '|---|---|---|---|---|']
        for optimizer, fit in fits.items():
            at_target = [item['noise_scale_at_target'] for item in rows if item['optimizer'] == optimizer
                         and item['part'] == 'scaling' and item['noise_scale_at_target'] is not None]
            lines.append(f'| {optimizer} | {", ".join(map(str, fit["batches"]))} | {fit["steps_min"]:.1f} | '
                         f'{fit["critical_batch"]:.0f} | {_spread(at_target, 0)} |')
    return '\n'.join(lines) + '\n'


def plot(rows: list, output_dir: str, target: float) -> list:
    """scaling.png and bn.png; returns the paths written."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    written = []
    scaling = [item for item in rows if item['part'] == 'scaling']
    fits = knees(rows)
    if scaling:
        figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        for optimizer in sorted({item['optimizer'] for item in scaling}):
            batches = sorted({item['global_batch'] for item in scaling if item['optimizer'] == optimizer})
            xs, ys, errors_low, errors_high = [], [], [], []
            for batch in batches:
                steps = [item['steps_to_target'] for item in scaling
                         if item['optimizer'] == optimizer and item['global_batch'] == batch and item['steps_to_target']]
                if steps:
                    xs.append(batch)
                    ys.append(statistics.mean(steps))
                    errors_low.append(ys[-1] - min(steps))
                    errors_high.append(max(steps) - ys[-1])
            if xs:
                line, = left.errorbar(xs, ys, yerr=[errors_low, errors_high], marker='o', capsize=3,
                                      label=optimizer).lines[:1]
                left.plot(xs, [ys[0] * xs[0] / x for x in xs], ':', color='grey')
                fit = fits.get(optimizer)
                if fit:
                    dense = [xs[0] * (xs[-1] / xs[0]) ** (i / 40) for i in range(41)]
                    left.plot(dense, [fit['steps_min'] * (1 + fit['critical_batch'] / x) for x in dense], '--',
                              color=line.get_color(), alpha=0.6,
                              label=f'{optimizer}: S_min (1 + {fit["critical_batch"]:.0f} / B)')
        left.set_xscale('log', base=2)
        left.set_yscale('log')
        left.set_xlabel('global batch')
        left.set_ylabel(f'steps to {100 * target:g}% held-out top-1')
        left.set_title('steps to target (dotted: perfect scaling; dashed: fitted knee)')
        left.legend()
        batches = sorted(MLPERF_EPOCHS)
        right.errorbar(batches, [statistics.median(MLPERF_EPOCHS[b]) for b in batches],
                       yerr=[[statistics.median(MLPERF_EPOCHS[b]) - min(MLPERF_EPOCHS[b]) for b in batches],
                             [max(MLPERF_EPOCHS[b]) - statistics.median(MLPERF_EPOCHS[b]) for b in batches]],
                       marker='s', capsize=3, color='black')
        right.set_xscale('log', base=2)
        right.set_xlabel('global batch')
        right.set_ylabel('epochs to 75.9% top-1')
        right.set_title("ImageNet, MLPerf's reference runs (LARS)")
        figure.tight_layout()
        path = os.path.join(output_dir, 'scaling.png')
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    bn = [item for item in rows if item['part'] == 'bn']
    if bn:
        figure, axis = plt.subplots(figsize=(6, 4.5))
        for statistics_ in sorted({item['bn_statistics'] for item in bn}):
            groups = sorted({item['bn_group_size'] for item in bn if item['bn_statistics'] == statistics_})
            per_replica = bn[0]['global_batch'] // bn[0]['replicas']
            images = [group * per_replica for group in groups]
            tops = [[100 * item['top_1'] for item in bn if item['bn_statistics'] == statistics_
                     and item['bn_group_size'] == group] for group in groups]
            axis.errorbar(images, [statistics.mean(t) for t in tops],
                          yerr=[[statistics.mean(t) - min(t) for t in tops], [max(t) - statistics.mean(t) for t in tops]],
                          marker='o', capsize=3, label=statistics_)
        axis.set_xscale('log', base=2)
        axis.set_xlabel('images per batch-norm group')
        axis.set_ylabel('held-out top-1 at the budget (%)')
        axis.legend(title='inference statistics')
        figure.tight_layout()
        path = os.path.join(output_dir, 'bn.png')
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


def main(argv):
    del argv
    f = flags.FLAGS
    logging.set_verbosity(logging.WARNING)     # TensorFlow's checkpoint lines would drown the progress
    if f.smoke:
        f.depth, f.image_size, f.epochs, f.bn_epochs, f.optimizers, f.seeds = 10, 16, 2, 2, ['sgd'], ['1']
        if not f['batches'].present:
            f.batches = ['32', '64']
    from imagenet_tpu import runtime
    runtime.import_tensorflow()
    from imagenet_tpu.distribute import strategy as strategy_lib
    from imagenet_tpu.errors import Preempted, RunError
    strategy_lib.use_logical_cpus(8)
    if not os.path.isdir(f.data_dir):
        print(f'error: --data_dir {f.data_dir} does not exist (python tools/data/make_demo_data.py --output_dir '
              f'{f.data_dir})', file=sys.stderr)
        return 2
    grid = points(f)
    if not grid:
        print(f'error: no point of the study matches --points={",".join(f.points)}', file=sys.stderr)
        return 2
    os.makedirs(os.path.join(f.output_dir, 'runs'), exist_ok=True)
    base = base_config(f, f.data_dir)
    configs = [dataclasses.replace(base, **overrides) for _, _, overrides in grid]
    model_dirs = [os.path.join(f.output_dir, 'runs', name) for _, name, _ in grid]
    # The ETA (eta_seconds): from the times of the points trained in this call, for the points not finished.
    pending = [not finished(config, model_dir) for config, model_dir in zip(configs, model_dirs)]
    rows, started, trained = [], time.perf_counter(), []
    for index, ((part, name, _), config, model_dir) in enumerate(zip(grid, configs, model_dirs)):
        begun = time.perf_counter()
        try:
            results = run_point(config, model_dir)
        except Preempted:
            print(f'{name}: stopped by SIGTERM after saving it; run the same command again to continue', flush=True)
            return 143
        except RunError as error:     # a point that fails (a diverged run, say) is a row of its own
            print(f'{name}: {error}', flush=True)
            results = {'steps': None, 'top_1': float('nan')}
        if pending[index]:
            trained.append((part, config.train_steps, time.perf_counter() - begun))
        rows.append(row(part, name, config, results, held_out_curve(model_dir), f.target,
                        noise_scale_curve(model_dir)))
        elapsed = time.perf_counter() - started
        to_do = [(grid[later][0], configs[later].train_steps) for later in range(index + 1, len(grid))
                 if pending[later]]
        if trained or not to_do:
            eta = f'ETA {(eta_seconds(trained, to_do) if to_do else 0.0) / 60:.1f} min'
        else:
            eta = 'ETA after the first point trained'
        print(f'[{index + 1}/{len(grid)}] {name}: held-out top-1 {100 * rows[-1]["top_1"]:.1f}%, '
              f'{rows[-1]["steps_to_target"] or "no"} steps to {100 * f.target:g}%'
              + (f', noise scale {rows[-1]["noise_scale"]:.0f}' if rows[-1]['noise_scale'] is not None else '')
              + f'; {elapsed / 60:.1f} min so far, {eta}', flush=True)
    with open(os.path.join(f.output_dir, 'study.csv'), 'w', newline='') as out:
        writer = csv.DictWriter(out, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    table = summarize(rows, f.target)
    with open(os.path.join(f.output_dir, 'study.md'), 'w') as out:
        out.write(table)
    print(table)
    for path in plot(rows, f.output_dir, f.target):
        print(f'wrote {path}')
    print(f'wrote {os.path.join(f.output_dir, "study.csv")}')
    return 0


if __name__ == '__main__':
    define_flags()
    app.run(main)
