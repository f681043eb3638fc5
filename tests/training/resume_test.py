"""Runs that survive: kill -9 at a random moment, then SIGTERM, each followed by the same command, end with the
same weights as an uninterrupted run; a damaged or half-written checkpoint is passed over; memory is steady.

Real processes of the command line on a tiny ResNet (2 logical CPU replicas, 16x16 images), --deterministic.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu.training import checkpoints
from imagenet_tpu import errors
from imagenet_tpu import builders
from imagenet_tpu.config import Config

helpers.use_eight_cpus()

REPO = helpers.REPO
STEPS = 60      # 10 epochs of 6 steps
RUN = helpers.small_run_flags(global_batch_size=8, eval_batch_size=8, total_steps=STEPS, strategy='cpu',
                              num_cpu_devices=2, checkpoint_every_steps=4, deterministic=True, seed=1,
                              eval_every_epochs=100, log_every_steps=1, shuffle_buffer=16, learning_rate=0.05,
                              warmup_epochs=1)
TIMEOUT = 240


def command(data_dir, model_dir):
    return [sys.executable, '-m', 'imagenet_tpu.commands.train', f'--data_dir={data_dir}', f'--model_dir={model_dir}', *RUN]


def environment():
    return helpers.subprocess_environment(PYTHONUNBUFFERED='1')


def run(data_dir, model_dir):
    process = subprocess.run(command(data_dir, model_dir), cwd=REPO, env=environment(), capture_output=True,
                             text=True, timeout=TIMEOUT)
    return process.returncode, process.stdout, process.stderr


def start(data_dir, model_dir, log_path):
    log = open(log_path, 'w')
    return subprocess.Popen(command(data_dir, model_dir), cwd=REPO, env=environment(), stdout=log,
                            stderr=subprocess.STDOUT, text=True), log


def latest_step(model_dir) -> int:
    return helpers.latest_checkpoint_step(os.path.join(model_dir, 'checkpoints'))


def wait_for_checkpoint(process, model_dir, step):
    deadline = time.time() + TIMEOUT
    while latest_step(model_dir) < step:
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            raise AssertionError(f'no checkpoint of step {step} (exit {process.poll()})')
        time.sleep(0.05)


def wait_for_line(process, log_path, pattern):
    """The first match of ``pattern`` in the log a running process writes."""
    deadline = time.time() + TIMEOUT
    while True:
        with open(log_path) as f:
            found = re.search(pattern, f.read())
        if found:
            return found
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            raise AssertionError(f'no line matching {pattern!r} (exit {process.poll()})')
        time.sleep(0.05)


def final_weights(model_dir) -> dict:
    """Every variable of the last checkpoint (network, BN statistics, optimizer slots and step)."""
    return helpers.checkpoint_variables(os.path.join(model_dir, 'checkpoints'))


def steps_printed(log_text) -> list:
    return [int(step) for step in re.findall(r'step (\d+)/\d+', log_text)]


@pytest.mark.slow
class ResumeTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = helpers.class_folder(cls)
        cls.data_dir = os.path.join(cls.root, 'data')
        cls.reference_dir = os.path.join(cls.root, 'uninterrupted')
        code, cls.reference_out, stderr = run(cls.data_dir, cls.reference_dir)
        assert code == 0, stderr[-3000:]
        cls.reference = final_weights(cls.reference_dir)

    def assert_same_weights(self, model_dir):
        """Weights, optimizer slots and step bit-identical to the uninterrupted run's. Batch-norm moving
        statistics to float32 rounding: Keras keeps them per replica (synchronization ON_READ) and a checkpoint
        stores their replica mean, so a resumed run restarts every replica from that mean; the averages are
        the same sums in another order."""
        weights = final_weights(model_dir)
        self.assertEqual(sorted(weights), sorted(self.reference))
        with open(os.path.join(model_dir, 'results.json')) as f:
            self.assertEqual(json.load(f)['steps'], STEPS)
        exact, moving, elementwise = {}, {}, {}
        for name, value in weights.items():
            if name.startswith('save_counter'):    # how many saves, not state: a SIGTERM adds one
                continue
            difference = np.abs(value.astype(np.float64) - self.reference[name])
            if '/moving_' in name:
                # Relative to the tensor's scale: rounding in a sum of channels' statistics is a fraction of
                # their magnitude, so one channel whose mean is near 0 must not read as a large relative error.
                moving[name] = float(np.max(difference) / max(np.max(np.abs(self.reference[name])), 1e-3))
                elementwise[name] = float(np.max(difference / np.maximum(np.abs(self.reference[name]), 1e-3)))
            else:
                exact[name] = float(np.max(difference))
        worst = max(exact.values())
        print(f'{model_dir}: largest difference from the uninterrupted run over {len(exact)} weights and slots: '
              f'{worst}; largest relative difference of {len(moving)} BN moving statistics: '
              f'{max(moving.values()):.2e} of the tensor scale ({max(elementwise.values()):.2e} element by element)')
        self.assertEqual(worst, 0.0, sorted(exact.items(), key=lambda item: -item[1])[:5])
        self.assertLess(max(moving.values()), 1e-5)

    def test_kill_9_at_a_random_moment_then_sigterm_each_followed_by_the_same_command_end_with_the_same_weights(
            self):
        # One model_dir through both interruptions (each then the same command), so the run ends once: (1) kill -9
        # at a random moment after the checkpoint of step 12; (2) the same command resumes, and gets SIGTERM after
        # its checkpoint of step 24: it saves the step it is at and exits with 143; (3) the same command finishes.
        model_dir = os.path.join(self.root, 'interrupted')
        killed_log = os.path.join(self.root, 'killed.log')
        process, log = start(self.data_dir, model_dir, killed_log)
        wait_for_checkpoint(process, model_dir, 12)
        time.sleep(random.Random(os.getpid()).uniform(0.0, 0.5))   # anywhere: mid-step, mid-save
        process.send_signal(signal.SIGKILL)
        process.wait(TIMEOUT)
        log.close()
        with open(killed_log) as f:
            reached = max(steps_printed(f.read()))

        preempted_log = os.path.join(self.root, 'preempted.log')
        process, log = start(self.data_dir, model_dir, preempted_log)
        # Its own checkpoint two intervals after the step it resumed at (the killed run may have left ckpt-24).
        resumed = int(wait_for_line(process, preempted_log, r'resumed from \S+ckpt-\d+ at step (\d+)').group(1))
        wait_for_checkpoint(process, model_dir, max(24, resumed + 8))
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        self.assertEqual(process.wait(TIMEOUT), 143)
        log.close()
        with open(preempted_log) as f:
            text = f.read()
        print(f'killed after step {reached}; resumed at step {resumed}: {reached - resumed} steps replayed')
        self.assertBetween(reached - resumed, 0, 4 + 1)   # at most one checkpoint interval (and the step running)
        saved = int(re.search(r'SIGTERM: saved step (\d+)', text).group(1))
        self.assertIn(f'stopped by SIGTERM at step {saved}', text)
        self.assertEqual(latest_step(model_dir), saved)     # nothing lost: the step it was at is the checkpoint
        self.assertGreaterEqual(saved, max(steps_printed(text)))

        code, out, stderr = run(self.data_dir, model_dir)
        self.assertEqual(code, 0, stderr[-3000:])
        self.assertIn(f'at step {saved}', out)
        self.assert_same_weights(model_dir)

    def test_memory_is_steady_over_epochs(self):
        memory = [float(m.replace(',', '')) for m in re.findall(r'memory ([\d,]+) MiB', self.reference_out)]
        self.assertLen(memory, STEPS // 6)
        print('resident memory by epoch (MiB):', memory)
        # Memory grows while buffers and allocator pools fill in the first epochs, then holds: from epoch 4 on
        # its trend is under 30 MiB per epoch (seen: 2-16). Epoch-to-epoch noise is up to 70 MiB, so the trend,
        # not the range; the leak this guards against (new malloc arenas for each data epoch's threads, before
        # runtime.limit_malloc_arenas) added about 90 MiB per epoch.
        slope = np.polyfit(np.arange(3, len(memory)), memory[3:], 1)[0]
        self.assertLess(slope, 30.0, memory)


class CheckpointAtomicityTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.model_dir = os.path.join(self.get_temp_dir(), f'atomic-{self.id().rsplit(".", 1)[1]}')
        config = Config(depth=10, image_size=16, num_classes=4, global_batch_size=8, model_dir=self.model_dir)
        self.classifier = builders.build_classifier(config)
        self.manager = checkpoints.checkpoint_manager(self.classifier, self.model_dir)
        self.classifier.optimizer.iterations.assign(4)
        checkpoints.save_checkpoint(self.manager, 4)
        self.saved = [w.copy() for w in self.classifier.network.get_weights()]
        self.classifier.optimizer.iterations.assign(8)
        for variable in self.classifier.network.weights:
            variable.assign(variable + 1.0)

    def restore(self):
        messages = []
        path = checkpoints.restore_latest(self.manager, messages.append)
        return path, messages

    def test_a_crash_while_writing_resumes_from_the_newest_complete_checkpoint(self):
        # A save cut short: the files of step 8 written, the directory's state file not yet updated, and the
        # temporary folder of a save that died earlier still there. Checkpoints are found by their .index files:
        # the complete ckpt-8 is the newest (the state file is only TensorFlow's hint); the folder is passed over.
        expected = [w.copy() for w in self.classifier.network.get_weights()]
        self.manager.checkpoint.write(os.path.join(self.manager.directory, 'ckpt-8'))
        os.makedirs(os.path.join(self.manager.directory, 'ckpt-12_temp'))
        with open(os.path.join(self.manager.directory, 'ckpt-12_temp', 'part-00000-of-00001.data-00000-of-00001'),
                  'wb') as f:
            f.write(b'half')
        path, messages = self.restore()
        self.assertEqual(os.path.basename(path), 'ckpt-8')
        self.assertEqual(messages, [])
        self.assertEqual(int(self.classifier.optimizer.iterations.numpy()), 8)
        for restored, saved in zip(self.classifier.network.get_weights(), expected):
            self.assertAllEqual(restored, saved)

    def test_a_crash_while_writing_the_index_leaves_the_previous_checkpoint_latest(self):
        self.manager.checkpoint.write(os.path.join(self.manager.directory, 'ckpt-8'))
        with open(os.path.join(self.manager.directory, 'ckpt-8.index'), 'r+b') as f:
            f.truncate(20)
        path, messages = self.restore()
        self.assertEqual(os.path.basename(path), 'ckpt-4')
        self.assertLen(messages, 1)
        self.assertEqual(int(self.classifier.optimizer.iterations.numpy()), 4)
        for restored, saved in zip(self.classifier.network.get_weights(), self.saved):
            self.assertAllEqual(restored, saved)

    def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(self):
        checkpoints.save_checkpoint(self.manager, 8)
        data = [name for name in os.listdir(self.manager.directory) if name.startswith('ckpt-8.data')]
        with open(os.path.join(self.manager.directory, data[0]), 'r+b') as f:
            f.truncate(100)
        path, messages = self.restore()
        self.assertEqual(os.path.basename(path), 'ckpt-4')
        self.assertLen(messages, 1)
        self.assertRegex(messages[0], r'cannot read .*ckpt-8 .*trying the checkpoint before it')
        self.assertEqual(int(self.classifier.optimizer.iterations.numpy()), 4)

    def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(self):
        for name in os.listdir(self.manager.directory):
            if '.data' in name:
                with open(os.path.join(self.manager.directory, name), 'r+b') as f:
                    f.truncate(10)
        with self.assertRaisesRegex(errors.CheckpointError, 'none of the 1 checkpoints in .* can be read'):
            self.restore()

    def test_relative_model_dir(self):
        os.chdir(os.path.dirname(self.model_dir))
        relative = os.path.basename(self.model_dir)
        manager = checkpoints.checkpoint_manager(self.classifier, relative)
        self.assertEqual(os.path.basename(checkpoints.restore_latest(manager)), 'ckpt-4')


if __name__ == '__main__':
    tf.test.main()
