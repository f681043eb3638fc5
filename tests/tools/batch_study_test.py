"""tools/batch_study.py in its smoke configuration: every point trained, its row in study.csv the run's own
figures (results.json, its held-out curve), the table and plots written, and a second call running nothing again."""

import csv
import json
import os
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest
import tensorflow as tf

import helpers

sys.path.insert(0, os.path.join(helpers.REPO, 'tools', 'plots'))
import plot_metrics  # noqa: E402  pylint: disable=wrong-import-position

TOOL = os.path.join(helpers.REPO, 'tools', 'batch_study.py')
sys.path.insert(0, os.path.join(helpers.REPO, 'tools'))
import batch_study  # noqa: E402  pylint: disable=wrong-import-position


class KneeFitTest(tf.test.TestCase):
    """The knee of steps against batch (McCandlish et al. 2018, eq. 2.11) recovered from curves of known form."""

    def test_recovers_the_critical_batch_of_an_exact_curve_and_of_a_noisy_one(self):
        batches = [32, 32, 64, 64, 128, 128, 256, 256, 512, 512]
        exact = batch_study.fit_knee([(b, 90 * (1 + 150 / b)) for b in batches])
        self.assertAllClose([exact['steps_min'], exact['critical_batch']], [90, 150], rtol=1e-9)
        self.assertEqual(exact['batches'], [32, 64, 128, 256, 512])
        rng = np.random.default_rng(0)
        noisy = batch_study.fit_knee([(b, 90 * (1 + 150 / b) * rng.uniform(0.95, 1.05)) for b in batches])
        self.assertAllClose(noisy['critical_batch'], 150, rtol=0.25)

    def test_no_knee_where_steps_fall_as_fast_as_the_batch_grows_or_rise_or_too_few_batches(self):
        self.assertIsNone(batch_study.fit_knee([(b, 4000 / b) for b in (32, 64, 128, 256)]))
        self.assertIsNone(batch_study.fit_knee([(b, 4000 / b * (1 + 1e-9 * b)) for b in (32, 64, 128, 256)]))
        self.assertIsNone(batch_study.fit_knee([(b, 50 + b / 8) for b in (32, 64, 128, 256)]))   # rising
        self.assertIsNone(batch_study.fit_knee([(32, 100), (64, 60), (64, 62)]))

    def test_the_table_names_each_fitted_knee(self):
        rows = [dict(part='scaling', optimizer='sgd', global_batch=b, bn_group_size=1, bn_statistics='moving_average',
                     top_1=0.9, steps_to_target=round(50 * (1 + 100 / b)), noise_scale=120.0,
                     noise_scale_at_target=100.0 + b) for b in (32, 64, 128, 256)]
        table = batch_study.summarize(rows, 0.9)
        fit = batch_study.fit_knee([(item['global_batch'], item['steps_to_target']) for item in rows])
        self.assertIn(f'| sgd | 32, 64, 128, 256 | {fit["steps_min"]:.1f} | {fit["critical_batch"]:.0f} | '
                      '220 (132-356) |', table)
        self.assertIn('| scaling | sgd | 64 | 1 | moving_average | 90.0 (90.0-90.0) | 128 | 120 | 164 |', table)


class PointsTest(tf.test.TestCase):
    """--points: the grid's points whose names match a pattern, in the grid's order."""

    def test_patterns_select_points_by_name(self):
        settings = dict(seeds=['1', '2'], parts=['scaling', 'bn'], optimizers=['sgd', 'lars'], batches=['32', '64'],
                        epochs=10, bn_epochs=5, warmup_fraction=0.1, bn_per_replica=4, smoke=False)
        every = [name for _, name, _ in batch_study.points(types.SimpleNamespace(points=[], **settings))]
        self.assertLen(every, 2 * 2 * 2 + len(batch_study.BN_POINTS) * 2)
        chosen = batch_study.points(types.SimpleNamespace(points=['lars-b64-s1', 'bn-*-s2'], **settings))
        self.assertEqual([name for _, name, _ in chosen],
                         ['lars-b64-s1'] + [name for name in every if name.startswith('bn-') and name.endswith('-s2')])
        self.assertEqual(batch_study.points(types.SimpleNamespace(points=['nothing'], **settings)), [])


@pytest.mark.slow
class EtaTest(tf.test.TestCase):
    """The study's ETA against fake timings of a known form."""

    def test_start_up_and_step_costs_are_fitted_per_part(self):
        # Scaling points take 30 s + 0.2 s a step; batch-norm points (one step count) 150 s each.
        trained = [('scaling', steps, 30 + 0.2 * steps) for steps in (449, 225, 112)] + [('bn', 225, 150.0)]
        to_do = [('scaling', 56), ('scaling', 28), ('bn', 225), ('bn', 225)]
        self.assertAlmostEqual(batch_study.eta_seconds(trained, to_do), 30 + 0.2 * 56 + 30 + 0.2 * 28 + 2 * 150)
        # A part with nothing trained yet: the fit of the other parts' points.
        self.assertAlmostEqual(batch_study.eta_seconds(trained[:2], [('bn', 225)]), 30 + 0.2 * 225)
        self.assertAlmostEqual(batch_study.eta_seconds(trained[:1], [('bn', 225)]), 30 + 0.2 * 449)
        # Times that fall with the steps (a fit with a negative slope): the part's mean per point instead.
        self.assertAlmostEqual(batch_study.eta_seconds([('scaling', 10, 50.0), ('scaling', 20, 40.0)],
                                                       [('scaling', 30)]), 45.0)


class BatchStudyTest(tf.test.TestCase):

    def test_smoke_study_reports_what_its_runs_did_and_resumes(self):
        root = tempfile.mkdtemp(prefix='study-', dir=self.get_temp_dir())
        data_dir, output = os.path.join(root, 'data'), os.path.join(root, 'study')
        helpers.write_dataset(data_dir, num_classes=4)
        command = [sys.executable, TOOL, '--smoke', f'--data_dir={data_dir}', f'--output_dir={output}',
                   '--num_classes=4', '--num_train_images=48', '--num_eval_images=20', '--batches=16',
                   '--bn_per_replica=4', '--target=0.3']
        first = subprocess.run(command, capture_output=True, text=True, env=helpers.subprocess_environment(),
                               timeout=600)
        self.assertEqual(first.returncode, 0, first.stderr[-3000:])
        self.assertIn('ETA', first.stdout)
        with open(os.path.join(output, 'study.csv')) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([row['name'] for row in rows],
                         ['sgd-b16-s1', 'bn-group-g2-moving_average-s1'])
        for row in rows:
            model_dir = os.path.join(output, 'runs', row['name'])
            with open(os.path.join(model_dir, 'results.json')) as f:
                results = json.load(f)
            self.assertAlmostEqual(float(row['top_1']), results['top_1'], places=6)
            self.assertEqual(int(row['steps']), results['steps'])
            self.assertEqual(int(row['steps']), 2 * int(row['steps_per_epoch']))
            curve = plot_metrics.read_scalars(os.path.join(model_dir, 'logs', 'validation'))['epoch_top_1']
            self.assertLen(curve, 2)                      # evaluated after each of the 2 epochs
            reached = next((epoch + 1 for epoch, top_1 in curve if top_1 >= 0.3), None)
            if reached:     # data epochs: the steps' images over the training images (48)
                self.assertAlmostEqual(float(row['epochs_to_target']),
                                       reached * int(row['steps_per_epoch']) * int(row['global_batch']) / 48, places=2)
            else:
                self.assertEqual(row['epochs_to_target'], '')
            if row['part'] == 'scaling':
                expected = results.get('noise_scale')       # None where the run's estimate was not resolved
                if expected is not None and expected > 0:
                    self.assertAlmostEqual(float(row['noise_scale']), expected, places=1)
                else:
                    self.assertEqual(row['noise_scale'], '')
                if reached:
                    noise = dict(plot_metrics.read_scalars(os.path.join(model_dir, 'logs', 'train'))[
                        'epoch_noise_scale'])[reached - 1]
                    self.assertEqual(row['noise_scale_at_target'], f'{round(noise, 1)}' if noise > 0 else '')
                self.assertAlmostEqual(float(row['peak_learning_rate']), 0.1 * int(row['global_batch']) / 256)
        for name in ('study.md', 'scaling.png', 'bn.png'):
            self.assertTrue(os.path.getsize(os.path.join(output, name)) > 0, name)
        times = {row['name']: os.path.getmtime(os.path.join(output, 'runs', row['name'], 'results.json'))
                 for row in rows}
        second = subprocess.run(command, capture_output=True, text=True, env=helpers.subprocess_environment(),
                                timeout=600)
        self.assertEqual(second.returncode, 0, second.stderr[-3000:])
        self.assertEqual({name: os.path.getmtime(os.path.join(output, 'runs', name, 'results.json'))
                          for name in times}, times)          # finished points are not run again
        with open(os.path.join(output, 'study.csv')) as f:
            self.assertEqual([row['top_1'] for row in csv.DictReader(f)], [row['top_1'] for row in rows])
