"""The run folder's promise: nothing outside --model_dir is deleted whatever its name or its state file says, and
no silent wrong resume (a second hostile pass: a model_dir named exp[1], a crafted state file, checkpoints gone,
another batch, epoch or label offset)."""

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import tensorflow as tf

import helpers
from imagenet_tpu import errors, train
from imagenet_tpu.data import record_io, tfrecord
from imagenet_tpu.plan import scaling
from imagenet_tpu.training import checkpoints, loop, run_folder


pytestmark = pytest.mark.faults     # the fault tier: make test-faults


def fake_checkpoint(directory: str, step: int) -> list:
    """The two files of a checkpoint ckpt-STEP written by another run (contents do not matter here)."""
    os.makedirs(directory, exist_ok=True)
    names = [f'ckpt-{step}.index', f'ckpt-{step}.data-00000-of-00001']
    for name in names:
        with open(os.path.join(directory, name), 'w') as f:
            f.write('another run')
    return names


class RotationTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = self.get_temp_dir()

    def rotate(self, directory: str, saves: int = 4):
        manager = checkpoints.RunCheckpoints(tf.train.Checkpoint(v=tf.Variable(1.0)), directory, max_to_keep=2,
                                             checkpoint_name='ckpt')
        for step in range(1, saves + 1):
            manager.save(checkpoint_number=step)
        return manager

    def test_a_model_dir_named_with_glob_characters_leaves_its_sibling_alone(self):
        sibling = os.path.join(self.root, 'runs', 'exp1', 'checkpoints')
        kept = fake_checkpoint(sibling, 1) + fake_checkpoint(sibling, 2)
        own = os.path.join(self.root, 'runs', 'exp[1]', 'checkpoints')
        self.rotate(own)
        self.assertEqual(sorted(os.listdir(sibling)), sorted(kept))
        # and its own rotation works: the 2 newest are kept
        self.assertEqual([os.path.basename(p) for p in checkpoints.checkpoint_paths(own)], ['ckpt-3', 'ckpt-4'])

    def test_a_state_file_naming_files_elsewhere_never_has_them_deleted(self):
        elsewhere = os.path.join(self.root, 'elsewhere')
        planted = fake_checkpoint(elsewhere, 1) + fake_checkpoint(elsewhere, 2)
        own = os.path.join(self.root, 'run', 'checkpoints')
        self.rotate(own, saves=1)
        with open(os.path.join(own, 'checkpoint'), 'w') as f:     # crafted: absolute paths to another folder
            f.write(f'model_checkpoint_path: "{own}/ckpt-1"\n'
                    f'all_model_checkpoint_paths: "{elsewhere}/ckpt-1"\n'
                    f'all_model_checkpoint_paths: "{elsewhere}/ckpt-2"\n'
                    f'all_model_checkpoint_paths: "{own}/ckpt-1"\n')
        checkpoints.repair_state(own, print_fn=lambda line: None)    # what prepare_model_dir does at start
        self.rotate(own, saves=4)
        self.assertEqual(sorted(os.listdir(elsewhere)), sorted(planted))
        # without the repair, the manager alone still deletes nothing outside its folder
        with open(os.path.join(own, 'checkpoint'), 'w') as f:
            f.write(f'model_checkpoint_path: "{own}/ckpt-4"\nall_model_checkpoint_paths: "{elsewhere}/ckpt-1"\n'
                    f'all_model_checkpoint_paths: "{elsewhere}/ckpt-2"\nall_model_checkpoint_paths: "{own}/ckpt-4"\n')
        self.rotate(own, saves=6)
        self.assertEqual(sorted(os.listdir(elsewhere)), sorted(planted))

    def test_checkpoints_gone_but_named_by_the_state_file_is_refused(self):
        own = os.path.join(self.root, 'gone', 'checkpoints')
        self.rotate(own, saves=2)
        for name in os.listdir(own):
            if name.startswith('ckpt-'):
                os.remove(os.path.join(own, name))
        config = helpers.tiny_config(model_dir=os.path.dirname(own))
        with self.assertRaisesRegex(errors.CheckpointError, 'names 2 checkpoints .* none of their files is there'):
            run_folder.prepare_model_dir(config, chief=True)


class DataDirNameTest(tf.test.TestCase):

    def test_a_data_dir_named_with_glob_characters_is_read_as_named(self):
        root = self.get_temp_dir()
        helpers.write_dataset(os.path.join(root, 'set1'), num_train=8, num_validation=4, train_shards=2)
        os.makedirs(os.path.join(root, 'set[1]'))
        with self.assertRaisesRegex(errors.DataError, r'no train files .* in --data_dir .*set\[1\]'):
            record_io.list_shards(os.path.join(root, 'set[1]'), tfrecord.TRAIN)
        helpers.write_dataset(os.path.join(root, 'set[1]'), num_train=6, num_validation=4, train_shards=3)
        self.assertLen(record_io.list_shards(os.path.join(root, 'set[1]'), tfrecord.TRAIN), 3)


class ResumeSettingsTest(tf.test.TestCase):

    def test_another_batch_epoch_or_label_offset_is_refused_on_resume_not_on_evaluation(self):
        model_dir = self.get_temp_dir()
        config = helpers.tiny_config(model_dir=model_dir, global_batch_size=256, num_train_images=1000)
        run_folder.record_run(config)
        fake_checkpoint(os.path.join(model_dir, 'checkpoints'), 3)
        for changed, message in ((dict(global_batch_size=32), 'count steps of 256 images; --global_batch_size=32 '
                                  'would resume at the wrong point: start a new --model_dir or pass '
                                  '--global_batch_size=256'),
                                 (dict(num_train_images=2000), 'epochs are 1000 images'),
                                 (dict(label_offset=0), 'trained with --label_offset=1; 0 would shift every class')):
            other = helpers.tiny_config(**{**dict(model_dir=model_dir, global_batch_size=256,
                                                  num_train_images=1000), **changed})
            with self.assertRaisesRegex(errors.CheckpointError, message):
                run_folder.check_model_settings(other, model_dir)
            run_folder.check_model_settings(other, model_dir, resuming=False)     # evaluating reads weights only


if __name__ == '__main__':
    tf.test.main()


class BadSettingsTest(tf.test.TestCase):

    def test_non_finite_numbers_and_no_training_are_refused(self):
        for name, value in (('train_epochs', float('nan')), ('warmup_epochs', float('nan')),
                            ('read_buffer_mb', float('nan')), ('input_timeout_minutes', float('nan')),
                            ('termination_grace_seconds', float('nan')), ('base_learning_rate', float('inf')),
                            ('lr_decay_epochs', (30.0, float('nan')))):
            with self.assertRaisesRegex(errors.ConfigError, f'--{name} must be a finite number'):
                helpers.tiny_config(**{name: value})
        for epochs in (0.0, -1.0):
            with self.assertRaisesRegex(errors.ConfigError, '--train_epochs must be above 0'):
                helpers.tiny_config(train_epochs=epochs)
        self.assertEqual(helpers.tiny_config(train_epochs=0.0, total_steps=5).train_steps, 5)

    def test_the_command_line_says_it_in_one_line(self):
        for flag in ('--lr_decay_epochs=30,nan',):     # the other values: the test above, in this process
            result = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.train', '--data_dir=/nonexistent',
                                     flag], env=helpers.subprocess_environment(), capture_output=True, text=True,
                                    timeout=120)
            self.assertEqual(result.returncode, 2, result.stderr[-2000:])
            lines = result.stderr.strip().splitlines()
            self.assertRegex(lines[-1], '^error: --(train_epochs|lr_decay_epochs) must be')
            self.assertNotIn('Traceback', result.stderr)


class OddFilesTest(tf.test.TestCase):

    def test_a_folder_among_the_shards_is_one_error(self):
        data_dir = self.get_temp_dir()
        helpers.write_dataset(data_dir, num_train=8, num_validation=4, train_shards=2)
        os.makedirs(os.path.join(data_dir, 'train-00005-of-00008'))
        with self.assertRaisesRegex(errors.DataError, 'train-00005-of-00008 is not a regular file'):
            record_io.file_sizes(record_io.list_shards(data_dir, tfrecord.TRAIN))

    def test_a_scaling_plot_into_a_missing_folder_is_one_error(self):
        config = helpers.tiny_config(depth=18, image_size=64, global_batch_size=1024, strategy='default',
                                     topology='v3-32')
        with self.assertRaisesRegex(errors.OutputError, 'cannot write /nonexistent/folder/scaling.png'):
            scaling.draw(config, '/nonexistent/folder/scaling.png')


class InterruptedRunTest(tf.test.TestCase):

    def test_stopped_in_its_final_evaluation_the_rerun_keeps_the_training_figures(self):
        root = self.get_temp_dir()
        helpers.write_dataset(os.path.join(root, 'data'))
        config = helpers.tiny_config(data_dir=os.path.join(root, 'data'), num_classes=4,
                                     model_dir=os.path.join(root, 'run'), eval_every_epochs=100,
                                     input_timeout_minutes=0)
        with mock.patch.object(loop, 'evaluate', side_effect=errors.Preempted('stopped by SIGTERM in evaluation')):
            with self.assertRaises(errors.Preempted):
                train.train_and_evaluate(config, print_fn=lambda line: None)
        again = train.train_and_evaluate(config, print_fn=lambda line: None)
        with open(os.path.join(config.model_dir, 'results.json')) as f:
            saved = json.load(f)
        for name in ('train_loss', 'images_per_second', 'wall_seconds', 'top_1'):
            self.assertIn(name, saved)
        self.assertEqual(saved['top_1'], again['top_1'])
        self.assertGreater(saved['images_per_second'], 0)

    def test_a_logs_link_is_replaced_not_written_through(self):
        root = self.get_temp_dir()
        helpers.write_dataset(os.path.join(root, 'data'))
        outside = os.path.join(root, 'outside')
        os.makedirs(outside)
        model_dir = os.path.join(root, 'linked')
        os.makedirs(model_dir)
        os.symlink(outside, os.path.join(model_dir, 'logs'))
        config = helpers.tiny_config(data_dir=os.path.join(root, 'data'), num_classes=4, model_dir=model_dir,
                                     eval_every_epochs=100, input_timeout_minutes=0)
        train.train_and_evaluate(config, print_fn=lambda line: None)
        self.assertEqual(os.listdir(outside), [])
        self.assertFalse(os.path.islink(os.path.join(model_dir, 'logs')))
        self.assertTrue(os.listdir(os.path.join(model_dir, 'logs')))
