"""tools/batch_study.py in its smoke configuration: every point trained, its row in study.csv the run's own
figures (results.json, its held-out curve), the table and plots written, and a second call running nothing again."""

import csv
import json
import os
import subprocess
import sys
import tempfile

import pytest
import tensorflow as tf

import helpers

sys.path.insert(0, os.path.join(helpers.REPO, 'tools', 'plots'))
import plot_metrics  # noqa: E402  pylint: disable=wrong-import-position

TOOL = os.path.join(helpers.REPO, 'tools', 'batch_study.py')


@pytest.mark.slow
class BatchStudyTest(tf.test.TestCase):

    def test_smoke_study_reports_what_its_runs_did_and_resumes(self):
        root = tempfile.mkdtemp(prefix='study-', dir=self.get_temp_dir())
        data_dir, output = os.path.join(root, 'data'), os.path.join(root, 'study')
        helpers.write_dataset(data_dir, num_classes=4)
        command = [sys.executable, TOOL, '--smoke', f'--data_dir={data_dir}', f'--output_dir={output}',
                   '--num_classes=4', '--num_train_images=48', '--num_eval_images=20', '--batches=8,16',
                   '--bn_per_replica=4', '--target=0.3']
        first = subprocess.run(command, capture_output=True, text=True, env=helpers.subprocess_environment(),
                               timeout=600)
        self.assertEqual(first.returncode, 0, first.stderr[-3000:])
        self.assertIn('ETA', first.stdout)
        with open(os.path.join(output, 'study.csv')) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([row['name'] for row in rows],
                         ['sgd-b8-s1', 'sgd-b16-s1', 'bn-group-g1-moving_average-s1', 'bn-group-g2-moving_average-s1'])
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
            self.assertEqual(row['epochs_to_target'] or None, str(reached) if reached else None)
            if row['part'] == 'scaling':
                self.assertAlmostEqual(float(row['noise_scale']), results['noise_scale'], places=3)
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
