"""Training and evaluation with Keras model.fit under any tf.distribute strategy.

A row of small functions a user can call one by one (build_model, build_optimizer, build_datasets, callbacks),
ending in train_and_evaluate(config), which main.py calls. Classifier wraps the plain Keras network only to own
the training step: cross-entropy with label smoothing, averaged over the global batch, plus weight decay.
"""

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from typing import List, NamedTuple, Optional

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu import batch_norm, collectives, input_pipeline, lars, regularization, resnet, rmsprop_warmup
from imagenet_tpu import schedules, tfrecord
from imagenet_tpu import strategy as strategy_lib
from imagenet_tpu.config import Config, ConfigError


def build_network(config: Config, num_replicas: int = 1) -> keras.Model:
    """The plain Keras ResNet: images -> logits, with batch norm as configured for ``num_replicas`` replicas.

    Per-replica batch norm with moving averages is Keras's own (fused) layer; replica groups, and the
    Akiba et al. or re-estimated inference statistics, use batch_norm.GroupBatchNormalization.
    """
    with mixed_precision_policy(config.precision):
        return _build_network(config, num_replicas)


@contextlib.contextmanager
def mixed_precision_policy(name: str):
    """Layers built inside use the Keras policy ``name`` (variables float32; compute float32, bfloat16 or
    float16); the previous global policy is restored after."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _build_network(config: Config, num_replicas: int) -> keras.Model:
    if config.norm == 'none':
        norm = resnet.no_norm_factory
    else:
        group_size = config.bn_group_size_for(num_replicas)
        if group_size == 1 and config.bn_inference_statistics == 'moving_average':
            norm = resnet.batch_norm_factory(config.bn_momentum, config.bn_epsilon)
        else:
            norm = batch_norm.group_batch_norm_factory(
                group_size, config.bn_momentum, config.bn_epsilon, config.bn_inference_statistics,
                config.mesh_shape, config.cores_per_chip)
    return resnet.resnet(config.depth, config.num_classes, image_size=config.image_size, norm=norm,
                         space_to_depth=config.space_to_depth)


def build_learning_rate(config: Config) -> keras.optimizers.schedules.LearningRateSchedule:
    """The configured schedule, with epochs turned into steps of config.global_batch_size images."""
    warmup_steps = config.epochs_to_steps(config.warmup_epochs)
    peak = config.peak_learning_rate
    if config.lr_decay == 'step':
        boundaries = [config.epochs_to_steps(epoch) for epoch in config.lr_decay_epochs]
        return schedules.WarmupStepDecay(peak, warmup_steps, boundaries)
    if config.lr_decay == 'polynomial':
        return schedules.WarmupPolynomialDecay(peak, warmup_steps, config.train_steps, config.end_learning_rate,
                                               config.polynomial_power)
    if config.lr_decay == 'slow_start':
        boundaries = [config.epochs_to_steps(epoch) for epoch in schedules.SLOW_START_EPOCHS]
        return schedules.PiecewiseConstantEpochs(peak, boundaries, schedules.SLOW_START_MULTIPLIERS)
    return schedules.WarmupCosineDecay(peak, warmup_steps, config.train_steps)


def build_alpha_sgd(config: Config) -> schedules.AlphaSGD:
    """RMSprop warm-up's blend schedule, in steps."""
    return schedules.AlphaSGD(config.epochs_to_steps(config.alpha_sgd_center_epochs),
                              config.epochs_to_steps(config.alpha_sgd_period_epochs))


def build_optimizer(config: Config) -> keras.optimizers.Optimizer:
    """Momentum SGD, LARS or RMSprop warm-up on the configured schedule.

    LARS applies weight decay inside its update; for the others it is in the loss (see loss_weight_decay).
    """
    optimizer = _build_optimizer(config)
    if config.precision == 'mixed_float16':
        # float16 gradients underflow without loss scaling (bfloat16 has float32's range and needs none).
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


def _build_optimizer(config: Config) -> keras.optimizers.Optimizer:
    learning_rate = build_learning_rate(config)
    if config.optimizer == 'lars':
        return lars.LARS(learning_rate, momentum=config.momentum, weight_decay=config.weight_decay,
                         eeta=config.lars_eeta, epsilon=config.lars_epsilon, nesterov=config.nesterov,
                         trust_ratio=config.lars_trust_ratio)
    if config.optimizer == 'rmsprop_warmup':
        return rmsprop_warmup.RMSpropWarmup(learning_rate, build_alpha_sgd(config),
                                            rms_learning_rate=config.rms_learning_rate, momentum=config.momentum)
    return keras.optimizers.SGD(learning_rate, momentum=config.momentum, nesterov=config.nesterov)


def loss_weight_decay(config: Config) -> float:
    """Weight decay added to the loss: none with LARS, which decays inside its update."""
    return 0.0 if config.optimizer == 'lars' else config.weight_decay


def smoothed_cross_entropy(labels: tf.Tensor, logits: tf.Tensor, label_smoothing: float = 0.0) -> tf.Tensor:
    """Per-example cross-entropy [batch] (float32) against one-hot labels smoothed towards uniform."""
    num_classes = logits.shape[-1]
    targets = tf.one_hot(labels, num_classes, dtype=tf.float32)
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
    return tf.nn.softmax_cross_entropy_with_logits(targets, tf.cast(logits, tf.float32))


class Classifier(keras.Model):
    """Owns the training step around ``network``; fit/evaluate report loss, top_1 and top_5.

    The loss of one replica is sum(cross-entropy) / global_batch_size + weight_decay_term / num_replicas, so
    that the gradients the optimizer sums over replicas are those of the mean loss over the global batch.
    """

    def __init__(self, network: keras.Model, *, global_batch_size: int, weight_decay: float = 0.0,
                 label_smoothing: float = 0.0, gradient_all_reduce=None, **kwargs):
        """gradient_all_reduce: optional callable(list of per-replica gradients) -> list of summed gradients,
        called in replica context (e.g. collectives.all_reduce_2d); the optimizer then applies the sums
        without aggregating again. Default: the optimizer's own all-reduce."""
        super().__init__(name=kwargs.pop('name', 'classifier'), **kwargs)
        self.network = network
        self.gradient_all_reduce = gradient_all_reduce
        self.global_batch_size = global_batch_size
        self.weight_decay = weight_decay
        self.label_smoothing = label_smoothing
        self.loss_tracker = keras.metrics.Mean('loss')
        self.top_1 = keras.metrics.SparseCategoricalAccuracy('top_1')
        self.top_5 = keras.metrics.SparseTopKCategoricalAccuracy(5, 'top_5')

    @property
    def metrics(self):
        return [self.loss_tracker, self.top_1, self.top_5]

    def call(self, images, training=False):
        return self.network(images, training=training)

    def _update_metrics(self, labels, logits, per_example_loss, weights=None):
        self.loss_tracker.update_state(per_example_loss, sample_weight=weights)
        self.top_1.update_state(labels, logits, sample_weight=weights)
        self.top_5.update_state(labels, logits, sample_weight=weights)
        return {metric.name: metric.result() for metric in self.metrics}

    def train_step(self, data):
        images, labels, _ = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.network.trainable_variables
        loss_scaling = isinstance(self.optimizer, keras.mixed_precision.LossScaleOptimizer)
        with tf.GradientTape() as tape:
            logits = self.network(images, training=True)
            per_example_loss = smoothed_cross_entropy(labels, logits, self.label_smoothing)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=self.global_batch_size)
            loss += tf.nn.scale_regularization_loss(regularization.l2_penalty(variables, self.weight_decay))
            if loss_scaling:
                loss = self.optimizer.get_scaled_loss(loss)
        gradients = tape.gradient(loss, variables)
        if loss_scaling:
            gradients = self.optimizer.get_unscaled_gradients(gradients)
        if self.gradient_all_reduce is None:
            self.optimizer.apply_gradients(zip(gradients, variables))
        else:
            gradients = self.gradient_all_reduce(gradients)
            self.optimizer.apply_gradients(zip(gradients, variables), skip_gradients_aggregation=True)
        return self._update_metrics(labels, logits, per_example_loss)

    def test_step(self, data):
        """Evaluation batches may carry weights: 0 marks padding (see input_pipeline.eval_dataset)."""
        images, labels, weights = keras.utils.unpack_x_y_sample_weight(data)
        logits = self.network(images, training=False)
        per_example_loss = smoothed_cross_entropy(labels, logits, self.label_smoothing)
        return self._update_metrics(labels, logits, per_example_loss, weights)


def build_gradient_all_reduce(config: Config, strategy: tf.distribute.Strategy):
    """None for the strategy's own all-reduce, else a callable summing gradients with all_reduce_2d."""
    if config.allreduce == 'default' or strategy.num_replicas_in_sync == 1:
        return None
    mesh = strategy_lib.replica_mesh_shape(strategy, config.mesh_shape, config.cores_per_chip)
    dtype = tf.bfloat16 if config.allreduce_dtype == 'bfloat16' else None
    bucket_bytes = int(config.allreduce_bucket_mb * 2 ** 20)
    return lambda gradients: collectives.all_reduce_2d(gradients, mesh, bucket_bytes=bucket_bytes, dtype=dtype)


def build_classifier(config: Config) -> Classifier:
    """Network and optimizer, compiled; call inside ``strategy.scope()`` (replicas and mesh come from it)."""
    strategy = tf.distribute.get_strategy()
    classifier = Classifier(build_network(config, strategy.num_replicas_in_sync),
                            global_batch_size=config.global_batch_size, weight_decay=loss_weight_decay(config),
                            label_smoothing=config.label_smoothing,
                            gradient_all_reduce=build_gradient_all_reduce(config, strategy))
    classifier.compile(optimizer=build_optimizer(config), jit_compile=use_jit(config),
                       steps_per_execution=steps_per_execution(config, strategy))
    # Create the optimizer's slots now, so a checkpoint restores into existing variables.
    classifier.optimizer.build(classifier.network.trainable_variables)
    return classifier


def use_jit(config: Config) -> bool:
    """XLA for the train step: as configured, else on where GPUs are visible (TPUs compile everything anyway;
    on CPUs XLA's gain is small and its compile time is not)."""
    if config.jit_compile is not None:
        return config.jit_compile
    return bool(tf.config.list_physical_devices('GPU'))


def steps_per_execution(config: Config, strategy: tf.distribute.Strategy) -> int:
    """Steps run per host call: as configured, else 100 on TPU (each call is a host round trip), capped by an
    epoch, and 1 elsewhere."""
    if config.steps_per_execution:
        return config.steps_per_execution
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return min(100, config.steps_per_epoch)
    return 1


def check_replicas(config: Config, num_replicas: int) -> None:
    for name in ('global_batch_size', 'eval_batch_size'):
        value = getattr(config, name)
        if value % num_replicas:
            raise ConfigError(f'--{name}={value} is not divisible by the {num_replicas} replicas')
    if config.norm != 'none':
        config.bn_group_size_for(num_replicas)


def _input_options(config: Config) -> tf.distribute.InputOptions:
    """Batches are prefetched onto each replica's device (config.prefetch_to_device batches)."""
    return tf.distribute.InputOptions(experimental_fetch_to_device=True,
                                      experimental_per_replica_buffer_size=config.prefetch_to_device)


def build_train_dataset(config: Config, strategy: tf.distribute.Strategy, synthetic: bool = False,
                        start_step: int = 0, skip_counts: Optional[input_pipeline.SkipCounts] = None):
    """The distributed training stream from step ``start_step`` on (input_pipeline.train_dataset); bad
    records are counted into ``skip_counts``. Each model.fit call iterates its dataset from the beginning, so
    a fit that starts at step N needs the stream built for N."""
    if synthetic:
        return strategy.distribute_datasets_from_function(
            lambda context: input_pipeline.synthetic_dataset(config, context), _input_options(config))
    return strategy.distribute_datasets_from_function(
        lambda context: input_pipeline.train_dataset(config, context, start_step=start_step,
                                                     skip_counts=skip_counts), _input_options(config))


def build_eval_dataset(config: Config, strategy: tf.distribute.Strategy,
                       skip_counts: Optional[input_pipeline.SkipCounts] = None):
    """The distributed evaluation batches: every validation image once (input_pipeline.eval_dataset)."""
    return strategy.distribute_datasets_from_function(
        lambda context: input_pipeline.eval_dataset(config, context, skip_counts=skip_counts),
        _input_options(config))


LABEL_CHECK_SHARDS = 8


def check_data(config: Config) -> None:
    """Fails at start when a split has no files, or the first labels of its first LABEL_CHECK_SHARDS shards
    (64 records each: ~56 MB of ImageNet) are outside the model's range. Shards written class by class hold
    few classes each, so one shard alone rarely shows a wrong --num_classes."""
    for split in (tfrecord.TRAIN, tfrecord.VALIDATION):
        for path in input_pipeline.list_shards(config.data_dir, split)[:LABEL_CHECK_SHARDS]:
            input_pipeline.check_labels(path, config)


def build_datasets(config: Config, strategy: tf.distribute.Strategy, synthetic: bool = False,
                   start_step: int = 0, skip_counts: Optional[input_pipeline.SkipCounts] = None):
    """(train, eval) distributed datasets; eval is None for synthetic data."""
    if synthetic:
        return build_train_dataset(config, strategy, True), None
    check_data(config)
    return (build_train_dataset(config, strategy, False, start_step, skip_counts),
            build_eval_dataset(config, strategy, skip_counts))


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
                f'ETA {format_duration(eta)}')

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


class InputEnded(RuntimeError):
    """The training stream, which is endless, ended before the last step of a fit call."""


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
def _watch_input_end():
    watcher = _InputRanOut()
    tf.get_logger().addFilter(watcher)
    try:
        yield watcher
    finally:
        tf.get_logger().removeFilter(watcher)


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite; main.py reports it as a one-line error."""


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stops training with TrainingDiverged, naming the step, as soon as the loss is not finite. It runs before
    Checkpoints, so the step that diverged is never saved (and the last checkpoint stays the last good one)."""

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get('loss')
        if loss is not None and not math.isfinite(float(loss)):
            step = int(self.model.optimizer.iterations.numpy())
            raise TrainingDiverged(f'training loss is {float(loss)} at step {step}; stopped without saving it '
                                   '(lower the learning rate, or check the input for bad values)')


class ReportSkips(keras.callbacks.Callback):
    """At each epoch end, adds the input pipelines' skip counts to the logs (TensorBoard records them) and
    prints a line when any record was skipped."""

    def __init__(self, skip_counts: input_pipeline.SkipCounts, print_fn=print):
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


class Preempted(RuntimeError):
    """Training stopped on SIGTERM after saving a checkpoint; re-running the same command continues it."""


class SaveOnSigterm(keras.callbacks.Callback):
    """On SIGTERM (the preemption notice of cloud VMs), finishes the current step, saves a checkpoint and
    stops training; train_and_evaluate then raises Preempted. The handler is installed for the duration of
    training only (and only in the main thread, where Python delivers signals)."""

    def __init__(self, manager: tf.train.CheckpointManager, print_fn=print):
        super().__init__()
        self.manager, self.print_fn = manager, print_fn
        self.signalled = False
        self.saved_step = None
        self._previous = None

    def _handle(self, signum, frame):
        self.signalled = True

    def on_train_begin(self, logs=None):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def on_train_end(self, logs=None):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def on_train_batch_end(self, batch, logs=None):
        if self.signalled and self.saved_step is None:
            step = int(self.model.optimizer.iterations.numpy())
            save_checkpoint(self.manager, step)
            self.saved_step = step
            self.model.stop_training = True
            self.print_fn(f'SIGTERM: saved step {step} to {self.manager.directory}; stopping')


def save_checkpoint(manager: tf.train.CheckpointManager, step: int) -> None:
    """Saves ckpt-STEP unless it is already the latest. TensorFlow writes the files under temporary names and
    updates the directory's `checkpoint` index last, so a crash while saving leaves the previous one latest."""
    if manager.latest_checkpoint != f'{manager.directory}/ckpt-{step}':
        manager.save(checkpoint_number=step)


class Checkpoints(keras.callbacks.Callback):
    """Saves network and optimizer (slots and step) as ckpt-STEP at every multiple of ``every_steps`` steps
    and at the end of training."""

    def __init__(self, manager: tf.train.CheckpointManager, every_steps: int):
        super().__init__()
        self.manager, self.every_steps = manager, every_steps

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def _save(self, step: int) -> None:
        save_checkpoint(self.manager, step)

    def on_train_batch_begin(self, batch, logs=None):
        self._step_before = self._step()

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        # Crossed a multiple of every_steps (with steps_per_execution > 1 a call runs several steps).
        if step // self.every_steps > self._step_before // self.every_steps:
            self._save(step)

    def on_train_end(self, logs=None):
        self._save(self._step())


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


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes the run's shared files (checkpoints, logs, results): always, except on
    the non-chief workers of a MultiWorkerMirroredStrategy."""
    resolver = getattr(strategy, 'cluster_resolver', None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    return task_type in (None, 'chief') or (task_type == 'worker' and task_id == 0
                                            and 'chief' not in resolver.cluster_spec().as_dict())


def checkpoint_directory(model_dir: str, strategy: tf.distribute.Strategy) -> str:
    """model_dir/checkpoints for the chief. Saving is a collective step every worker of a multi-worker run
    takes, so the others write theirs to model_dir/workers/worker-ID (every worker restores the chief's)."""
    if is_chief(strategy):
        return os.path.join(model_dir, 'checkpoints')
    return os.path.join(model_dir, 'workers', f'worker-{strategy.cluster_resolver.task_id}', 'checkpoints')


def checkpoint_manager(classifier: Classifier, model_dir: str,
                       strategy: Optional[tf.distribute.Strategy] = None) -> tf.train.CheckpointManager:
    """Checkpoints of network and optimizer in checkpoint_directory(model_dir), named ckpt-STEP; the last 3
    are kept."""
    checkpoint = tf.train.Checkpoint(network=classifier.network, optimizer=classifier.optimizer)
    directory = checkpoint_directory(model_dir, strategy or tf.distribute.get_strategy())
    return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=3, checkpoint_name='ckpt')


# The settings that define the network's variables: a checkpoint only fits a network built with the same ones.
MODEL_SETTINGS = ('depth', 'num_classes', 'image_size', 'norm', 'space_to_depth')


def check_model_settings(config: Config, model_dir: str) -> None:
    """Records the model-defining settings in model_dir/model.json on the first run; on a later run refuses to
    resume from a checkpoint of a different model, naming each setting that differs."""
    path = os.path.join(model_dir, 'model.json')
    current = {name: getattr(config, name) for name in MODEL_SETTINGS}
    if tf.io.gfile.exists(path):
        with tf.io.gfile.GFile(path) as f:
            saved = json.load(f)
        differences = [f'{name}={saved.get(name)!r} there, {value!r} now' for name, value in current.items()
                       if saved.get(name) != value]
        if differences:
            raise ConfigError(f'--model_dir {model_dir} holds checkpoints of a different model ('
                              + '; '.join(differences) + '): use another --model_dir or the same settings')
    else:
        tf.io.gfile.makedirs(model_dir)
        with tf.io.gfile.GFile(path, 'w') as f:
            json.dump(current, f, indent=2)


def restore_latest(manager: tf.train.CheckpointManager, print_fn=print,
                   directory: Optional[str] = None) -> Optional[str]:
    """Restores the newest readable checkpoint of ``directory`` (default: the manager's); returns its path.

    A checkpoint whose files are damaged (e.g. a disk filled while writing it) is reported and the one before
    it tried; when none can be read, ConfigError (never a silent fresh start). A checkpoint whose variables do not fit the model is a ConfigError naming the first mismatch,
    not a fresh start.
    """
    directory = directory or manager.directory
    state = tf.train.get_checkpoint_state(directory)
    paths = list(state.all_model_checkpoint_paths) if state else []
    if state and state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    for path in reversed(paths):   # get_checkpoint_state has already put ``directory`` in front of each
        try:
            manager.checkpoint.restore(path).assert_existing_objects_matched()
            return path
        except (AssertionError, ValueError) as error:
            first_line = str(error).strip().splitlines()[0]
            raise ConfigError(f'{path} does not fit this model: {first_line}') from None
        except (tf.errors.OpError, IndexError, OSError) as error:
            # TensorFlow's checkpoint reader reports a short data file as IndexError.
            print_fn(f'warning: cannot read {path} ({type(error).__name__}); trying the checkpoint before it')
    if paths:
        raise ConfigError(f'none of the {len(paths)} checkpoints in {directory} can be read; move them away to '
                          'start afresh')
    return None


class FitSegment(NamedTuple):
    initial_epoch: int
    epochs: int
    steps_per_epoch: int


def fit_segments(start_step: int, total_steps: int, steps_per_epoch: int) -> List[FitSegment]:
    """model.fit calls that run steps start_step..total_steps with epochs aligned to steps_per_epoch.

    A resumed run first finishes the interrupted epoch (a short epoch), then runs whole epochs; a final partial
    epoch (fractional train_epochs) is its own call.
    """
    segments = []
    step = start_step
    while step < total_steps:
        epoch, done = divmod(step, steps_per_epoch)
        if done or total_steps - step < steps_per_epoch:
            steps = min(steps_per_epoch - done, total_steps - step)
            segments.append(FitSegment(epoch, epoch + 1, steps))
        else:
            whole = (total_steps - step) // steps_per_epoch
            segments.append(FitSegment(epoch, epoch + whole, steps_per_epoch))
            steps = whole * steps_per_epoch
        step += steps
    return segments


def ensure_writable(model_dir: str) -> None:
    try:
        tf.io.gfile.makedirs(model_dir)
        probe = os.path.join(model_dir, f'.write_probe-{os.getpid()}')   # one per process: workers share model_dir
        with tf.io.gfile.GFile(probe, 'w') as f:
            f.write('ok')
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as error:
        raise ConfigError(f'--model_dir {model_dir} is not writable ({type(error).__name__})') from None


def export_saved_model(network: keras.Model, path: str) -> None:
    """Writes ``network`` as a SavedModel whose serving signature maps images to logits (inference mode, with
    the batch-norm statistics chosen by the config); it loads and runs without any strategy."""
    image_size = network.input_shape[1]

    @tf.function(input_signature=[tf.TensorSpec([None, image_size, image_size, 3], tf.float32, name='images')])
    def serve(images):
        return {'logits': network(images, training=False)}

    tf.saved_model.save(network, path, signatures={'serving_default': serve})


def train_and_evaluate(config: Config, strategy: Optional[tf.distribute.Strategy] = None,
                       synthetic: bool = False, print_fn=print) -> dict:
    """Trains for config.train_steps (resuming from config.model_dir), evaluates, returns the final metrics.

    Returns a dict with top_1, top_5, loss (held-out; absent for synthetic data), train_loss, steps,
    images_per_second, wall_seconds and the input's bad_records and truncated_files. Raises Preempted after
    saving a checkpoint when SIGTERM arrives during training.
    """
    started = time.perf_counter()
    strategy = strategy or strategy_lib.make_strategy(config.strategy, num_cpu_devices=config.num_cpu_devices,
                                                      tpu=config.tpu)
    chief = is_chief(strategy)
    if config.model_dir:
        ensure_writable(config.model_dir)
        if chief:
            check_model_settings(config, config.model_dir)
    check_replicas(config, strategy.num_replicas_in_sync)
    with strategy.scope():
        classifier = build_classifier(config)

    callbacks = [StopOnNonFiniteLoss()]
    if config.model_dir:
        manager = checkpoint_manager(classifier, config.model_dir, strategy)
        # Every worker resumes from the chief's checkpoints.
        restored = restore_latest(manager, print_fn, os.path.join(config.model_dir, 'checkpoints'))
        if restored:
            print_fn(f'resumed from {restored} at step {int(classifier.optimizer.iterations.numpy())}')
        callbacks += [Checkpoints(manager, config.checkpoint_every_steps), SaveOnSigterm(manager, print_fn)]
    start_step = int(classifier.optimizer.iterations.numpy())
    skip_counts = input_pipeline.SkipCounts()
    train_data, eval_data = build_datasets(config, strategy, synthetic=synthetic, start_step=start_step,
                                           skip_counts=skip_counts)
    eval_steps = config.eval_steps_for(strategy_lib.num_input_pipelines(strategy))
    if config.norm != 'none' and config.bn_inference_statistics == 'reestimate':
        callbacks.append(ReestimateBatchNorm(classifier.network, train_data, config.bn_reestimate_batches,
                                             strategy))
    # Progress and ReportSkips add to the epoch logs, so they come before TensorBoard.
    callbacks = [Progress(config.train_steps, config.global_batch_size, config.log_every_steps, print_fn,
                          config.num_train_images),
                 ReportSkips(skip_counts, print_fn)] + callbacks
    if config.model_dir and chief:
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(config.model_dir, 'logs'), update_freq='epoch',
                                                     profile_batch=0))
    print_fn(f'{config.depth}-layer ResNet, {strategy.num_replicas_in_sync} replicas '
             f'({type(strategy).__name__}), global batch {config.global_batch_size}, '
             f'{config.steps_per_epoch} steps/epoch, {config.train_steps} steps')

    train_loss, images_per_second = float('nan'), 0.0
    sigterm = next((c for c in callbacks if isinstance(c, SaveOnSigterm)), None)
    for segment in fit_segments(start_step, config.train_steps, config.steps_per_epoch):
        validate = eval_data is not None and config.eval_every_epochs
        step = int(classifier.optimizer.iterations.numpy())
        if step != start_step:   # a later fit call: the stream must continue where the last one stopped
            train_data = build_train_dataset(config, strategy, synthetic, step, skip_counts)
        planned = step + (segment.epochs - segment.initial_epoch) * segment.steps_per_epoch
        with _watch_input_end() as input_end:
            try:
                history = classifier.fit(
                    train_data, initial_epoch=segment.initial_epoch, epochs=segment.epochs,
                    steps_per_epoch=segment.steps_per_epoch, callbacks=callbacks, verbose=0,
                    validation_data=eval_data if validate else None, validation_steps=eval_steps,
                    validation_freq=config.eval_every_epochs if validate else 1)
            except ValueError as error:   # Keras, when the input ends before the first step: "(Empty logs)"
                if 'Empty logs' not in str(error):
                    raise
                history = None
        if sigterm and sigterm.saved_step is not None:
            raise Preempted(f'stopped by SIGTERM at step {sigterm.saved_step} after saving it; run the same '
                            'command again to continue')
        reached = int(classifier.optimizer.iterations.numpy())
        if reached < planned or input_end.seen:
            # Keras stops a fit call quietly ("Your input ran out of data") when its input ends; ours never
            # should. Seen once in ~10 runs: a bad record under --bad_records=fatal, reported by the distributed
            # iterator as the end of the data instead of as the error.
            raise InputEnded(f'the training input ended early (this fit call was to reach step {planned}; the '
                             f'step counter is at {reached}); the stream is endless, so an input error ended it. '
                             'With --bad_records=fatal that can be a bad record: --bad_records=skip skips and '
                             'counts them')
        if history and history.history.get('loss'):
            train_loss = history.history['loss'][-1]
            images_per_second = history.history['images_per_second'][-1]

    results = {'steps': int(classifier.optimizer.iterations.numpy()), 'train_loss': float(train_loss),
               'images_per_second': float(images_per_second)}
    if eval_data is not None:
        evaluated = classifier.evaluate(eval_data, steps=eval_steps, verbose=0, return_dict=True,
                                        callbacks=[c for c in callbacks if isinstance(c, ReestimateBatchNorm)])
        results.update({name: float(value) for name, value in evaluated.items()})
        results['eval_images'] = int(classifier.top_1.count.numpy())
        print_fn(f'held-out top-1 {100 * results["top_1"]:.2f}% top-5 {100 * results["top_5"]:.2f}% '
                 f'loss {results["loss"]:.4f} on {results["eval_images"]} images')
        if results['eval_images'] != config.num_eval_images:
            print_fn(f'warning: evaluated {results["eval_images"]} images but --num_eval_images='
                     f'{config.num_eval_images}; set it to the size of the validation set (or see the skipped '
                     'bad records above)')
    results.update(skip_counts.totals())
    if config.model_dir and config.export_saved_model and chief:
        path = os.path.join(config.model_dir, 'saved_model')
        export_saved_model(classifier.network, path)
        print_fn(f'exported {path}')
    results['wall_seconds'] = time.perf_counter() - started
    if config.model_dir and chief:
        with tf.io.gfile.GFile(os.path.join(config.model_dir, 'results.json'), 'w') as f:
            json.dump(results, f, indent=2)
    return results

