"""SIGTERM's deadline: it lets a checkpoint save under way complete, and it covers a host call of several steps."""

import signal
import subprocess
import sys
import textwrap
from unittest import mock

import tensorflow as tf
from tensorflow.python.distribute.failure_handling import failure_handling_util  # pylint: disable=no-name-in-module

import helpers
from imagenet_tpu import errors
from imagenet_tpu.training import loop, preemption, sigterm_saves


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-c', textwrap.dedent(script)], env=helpers.subprocess_environment(),
                          capture_output=True, text=True, timeout=120)


class PreemptionTest(tf.test.TestCase):

    def tearDown(self):
        preemption.note_host_call(0)
        super().tearDown()

    def test_the_grace_covers_one_and_a_half_host_calls(self):
        with preemption.during_training(25.0):
            self.assertEqual(preemption.effective_grace(), 25.0)
            preemption.note_host_call(40.0)        # e.g. 100 steps per execution of 0.4 s
            self.assertEqual(preemption.effective_grace(), 60.0)
            preemption.note_host_call(2.0)
            self.assertEqual(preemption.effective_grace(), 25.0)

    def test_nothing_to_wait_for_before_training_stays_immediate(self):
        preemption.set_grace(0, 'before training started')
        preemption.note_host_call(40.0)
        self.assertEqual(preemption.effective_grace(), 0)

    def test_a_save_under_way_completes_before_the_deadline_ends_the_process(self):
        # The grace (0.2 s) passes while the "save" (a 1.5 s block) runs: the process must not be ended in it.
        # The verdict does not depend on the machine's speed: the deadline may only fire after the block.
        result = _run('''
            import os, signal, time
            from imagenet_tpu.training import preemption
            preemption.listen()
            preemption.set_grace(0.2, 'training')
            with preemption.saving():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.5)
                print('saved', flush=True)
            time.sleep(30)     # after the save, the deadline ends the process
            ''')
        self.assertEqual(result.returncode, 128 + signal.SIGTERM, result.stderr)
        self.assertIn('saved', result.stdout)
        self.assertIn('error: SIGTERM: training did not stop within 0.2 s', result.stderr)

    def test_without_a_save_the_deadline_ends_the_process(self):
        result = _run('''
            import os, signal, time
            from imagenet_tpu.training import preemption
            preemption.listen()
            preemption.set_grace(0.2, 'training')
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print('not ended', flush=True)
            ''')
        self.assertEqual(result.returncode, 128 + signal.SIGTERM, result.stderr)
        self.assertNotIn('not ended', result.stdout)


if __name__ == '__main__':
    tf.test.main()


class PreemptionHandlerTest(tf.test.TestCase):
    """The termination notice TensorFlow's PreemptionCheckpointHandler is given (tested up to the handler)."""

    def tearDown(self):
        preemption._requested.clear()  # pylint: disable=protected-access
        super().tearDown()

    def watcher_given_to_the_handler(self, platform):
        made = {}
        with mock.patch.object(failure_handling_util, 'detect_platform', return_value=platform), \
                mock.patch.object(tf.distribute.experimental, 'PreemptionCheckpointHandler',
                                  lambda resolver, manager, termination_config: made.update(
                                      config=termination_config)):
            sigterm_saves.SaveOnPreemptionAcrossWorkers(None, mock.Mock(cluster_resolver=None), print_fn=lambda _: None)
        return made['config'].termination_watcher_fn

    def test_sigterm_reaches_the_handler_on_every_platform(self):
        Platform = failure_handling_util.PlatformDevice
        for platform in (Platform.INTERNAL_GPU, Platform.INTERNAL_CPU, Platform.GCE_GPU):
            with mock.patch.object(failure_handling_util, 'termination_watcher_function_gce', return_value=False):
                watcher = self.watcher_given_to_the_handler(platform)
                self.assertFalse(watcher(), platform)
                preemption._requested.set()  # pylint: disable=protected-access  (as the SIGTERM thread does)
                self.assertTrue(watcher(), platform)
                preemption._requested.clear()  # pylint: disable=protected-access

    def test_the_maintenance_event_still_counts_on_google_cloud_gpus(self):
        with mock.patch.object(failure_handling_util, 'termination_watcher_function_gce', return_value=True):
            watcher = self.watcher_given_to_the_handler(failure_handling_util.PlatformDevice.GCE_GPU)
            self.assertTrue(watcher())


class StartUpSigtermTest(tf.test.TestCase):

    def test_sigterm_while_tensorflow_starts_is_one_line(self):
        # The start-up holds TensorFlow's stderr back (runtime.import_tensorflow): the exit line used to go there.
        result = _run('''
            import os, signal, threading
            from imagenet_tpu.training import preemption
            preemption.listen()
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
            from imagenet_tpu import runtime
            import time
            runtime.import_tensorflow()
            time.sleep(60)
            ''')
        self.assertEqual(result.returncode, 128 + signal.SIGTERM)
        self.assertIn('error: stopped by SIGTERM', result.stderr)


class HostLostTest(tf.test.TestCase):

    def test_a_lost_host_is_one_line(self):
        for kind in (tf.errors.UnavailableError, tf.errors.AbortedError):
            with self.assertRaisesRegex(errors.HostLost, 'a host of the run stopped answering .*run the same '
                                                         'command again'):
                with loop.input_errors():
                    raise kind(None, None, 'Socket closed\n\t [[{{node CollectiveReduceV2}}]]')
