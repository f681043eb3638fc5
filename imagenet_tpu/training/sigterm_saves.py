"""The saves SIGTERM asks for: on one process (SaveOnSigterm) or agreed by every worker of a cluster through
TensorFlow's PreemptionCheckpointHandler (SaveOnPreemptionAcrossWorkers). preemption.py receives the signal;
checkpoints.py writes the checkpoint.
"""

import time
from typing import Callable

import tensorflow as tf
from tensorflow.python.distribute.failure_handling import failure_handling_util  # pylint: disable=no-name-in-module
from tensorflow.python.util import deprecation  # pylint: disable=no-name-in-module
import tf_keras as keras

from imagenet_tpu.errors import Preempted
from imagenet_tpu.training import checkpoints, preemption


class _TimesHostCalls(keras.callbacks.Callback):
    """Tells preemption.py how long each host call takes (Keras calls back once per call), so that SIGTERM's grace
    covers one. The first call of a model.fit also traces and compiles the step, so its time overstates the next
    calls': a longer grace, never a save cut short."""

    _call_started = None

    def on_train_batch_begin(self, batch, logs=None):
        self._call_started = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        if self._call_started is not None:
            preemption.note_host_call(time.monotonic() - self._call_started)


class SaveOnSigterm(_TimesHostCalls):
    """On SIGTERM (the preemption notice of cloud VMs), saves a checkpoint at the end of the current training
    step (or evaluation batch) and raises Preempted at once: no evaluation runs after it. SIGTERM is watched
    by preemption.py, which also ends the process ``grace_seconds`` after the signal if no step ends (a stalled
    input); called from a program of its own, the callback watches for the duration of training."""

    def __init__(self, manager: tf.train.CheckpointManager, print_fn=print, grace_seconds: float = 25.0):
        super().__init__()
        self.manager, self.print_fn, self.grace_seconds = manager, print_fn, grace_seconds
        self.saved_step = None
        self._watch = None

    def on_train_begin(self, logs=None):
        if not preemption.active():
            self._watch = preemption.during_training(self.grace_seconds)
            self._watch.__enter__()

    def _stop_watching(self):
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)

    def on_train_end(self, logs=None):
        self._stop_watching()

    def _save_and_stop(self):
        if not preemption.requested() or self.saved_step is not None:
            return
        step = int(self.model.optimizer.iterations.numpy())
        checkpoints.save_checkpoint(self.manager, step)
        self.saved_step = step
        self.model.stop_training = True
        self.print_fn(f'{preemption.signal_name()}: saved step {step} to {self.manager.directory}; stopping')
        self._stop_watching()
        raise Preempted(f'stopped by {preemption.signal_name()} at step {step} after saving it; run the same '
                        'command again to continue')

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self._save_and_stop()

    def on_test_batch_end(self, batch, logs=None):
        self._save_and_stop()


def termination_watcher(platform) -> Callable[[], bool]:
    """What TensorFlow's PreemptionCheckpointHandler polls (every second) for this worker's termination notice:
    SIGTERM as preemption.py receives it, and on Google Cloud GPU VMs also the host maintenance event. Given no
    watcher, the handler watches only the maintenance event there and installs no SIGTERM handler at all
    (failure_handling.py 250-255, 670-675), so a SIGTERM saved nothing; elsewhere it would install its own
    handler, which the commands' SIGTERM thread stands in front of."""
    if platform == failure_handling_util.PlatformDevice.GCE_GPU:
        return lambda: preemption.requested() or failure_handling_util.termination_watcher_function_gce()
    return preemption.requested


class SaveOnPreemptionAcrossWorkers(_TimesHostCalls):
    """SIGTERM to any worker of a MultiWorkerMirroredStrategy run: every worker saves the same step and
    train_and_evaluate raises Preempted on each (exit status 143: run the same command again).

    TensorFlow's own tf.distribute.experimental.PreemptionCheckpointHandler does the agreement: the worker that
    receives the signal publishes a step through the cluster's coordination service, and every worker saves its
    checkpoint at that step (the chief to model_dir/checkpoints; the others' copies are deleted once written, as
    for periodic checkpoints). Create it before restoring, so that the run's own restore has the last word.
    """

    def __init__(self, manager: tf.train.CheckpointManager, strategy: tf.distribute.Strategy, print_fn=print):
        super().__init__()
        self.manager, self.print_fn = manager, print_fn
        self.saved_step = None
        self._step = 0
        platform = failure_handling_util.detect_platform()
        if platform == failure_handling_util.PlatformDevice.GCE_CPU:
            print_fn("warning: on Google Cloud CPU VMs TensorFlow's PreemptionCheckpointHandler does nothing "
                     '(failure_handling.py 511-519): SIGTERM ends this run after --termination_grace_seconds '
                     'without a save; the checkpoints of every --checkpoint_every_steps stay')
        config = tf.distribute.experimental.TerminationConfig(
            termination_watcher_fn=termination_watcher(platform), exit_fn=self._exit, grace_period=0)
        self.handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, manager, termination_config=config)

    def _exit(self):
        self.saved_step = self._step
        self.print_fn(f'preemption: every worker saved step {self._step}; stopping')
        raise Preempted(f'stopped by SIGTERM to a worker at step {self._step}, after every worker saved it; run '
                        'the same command again to continue')

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self._step = int(self.model.optimizer.iterations.numpy())
        with deprecation.silence():   # the handler reads its own deprecated total_run_calls when it saves
            self.handler.save_checkpoint_if_preempted(checkpoint_number=self._step)


def uses_cluster(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` is a MultiWorkerMirroredStrategy over a cluster of workers (TF_CONFIG)."""
    resolver = getattr(strategy, 'cluster_resolver', None)
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver is not None
            and bool(resolver.cluster_spec().jobs))
