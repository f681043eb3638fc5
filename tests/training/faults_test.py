"""Faults a careful user and a hostile machine bring, each as it happens to a run: links planted in model_dir, a
missing or damaged checkpoint state file, a run that diverges, input in which every record fails, a stalled input
and SIGTERM, a finished run started again, two trainers on one model_dir, saves cut short, a full disk.

Unit-level where the behaviour is in one function; real runs (in-process, or a process of the command line)
where it is the run's; the processes are marked slow."""

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu import builders, errors, files, train
from imagenet_tpu.data import input_pipeline
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord
from imagenet_tpu.training import checkpoints, loop, preemption, run_folder, sigterm_saves

helpers.use_eight_cpus()

pytestmark = pytest.mark.faults     # the fault tier: make test-faults


def _outside(root: str) -> str:
    """A folder outside model_dir holding one file: what a planted link points at."""
    outside = os.path.join(root, 'outside')
    os.makedirs(outside, exist_ok=True)
    with open(os.path.join(outside, 'precious.txt'), 'w') as f:
        f.write('keep me')
    return outside


def _small_manager(directory: str, scratch: bool = False) -> tf.train.CheckpointManager:
    network = tf.Module()
    network.variables_ = [tf.Variable(np.ones([3], np.float32))]
    checkpoint = tf.train.Checkpoint(network=network)
    kind = checkpoints.WorkerScratchCheckpoints if scratch else tf.train.CheckpointManager
    return kind(checkpoint, directory, max_to_keep=3, checkpoint_name='ckpt')


class LinksTest(tf.test.TestCase):
    """Nothing outside model_dir is deleted or written through a link."""

    def setUp(self):
        super().setUp()
        self.root = tempfile.mkdtemp(dir=self.get_temp_dir())
        self.outside = _outside(self.root)
        self.model_dir = os.path.join(self.root, 'run')
        os.makedirs(self.model_dir)

    def assert_outside_intact(self):
        self.assertEqual(os.listdir(self.outside), ['precious.txt'])
        with open(os.path.join(self.outside, 'precious.txt')) as f:
            self.assertEqual(f.read(), 'keep me')

    def test_a_worker_scratch_folder_that_is_a_link_is_replaced_not_followed(self):
        scratch = os.path.join(self.model_dir, '.worker-1')
        os.symlink(self.outside, scratch)
        manager = _small_manager(scratch, scratch=True)
        manager.save(checkpoint_number=3)
        self.assert_outside_intact()
        self.assertFalse(os.path.lexists(scratch))

    def test_a_link_inside_a_scratch_folder_is_removed_not_its_target(self):
        scratch = os.path.join(self.model_dir, '.worker-1')
        os.makedirs(scratch)
        os.symlink(self.outside, os.path.join(scratch, 'ckpt-9_temp'))
        os.symlink(os.path.join(self.outside, 'precious.txt'), os.path.join(scratch, 'checkpoint'))
        files.remove_tree(scratch)
        self.assert_outside_intact()
        self.assertFalse(os.path.lexists(scratch))

    def test_the_write_probe_never_writes_through_a_link(self):
        for pid in range(os.getpid() - 2, os.getpid() + 3):
            os.symlink(os.path.join(self.outside, 'precious.txt'), os.path.join(self.model_dir, f'.write_probe-{pid}'))
        run_folder.ensure_writable(self.model_dir)
        self.assert_outside_intact()

    def test_our_files_replace_a_link_instead_of_writing_through_it(self):
        target = os.path.join(self.outside, 'precious.txt')
        os.symlink(target, os.path.join(self.model_dir, 'results.json'))
        files.write_json(os.path.join(self.model_dir, 'results.json'), {'top_1': float('nan'), 'steps': 3})
        self.assert_outside_intact()
        with open(os.path.join(self.model_dir, 'results.json')) as f:
            self.assertEqual(json.load(f), {'top_1': None, 'steps': 3})   # valid JSON: NaN as null

    def test_unfinished_saves_are_removed_at_start_without_following_links(self):
        config = helpers.tiny_config(model_dir=self.model_dir)
        directory = os.path.join(self.model_dir, 'checkpoints')
        os.makedirs(os.path.join(directory, 'ckpt-15_temp'))
        with open(os.path.join(directory, 'ckpt-15_temp', 'part-00000-of-00001.data-00000-of-00001'), 'wb') as f:
            f.write(b'\0' * 1000)
        os.symlink(self.outside, os.path.join(directory, 'ckpt-12_temp'))
        lines = []
        lock = run_folder.prepare_model_dir(config, chief=True, print_fn=lines.append)
        lock.release()
        self.assertEqual(os.listdir(directory), [])
        self.assert_outside_intact()
        self.assertIn('removed 2 unfinished checkpoint saves', lines[0])


class CheckpointStateTest(tf.test.TestCase):
    """Resume finds checkpoints by their .index files, whatever the state file says."""

    def setUp(self):
        super().setUp()
        self.directory = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), 'checkpoints')
        manager = _small_manager(self.directory)
        for step in (24, 27, 30):
            manager.checkpoint.network.variables_[0].assign(np.full([3], step, np.float32))
            manager.save(checkpoint_number=step)
        self.state = os.path.join(self.directory, 'checkpoint')

    def damage(self, kind):
        if kind == 'missing':
            os.remove(self.state)
            return
        with open(self.state, 'rb') as f:
            content = f.read()
        with open(self.state, 'wb') as f:
            f.write({'truncated': content[:len(content) // 3], 'empty': b'',
                     'random bytes': np.random.default_rng(0).bytes(300)}[kind])

    def test_a_missing_or_damaged_state_file_resumes_from_the_newest_checkpoint(self):
        for number, kind in enumerate(('missing', 'truncated', 'empty', 'random bytes')):
            with self.subTest(kind):
                if number:
                    self.setUp()
                self.damage(kind)
                lines = []
                checkpoints.repair_state(self.directory, lines.append)
                self.assertLen(lines, 1)
                manager = _small_manager(self.directory)     # TensorFlow's manager reads the state file
                self.assertEqual(checkpoints.restore_latest(manager, lambda line: None),
                                 f'{self.directory}/ckpt-30')
                self.assertAllEqual(manager.checkpoint.network.variables_[0], [30, 30, 30])
                # The manager knows all three: the next save deletes the oldest only, overwrites none.
                manager.save(checkpoint_number=33)
                self.assertEqual(checkpoints.checkpoint_paths(self.directory),
                                 [f'{self.directory}/ckpt-{step}' for step in (27, 30, 33)])

    def test_a_checkpoint_with_nan_values_is_passed_over(self):
        manager = _small_manager(self.directory)
        manager.checkpoint.network.variables_[0].assign([1.0, np.nan, 2.0])
        manager.save(checkpoint_number=31)     # as an older version wrote them
        lines = []
        self.assertEqual(checkpoints.restore_latest(manager, lines.append), f'{self.directory}/ckpt-30')
        self.assertIn('NaN or infinite', lines[0])


class DivergenceTest(tf.test.TestCase):

    def test_no_checkpoint_holds_a_non_finite_value(self):
        manager = _small_manager(os.path.join(self.get_temp_dir(), 'nan'))
        manager.checkpoint.network.variables_[0].assign([1.0, np.inf, 2.0])
        with self.assertRaisesRegex(errors.TrainingDiverged, 'not saved'):
            checkpoints.save_checkpoint(manager, 5)
        self.assertEqual(checkpoints.checkpoint_paths(manager.directory), [])

    def test_a_diverging_run_stops_at_the_step_that_made_weights_nan_and_saves_only_finite_ones(self):
        root = helpers.class_folder(DivergenceTest)
        # As found: batch norm's moving variance becomes infinite at step 4 and ckpt-4..6 were saved with it.
        config = helpers.tiny_config(data_dir=os.path.join(root, 'data'), num_classes=4, norm='batch_norm',
                                     model_dir=os.path.join(root, 'run'), base_learning_rate=1e6,
                                     checkpoint_every_steps=1, train_epochs=2, eval_every_epochs=100,
                                     input_timeout_minutes=0)
        with self.assertRaisesRegex(errors.TrainingDiverged, 'at step (\\d+)') as raised:
            train.train_and_evaluate(config, print_fn=lambda line: None)
        directory = os.path.join(config.model_dir, 'checkpoints')
        for path in checkpoints.checkpoint_paths(directory):
            reader = tf.train.load_checkpoint(path)
            for name in reader.get_variable_to_shape_map():
                value = reader.get_tensor(name)
                if np.issubdtype(np.asarray(value).dtype, np.floating):
                    self.assertTrue(np.all(np.isfinite(value)), f'{path} {name}')
        # The loss check (callbacks.py) or the check before a save (checkpoints.py) stops it, by machine.
        stopped = int(re.search(r'at step (\d+)', raised.exception.args[0]).group(1))
        self.assertEqual(helpers.latest_checkpoint_step(directory), stopped - 1)


class ResultsTest(tf.test.TestCase):
    """model.json and results.json say only what happened."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = helpers.class_folder(cls)

    def config(self, **overrides):
        settings = dict(data_dir=os.path.join(self.root, 'data'), num_classes=4, model_dir=os.path.join(
            self.root, 'run'), train_epochs=1, eval_every_epochs=100, input_timeout_minutes=0)
        settings.update(overrides)
        return helpers.tiny_config(**settings)

    def test_a_run_that_failed_before_its_first_checkpoint_does_not_bind_model_dir(self):
        empty = os.path.join(self.root, 'empty')
        os.makedirs(empty, exist_ok=True)
        model_dir = os.path.join(self.root, 'failed')
        with self.assertRaises(errors.DataError):
            train.train_and_evaluate(self.config(data_dir=empty, model_dir=model_dir), print_fn=lambda line: None)
        self.assertFalse(os.path.exists(os.path.join(model_dir, 'model.json')))
        run_folder.prepare_model_dir(self.config(model_dir=model_dir, depth=18), chief=True).release()

    def test_a_finished_run_started_again_keeps_its_results(self):
        config = self.config()
        first = train.train_and_evaluate(config, print_fn=lambda line: None)
        lines = []
        again = train.train_and_evaluate(config, print_fn=lines.append)
        self.assertTrue(any('nothing to train' in line for line in lines), lines)
        with open(os.path.join(config.model_dir, 'results.json')) as f:
            saved = json.load(f)          # valid JSON (json.load refuses NaN only with parse_constant; check it)
        for name in ('train_loss', 'images_per_second', 'wall_seconds'):
            self.assertEqual(saved[name], first[name], name)
        self.assertEqual(saved['top_1'], again['top_1'])
        self.assertAllClose(saved['top_1'], first['top_1'])

    def test_a_second_trainer_on_a_model_dir_in_use_is_refused(self):
        config = self.config(model_dir=os.path.join(self.root, 'busy'))
        os.makedirs(config.model_dir, exist_ok=True)
        holder = subprocess.Popen([sys.executable, '-c', (
            'import fcntl, os, sys, time\n'
            f'fd = os.open({os.path.join(config.model_dir, ".lock")!r}, os.O_RDWR | os.O_CREAT)\n'
            'fcntl.flock(fd, fcntl.LOCK_EX)\n'
            'os.write(fd, b"process %d on here" % os.getpid())\n'
            'print("locked", flush=True)\n'
            'time.sleep(60)\n')], stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(holder.stdout.readline().strip(), 'locked')
            with self.assertRaisesRegex(errors.ConfigError, 'is in use by another trainer \\(process'):
                train.train_and_evaluate(config, print_fn=lambda line: None)
        finally:
            holder.kill()                   # a trainer that dies: its lock goes with it
            holder.wait()
        lock = run_folder.ModelDirLock(config.model_dir)
        with self.assertRaisesRegex(errors.ConfigError, 'in use'):
            run_folder.ModelDirLock(config.model_dir)     # the same process, a second trainer
        lock.release()
        run_folder.ModelDirLock(config.model_dir).release()

    def test_damaged_model_json_beside_checkpoints_and_a_checkpoints_file_are_one_line_errors(self):
        model_dir = os.path.join(self.root, 'damaged')
        os.makedirs(os.path.join(model_dir, 'checkpoints'), exist_ok=True)
        open(os.path.join(model_dir, 'checkpoints', 'ckpt-3.index'), 'w').close()
        with open(os.path.join(model_dir, 'model.json'), 'wb') as f:
            f.write(b'{"depth": 10, "num_cl')
        with self.assertRaisesRegex(errors.CheckpointError, 'model.json is damaged'):
            run_folder.prepare_model_dir(self.config(model_dir=model_dir), chief=True)
        shutil.rmtree(os.path.join(model_dir, 'checkpoints'))
        with open(os.path.join(model_dir, 'checkpoints'), 'w') as f:
            f.write('not a folder')
        with self.assertRaisesRegex(errors.ConfigError, 'checkpoints is a file'):
            run_folder.prepare_model_dir(self.config(model_dir=model_dir), chief=True)


class FullDiskTest(tf.test.TestCase):

    def test_a_save_that_fails_is_one_line_and_leaves_no_temporary_files(self):
        manager = _small_manager(os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), 'checkpoints'))
        manager.save(checkpoint_number=3)
        temporary = os.path.join(manager.directory, 'ckpt-6_temp')

        def fill_the_disk(**unused):
            os.makedirs(temporary)
            with open(os.path.join(temporary, 'part-00000-of-00001.data-00000-of-00001'), 'wb') as f:
                f.write(b'\0' * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        with mock.patch.object(manager, 'save', side_effect=fill_the_disk):
            with self.assertRaisesRegex(errors.CheckpointError, 'No space left on device.*before it are intact'):
                checkpoints.save_checkpoint(manager, 6)
        self.assertFalse(os.path.exists(temporary))
        self.assertEqual(checkpoints.checkpoint_paths(manager.directory), [f'{manager.directory}/ckpt-3'])

    def test_a_full_disk_at_start_is_named(self):
        with mock.patch.object(tempfile, 'mkstemp', side_effect=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))):
            with self.assertRaisesRegex(errors.ConfigError, 'not writable \\(No space left on device\\)'):
                run_folder.ensure_writable(self.get_temp_dir())


class AllBadInputTest(tf.test.TestCase):
    """Input in which every record fails stops with one line instead of looping forever."""

    def test_every_record_bad_stops_the_stream_naming_its_files(self):
        data_dir = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), 'bad')
        os.makedirs(data_dir)
        for shard in range(2):
            tfrecord.write_shard(os.path.join(data_dir, tfrecord.shard_name(tfrecord.TRAIN, shard, 2)),
                                 [tfrecord.make_example(b'not a JPEG file' * 10, 1, 20, 24) for _ in range(12)])
        for cache in ('none', 'records'):
            config = helpers.tiny_config(data_dir=data_dir, num_classes=4, label_offset=1, num_train_images=24,
                                         shuffle_buffer=8, input_cache=cache)
            outcome = {}

            def read():
                try:
                    next(iter(input_pipeline.train_dataset(config)))
                except tf.errors.InvalidArgumentError as error:
                    outcome['error'] = error.message

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(60)
            self.assertFalse(reader.is_alive(), f'{cache}: still reading after 60 s')
            self.assertIn(record_io.NO_USABLE_RECORD, outcome.get('error', ''), cache)
            self.assertIn('train-00000-of-00002', outcome['error'])

    def test_the_error_is_one_line_about_the_input(self):
        message = (f'{{function_node __wrapped__IteratorGetNext}} assertion failed: [{record_io.NO_USABLE_RECORD}: '
                   'every record of a whole epoch ... (/d/train-00000-of-00002, /d/train-00001-of-00002)] '
                   '[Condition x < y did not hold] [[{{node assert_less}}]]')
        with self.assertRaisesRegex(errors.DataError, f'^{record_io.NO_USABLE_RECORD}: every record .*of-00002\\)$'):
            with loop.input_errors():
                raise tf.errors.InvalidArgumentError(None, None, message)

    def test_a_step_error_is_not_called_a_bad_record(self):
        message = ('Graph execution error:\n\nDetected at node cond/then/_0 defined at (most recent call last):\n'
                   '  File "train.py", line 10, in fit\n'
                   'Trying to access resource Resource-4 located in device /job:localhost/replica:0/task:0/device:CPU:1 '
                   'from device /job:localhost/replica:0/task:0/device:CPU:0\n'
                   '\t [[{{node cond/then/_0/StatefulPartitionedCall}}]] [Op:__inference_train_function_123]')
        with self.assertRaisesRegex(errors.StepError, '^the step failed: Trying to access resource'):
            with loop.input_errors():
                raise tf.errors.InvalidArgumentError(None, None, message)
        with self.assertRaisesRegex(errors.DataError, '^bad input record: Invalid JPEG data'):
            with loop.input_errors():
                raise tf.errors.InvalidArgumentError(None, None, 'Invalid JPEG data or crop window.\n\t [[{{node '
                                                                 'DecodeAndCropJpeg}}]] [Op:IteratorGetNext]')


class ReportingTest(tf.test.TestCase):

    def test_the_step_outputs_are_not_summed_over_workers(self):
        classifier = builders.build_classifier(helpers.tiny_config())
        self.assertEqual(classifier.distribute_reduction_method, 'first')

    def test_sigterm_during_an_evaluation_saves_and_stops_at_once(self):
        manager = _small_manager(os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), 'checkpoints'))
        callback = sigterm_saves.SaveOnSigterm(manager, print_fn=lambda line: None)
        model = mock.Mock()
        model.optimizer.iterations.numpy.return_value = 7
        callback.set_model(model)
        callback.on_test_batch_end(0)          # no signal: nothing happens
        with mock.patch.object(preemption, 'requested', return_value=True):
            with self.assertRaisesRegex(errors.Preempted, 'at step 7'):
                callback.on_test_batch_end(1)
        self.assertEqual(helpers.latest_checkpoint_step(manager.directory), 7)

    def test_the_watchdog_ends_a_process_whose_input_yields_nothing(self):
        script = ('import time, tf_keras\n'
                  'from imagenet_tpu.training import callbacks\n'
                  'watchdog = callbacks.InputWatchdog(1.0, "the input (x)", poll_seconds=0.1)\n'
                  'watchdog.on_train_begin()\n'
                  'time.sleep(30)\n')
        process = subprocess.run([sys.executable, '-c', script], env=helpers.subprocess_environment(),
                                 capture_output=True, text=True, timeout=120)
        self.assertEqual(process.returncode, 2)
        self.assertRegex(process.stderr.strip().splitlines()[-1],
                         '^error: no training step ended in .* minutes .*the input \\(x\\) yields nothing')

    def test_the_watchdog_covers_an_input_that_hangs_at_start(self):
        # Sizing the shards hangs (a hung network mount): before, nothing watched until fit called back.
        data_dir = os.path.join(helpers.class_folder(type(self)), 'hangs')
        helpers.write_dataset(data_dir, num_train=16, num_validation=8)
        script = textwrap.dedent(f'''
            import time
            from imagenet_tpu import train
            from imagenet_tpu.config import Config
            from imagenet_tpu.data import record_io
            record_io.file_sizes = lambda paths: time.sleep(600)
            train.train_and_evaluate(Config(data_dir={data_dir!r}, depth=10, image_size=16, num_classes=4,
                                            label_offset=1, global_batch_size=8, eval_batch_size=8,
                                            num_train_images=16, num_eval_images=8, strategy='default',
                                            input_timeout_minutes=0.02))
            ''')
        process = subprocess.run([sys.executable, '-c', script], env=helpers.subprocess_environment(),
                                 capture_output=True, text=True, timeout=300)
        self.assertEqual(process.returncode, 2, process.stderr[-2000:])
        self.assertRegex(process.stderr.strip().splitlines()[-1], '^error: the input did not start in .* minutes')

    def test_a_fifo_among_the_shards_is_one_error_at_once(self):
        data_dir = os.path.join(helpers.class_folder(type(self)), 'fifo')
        helpers.write_dataset(data_dir, num_train=16, num_validation=8)
        os.mkfifo(os.path.join(data_dir, 'train-00009-of-00010'))
        with self.assertRaisesRegex(errors.DataError, 'is not a regular file'):
            record_io.file_sizes(record_io.list_shards(data_dir, tfrecord.TRAIN))


def _train_command(*flags):
    return [sys.executable, '-m', 'imagenet_tpu.commands.train', *helpers.small_run_flags(
        global_batch_size=8, eval_batch_size=8, total_steps=30, strategy='cpu', num_cpu_devices=2), *flags]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('localhost', 0))
        return s.getsockname()[1]


@pytest.mark.slow
class SigtermTest(tf.test.TestCase):
    """SIGTERM ends a run within the grace period also when no step can end."""

    def start(self, command, environment=None):
        log = tempfile.NamedTemporaryFile('w+', suffix='.log', delete=False)
        process = subprocess.Popen(command, cwd=helpers.REPO, env=environment or helpers.subprocess_environment(
            PYTHONUNBUFFERED='1'), stdout=log, stderr=subprocess.STDOUT, text=True)
        return process, log

    def wait_for(self, process, log, text, seconds=120):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with open(log.name) as f:
                if text in f.read():
                    return
            self.assertIsNone(process.poll(), open(log.name).read()[-3000:])
            time.sleep(0.2)
        self.fail(f'no {text!r} in {seconds} s')

    def terminate(self, process, log, within):
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = process.wait(within + 30)
        took = time.monotonic() - started
        with open(log.name) as f:
            return code, took, f.read()

    def test_a_stalled_input_and_sigterm_exit_143_within_the_grace_period(self):
        root = helpers.class_folder(SigtermTest)
        dispatcher = tf.data.experimental.service.DispatchServer(
            tf.data.experimental.service.DispatcherConfig(port=_free_port(), protocol='grpc'))   # no workers
        process, log = self.start(_train_command(
            f'--data_dir={os.path.join(root, "data")}', f'--model_dir={os.path.join(root, "run")}',
            f'--data_service={dispatcher.target}', '--termination_grace_seconds=3'))
        self.wait_for(process, log, 'steps/epoch')
        time.sleep(3)                                # waiting for batches that never come
        code, took, text = self.terminate(process, log, within=3)
        self.assertEqual(code, 143, text[-3000:])
        self.assertLess(took, 60)       # a hang, not a speed: the grace is 3 s, a loaded machine is slow to exit
        self.assertIn('error: SIGTERM: training did not stop within 3 s', text)

    def test_a_worker_waiting_for_its_peers_exits_on_sigterm(self):
        root = helpers.class_folder(SigtermTest)
        ports = [_free_port(), _free_port()]
        tf_config = json.dumps({'cluster': {'worker': [f'127.0.0.1:{port}' for port in ports]},
                                'task': {'type': 'worker', 'index': 0}})
        process, log = self.start(
            _train_command(f'--data_dir={os.path.join(root, "data")}', f'--model_dir={os.path.join(root, "lone")}',
                           '--strategy=multi_worker', '--cpu_devices_per_worker=1'),
            helpers.subprocess_environment(PYTHONUNBUFFERED='1', TF_CONFIG=tf_config))
        self.wait_for(process, log, 'waiting for 1 of the 1 other tasks of TF_CONFIG to start')
        time.sleep(1)
        code, took, text = self.terminate(process, log, within=1)
        self.assertEqual(code, 143, text[-3000:])
        self.assertLess(took, 60)
        self.assertIn('error: stopped by SIGTERM (before training started; nothing to save)', text)
        self.assertNotIn('Traceback', text)

    def test_ctrl_c_saves_and_stops_like_sigterm(self):
        root = helpers.class_folder(SigtermTest)
        model_dir = os.path.join(root, 'interrupted')
        helpers.write_dataset(os.path.join(root, 'shards'))
        process, log = self.start(_train_command(f'--data_dir={os.path.join(root, "shards")}',
                                                 f'--model_dir={model_dir}', '--log_every_steps=1'))
        self.wait_for(process, log, 'step 2/')
        process.send_signal(signal.SIGINT)
        code = process.wait(120)
        with open(log.name) as f:
            text = f.read()
        self.assertEqual(code, 130, text[-3000:])
        saved = int(re.search(r'SIGINT: saved step (\d+)', text).group(1))
        self.assertEqual(helpers.latest_checkpoint_step(os.path.join(model_dir, 'checkpoints')), saved)
        self.assertIn('stopped by SIGINT at step', text)
        self.assertNotIn('Traceback', text)
        self.assertNotIn('KeyboardInterrupt', text)

    def test_a_workers_port_given_as_the_data_service_is_one_line(self):
        # A tf.data service worker answers on its port, but not as a dispatcher: the client would wait for ever.
        root = helpers.class_folder(SigtermTest)
        dispatcher = tf.data.experimental.service.DispatchServer(
            tf.data.experimental.service.DispatcherConfig(port=_free_port(), protocol='grpc'))
        port = _free_port()
        self.served_by = tf.data.experimental.service.WorkerServer(     # alive for the rest of the test
            tf.data.experimental.service.WorkerConfig(
                dispatcher_address=dispatcher.target.split('://')[1], port=port, protocol='grpc'))
        address = f'grpc://localhost:{port}'

        helpers.write_dataset(os.path.join(root, 'served'))
        result = subprocess.run(_train_command(f'--data_dir={os.path.join(root, "served")}',
                                               f'--data_service={address}', '--input_timeout_minutes=0.05'),
                                env=helpers.subprocess_environment(), capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 2, result.stderr[-3000:])
        self.assertRegex(result.stderr.strip().splitlines()[-1],
                         "^error: (the tf.data service at .* did not take the dataset|the input did not start|no "
                         "training step ended)")
        self.assertNotIn('Traceback', result.stderr)

    def test_a_flagfile_that_is_no_file_is_one_line(self):
        for path in ('/dev/zero',):      # a missing one: tests/commands/common_test.py
            result = subprocess.run(_train_command(f'--flagfile={path}'), env=helpers.subprocess_environment(),
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 2, result.stderr[-2000:])
            self.assertRegex(result.stderr.strip().splitlines()[-1], f'^error: .*--flagfile.*{path}')


if __name__ == '__main__':
    tf.test.main()
