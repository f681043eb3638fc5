"""Keras callbacks of a training run: progress lines, skipped-record reports, the stop on a non-finite loss,
batch-norm statistics for evaluation (the replicas' mean, or re-estimated), and the watch for an input that ends
early."""

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from typing import Optional

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.model import batch_norm
from imagenet_tpu.data import record_io
from imagenet_tpu.errors import TrainingDiverged


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'


def significant(value: float, digits: int = 3) -> str:
    """``value`` rounded to ``digits`` significant figures, with thousands separators: 11.24 -> '11.2',
    532.6 -> '533', 12345 -> '12,300'."""
    if not math.isfinite(value) or value == 0:
        return f'{value:g}'
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    decimals = digits - 1 - math.floor(math.log10(abs(rounded)))   # 9.996 -> 10.0, not 10.00
    return f'{round(rounded, decimals):,.{max(decimals, 0)}f}'


def current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    rate = optimizer.learning_rate
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        rate = rate(optimizer.iterations)
    return float(keras.backend.get_value(rate))


def resident_memory_mb() -> float:
    """This process's resident memory now, in MiB (Linux /proc; NaN elsewhere)."""
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2 ** 20
    except (OSError, ValueError, IndexError):
        return float('nan')


class Progress(keras.callbacks.Callback):
    """Prints epoch, step, loss, top-1, images/s and ETA (and at epoch ends the resident memory), and adds
    learning_rate, images_per_second and memory_mb to the epoch logs (the TensorBoard callback after it
    records them).

    The epoch printed is the data seen, step x global batch / num_train_images, to one decimal, as the large-
    batch papers and MLPerf count it (step 1,738 of the 64k recipe is epoch 88.9), not Keras's epoch index."""

    def __init__(self, total_steps: int, global_batch_size: int, every_steps: int, print_fn=print,
                 num_train_images: Optional[int] = None):
        super().__init__()
        self.total_steps = total_steps
        self.global_batch_size, self.every_steps, self.print_fn = global_batch_size, every_steps, print_fn
        self.num_train_images = num_train_images

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_index = epoch
        self._epoch_start = self._window_start = time.perf_counter()
        self._epoch_first_step = self._window_first_step = self._step()

    def _step(self) -> int:
        # Keras calls back once per execution (steps_per_execution steps), so count steps, not calls.
        return int(self.model.optimizer.iterations.numpy())

    def _line(self, epoch: int, logs: dict, images_per_second: float) -> str:
        step = self._step()
        eta = (self.total_steps - step) * self.global_batch_size / max(images_per_second, 1e-9)
        shown = f'{step * self.global_batch_size / self.num_train_images:.1f}' if self.num_train_images else epoch + 1
        return (f'epoch {shown} step {step}/{self.total_steps} loss {logs.get("loss", float("nan")):.4f} '
                f'top-1 {100 * logs.get("top_1", float("nan")):.2f}% {significant(images_per_second)} images/s '
                f'ETA {format_duration(eta)}' + (f' noise scale {significant(float(logs["noise_scale"]))}'
                                                 if 'noise_scale' in logs else ''))

    def on_train_batch_end(self, batch, logs=None):
        self._last_step_end = now = time.perf_counter()
        step = self._step()
        if self.every_steps and step - self._window_first_step >= self.every_steps:
            rate = (step - self._window_first_step) * self.global_batch_size / (now - self._window_start)
            self.print_fn(self._line(self._epoch_index, logs or {}, rate))
            self._window_start, self._window_first_step = now, step

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        # Training time only: the epoch's validation runs after its last step.
        steps = self._step() - self._epoch_first_step
        rate = steps * self.global_batch_size / max(self._last_step_end - self._epoch_start, 1e-9)
        logs['images_per_second'] = rate
        logs['learning_rate'] = current_learning_rate(self.model.optimizer)
        logs['memory_mb'] = resident_memory_mb()
        line = self._line(epoch, logs, rate) + f' memory {logs["memory_mb"]:,.0f} MiB'
        if 'val_top_1' in logs:
            line += f' | held-out top-1 {100 * logs["val_top_1"]:.2f}% top-5 {100 * logs["val_top_5"]:.2f}%'
        self.print_fn(line)


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stops training with TrainingDiverged, naming the steps, as soon as the loss is not finite, or when a check
    of the weights (every float variable of the network, moving statistics included) finds a NaN or an infinity.
    The weights are read once per ``weights_every_seconds`` of training, not in every step: a per-step check read
    every weight again (about 1.8% of a TPU v3 step of the 64k recipe). Between checks the check before each save
    (checkpoints.save_checkpoint) keeps a diverged step out of the checkpoints, and a weight that went NaN makes
    the loss NaN one step later unless it is a moving statistic. It runs before Checkpoints. Keras calls back once
    per host call: with several steps per call it names the call's steps."""

    def __init__(self, weights_every_seconds: float = 60.0, nonfinite=None):
        super().__init__()
        self.weights_every_seconds = weights_every_seconds
        self._nonfinite = nonfinite       # variables -> names of the non-finite ones (checkpoints.py's check)
        self._checked_at, self._checked_step = time.monotonic(), 0

    def on_train_begin(self, logs=None):
        self._checked_at, self._checked_step = time.monotonic(), int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get('loss')
        step = int(self.model.optimizer.iterations.numpy())
        if loss is not None and not math.isfinite(float(loss)):
            self._stop(f'training loss is {float(loss)}', step, self._steps_per_call())
        if self._nonfinite is not None and time.monotonic() - self._checked_at >= self.weights_every_seconds:
            network = getattr(self.model, 'network', self.model)
            bad = self._nonfinite(list(network.variables))
            if bad:
                self._stop(f'{len(bad)} weights are NaN or infinite (first: {bad[0]})', step,
                           step - self._checked_step)
            self._checked_at, self._checked_step = time.monotonic(), step

    def _steps_per_call(self) -> int:
        per_call = getattr(self.model, 'steps_per_execution', None)    # Keras's variable; None before compile
        return int(per_call.numpy()) if per_call is not None else 1

    @staticmethod
    def _stop(problem: str, step: int, steps: int):
        where = f'at step {step}' if steps <= 1 else f'in steps {step - steps + 1}-{step}'
        raise TrainingDiverged(f'{problem} {where}; stopped without saving it (the last checkpoint is '
                               'the last finite one: lower the learning rate, or check the input for bad values)')


class InputWatchdog(keras.callbacks.Callback):
    """Ends the process with one ``error:`` line (exit status 2) when no training or evaluation batch ends for
    ``timeout_seconds`` while fit or evaluate runs: an input that yields nothing (a stalled file system, a tf.data
    service without workers). The main thread then waits inside TensorFlow, where Python cannot interrupt it, so
    a thread of its own watches; checkpoints already written are intact. Put it first among the callbacks (its
    clock starts before the others' work at each batch). close() stops the thread."""

    def __init__(self, timeout_seconds: float, describe_input: str, poll_seconds: float = 5.0):
        super().__init__()
        self.timeout_seconds, self.describe_input = timeout_seconds, describe_input
        self._poll = min(poll_seconds, max(0.05, timeout_seconds / 10))
        self._last, self._phases = time.monotonic(), set()
        self._closed = threading.Event()
        self._thread = None

    def _beat(self, *unused):
        self._last = time.monotonic()

    def _watch(self):
        while not self._closed.wait(self._poll):
            idle = time.monotonic() - self._last
            if self._phases and idle > self.timeout_seconds:
                if self._phases == {'start'}:
                    what = (f'the input did not start in {idle / 60:.1f} minutes (--input_timeout_minutes): '
                            f'{self.describe_input} does not answer (a hung file system, a file that is not a '
                            'regular file, an address that is not a tf.data service dispatcher)')
                else:
                    what = (f'no {"evaluation" if "test" in self._phases else "training"} step ended in '
                            f'{idle / 60:.1f} minutes (--input_timeout_minutes): {self.describe_input} yields '
                            'nothing')
                os.write(2, f'error: {what}; the checkpoints written so far are intact\n'.encode())
                os._exit(2)  # pylint: disable=protected-access  (the main thread is stuck inside TensorFlow)

    def start(self):
        """Watches the run's start-up too (listing, sizing and opening the input, before fit calls back), until
        training or evaluation begins."""
        self._start('start')

    def _start(self, phase):
        self._phases.add(phase)
        self._beat()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name='input-watchdog', daemon=True)
            self._thread.start()

    def close(self):
        self._closed.set()

    def on_train_begin(self, logs=None):
        self._phases.discard('start')
        self._start('train')

    def on_train_end(self, logs=None):
        self._phases.discard('train')

    def on_test_begin(self, logs=None):
        self._phases.discard('start')
        self._start('test')

    def on_test_end(self, logs=None):
        self._phases.discard('test')
        self._beat()

    on_epoch_begin = on_epoch_end = on_train_batch_begin = on_train_batch_end = _beat
    on_test_batch_begin = on_test_batch_end = _beat


class ProfileSteps(keras.callbacks.Callback):
    """TensorFlow's profiler over training steps ``start``..``end`` (the optimizer's step counter, so a resumed run
    counts from where it resumed: step 1 is the run's first), written to ``logdir`` for TensorBoard's Profile tab.
    With steps_per_execution > 1 the profile covers the executions that hold those steps."""

    def __init__(self, start: int, end: int, logdir: str, print_fn=print):
        super().__init__()
        self.start, self.end, self.logdir, self.print_fn = start, end, logdir, print_fn
        self._running = False

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def on_train_batch_begin(self, batch, logs=None):
        step = self._step() + 1           # the step this call runs first
        if not self._running and self.start <= step <= self.end:
            tf.profiler.experimental.start(self.logdir)
            self._running = True

    def on_train_batch_end(self, batch, logs=None):
        if self._running and self._step() >= self.end:
            self._stop()

    def _stop(self):
        tf.profiler.experimental.stop()
        self._running = False
        self.print_fn(f'profile of steps {self.start}-{self.end} written to {self.logdir} (tensorboard --logdir '
                      f'{self.logdir}, Profile tab)')

    def on_train_end(self, logs=None):
        if self._running:
            self._stop()


class ReportSkips(keras.callbacks.Callback):
    """At each epoch end, adds the input pipelines' skip counts to the logs (TensorBoard records them) and
    prints a line when any record was skipped."""

    def __init__(self, skip_counts: record_io.SkipCounts, print_fn=print):
        super().__init__()
        self.skip_counts, self.print_fn = skip_counts, print_fn
        self._reported = {'bad_records': 0, 'truncated_files': 0}

    def on_epoch_end(self, epoch, logs=None):
        totals = self.skip_counts.totals()
        if logs is not None:
            logs.update({name: float(value) for name, value in totals.items()})
        if totals != self._reported:
            new = totals['bad_records'] - self._reported['bad_records']
            self.print_fn(f'input: skipped {totals["bad_records"]} bad records so far ({new} since the last '
                          f'report) and {totals["truncated_files"]} truncated files (set --bad_records=fatal '
                          'to stop instead)')
            self._reported = totals


def average_moving_statistics(network: keras.Model, strategy: tf.distribute.Strategy) -> None:
    """Sets every replica's batch-norm moving statistics to their mean over the replicas.

    Keras keeps moving statistics per replica (synchronized on read): each replica updates its own copy from its
    own batches, an evaluation under the strategy uses each replica's copy, and a checkpoint or an export reads
    their mean. After this call every replica holds that mean, so evaluation uses the exported statistics. It is
    one replicated step (one all-reduce of every statistic, each replica assigning the mean to its own copy),
    traced once per network and strategy: assigning from the host would be one eager op per replica and
    variable (~53 x 2 x 1,024 on a TPU v3-1024).
    """
    _averager(network, strategy)()


_AVERAGERS = weakref.WeakKeyDictionary()     # network -> (strategy, tf.function)


def _averager(network: keras.Model, strategy: tf.distribute.Strategy):
    cached = _AVERAGERS.get(network)
    if cached is not None and cached[0] is strategy:
        return cached[1]
    variables = [variable for layer in batch_norm.batch_norm_layers(network)
                 for variable in (layer.moving_mean, layer.moving_variance)]

    def replica_step():
        context = tf.distribute.get_replica_context()
        means = context.all_reduce(tf.distribute.ReduceOp.MEAN, [tf.identity(v) for v in variables])
        for variable, mean in zip(variables, means):
            variable.assign(mean)

    @tf.function
    def average():
        if variables:
            strategy.run(replica_step)

    _AVERAGERS[network] = (strategy, average)
    return average


class AverageMovingStatistics(keras.callbacks.Callback):
    """Before each evaluation, gives every replica the mean moving statistics (average_moving_statistics)."""

    def __init__(self, network: keras.Model, strategy: tf.distribute.Strategy):
        super().__init__()
        self.network, self.strategy = network, strategy

    def on_test_begin(self, logs=None):
        average_moving_statistics(self.network, self.strategy)


class ReestimateBatchNorm(keras.callbacks.Callback):
    """Before each evaluation, recomputes the batch-norm statistics from ``steps`` training batches."""

    def __init__(self, network: keras.Model, train_data, steps: int, strategy: tf.distribute.Strategy):
        super().__init__()
        self.network, self.train_data, self.steps, self.strategy = network, train_data, steps, strategy
        self._iterator = None

    def on_test_begin(self, logs=None):
        if self._iterator is None:
            self._iterator = iter(self.train_data)
        batch_norm.reestimate_statistics(self.network, self._iterator, self.steps, self.strategy)


class _InputRanOut(logging.Filter):
    """Notes Keras's "Your input ran out of data" warning, its only sign that a fit call's input ended: the step
    counter cannot tell (when the error surfaces late, the calls in between still count steps)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if 'ran out of data' in record.getMessage():
            self.seen = True
        return True


@contextlib.contextmanager
def watch_input_end():
    """Within the block, notes whether Keras warned that a fit call's input ran out (``.seen``)."""
    watcher = _InputRanOut()
    tf.get_logger().addFilter(watcher)
    try:
        yield watcher
    finally:
        tf.get_logger().removeFilter(watcher)
