"""Training and evaluation with Keras model.fit under any tf.distribute strategy.

The builders a user can call one by one (build_strategy, build_network, build_optimizer, build_classifier,
build_datasets, build_callbacks), then train_and_evaluate(config), which the command line calls and which reads
top to bottom: process settings, strategy, model, resume, data, callbacks, fit, evaluate, export. The training
step is classifier.py's, checkpoints and resuming checkpointing.py's, the callbacks callbacks.py's.
"""

import contextlib
import dataclasses
import json
import os
import time
from typing import Optional

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu import cpu
from imagenet_tpu.config import Config
from imagenet_tpu.data import labels, tfrecord
from imagenet_tpu.data import pipeline as input_pipeline
from imagenet_tpu.data import records as record_io
from imagenet_tpu.data import service as data_service
from imagenet_tpu.data.records import SkipCounts
from imagenet_tpu.distribute import collectives
from imagenet_tpu.distribute import strategy as strategy_lib
from imagenet_tpu.errors import ConfigError, DataError, InputEnded, Preempted, StepError, summarize_graph_error
from imagenet_tpu.model import batch_norm, resnet
from imagenet_tpu.model import classifier as classifier_lib
from imagenet_tpu.optim import lars, noise_scale, regularization, rmsprop_warmup, schedules, sgd
from imagenet_tpu.serving import export
from imagenet_tpu.training import callbacks as callbacks_lib
from imagenet_tpu.training import checkpointing, termination


def prepare_process(config: Config) -> None:
    """The process-wide settings of a run: the seed of initialization and TensorFlow's op determinism. Both stay
    set for the rest of the process (TensorFlow has no narrower scope for them)."""
    if config.seed is not None:
        keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()


def build_strategy(config: Config) -> tf.distribute.Strategy:
    """The configured strategy (strategy.make_strategy)."""
    return strategy_lib.make_strategy(config.strategy, num_cpu_devices=config.num_cpu_devices, tpu=config.tpu,
                                      cpu_devices_per_worker=config.cpu_devices_per_worker,
                                      tpu_hosts=config.topology_hosts, cluster_source=config.cluster,
                                      cluster_port=config.cluster_port)


def build_network(config: Config, num_replicas: int = 1, replica_order=None) -> keras.Model:
    """The plain Keras ResNet: images -> logits, with batch norm as configured for ``num_replicas`` replicas
    (``replica_order``: the replica at each mesh index, strategy.replica_order; None: replica r at index r).

    Per-replica batch norm with moving averages is Keras's layer (cpu.BatchNormalization, with faster kernels
    on CPU); replica groups, and the Akiba et al. or re-estimated inference statistics, use
    batch_norm.GroupBatchNormalization.
    """
    with mixed_precision_policy(config.precision):
        return _build_network(config, num_replicas, replica_order)


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


def _build_network(config: Config, num_replicas: int, replica_order=None) -> keras.Model:
    if config.norm == 'none':
        norm = resnet.no_norm_factory
    else:
        group_size = config.bn_group_size_for(num_replicas)
        if group_size == 1 and config.bn_inference_statistics == 'moving_average':
            norm = resnet.batch_norm_factory(config.bn_momentum, config.bn_epsilon)
        else:
            norm = batch_norm.group_batch_norm_factory(
                group_size, config.bn_momentum, config.bn_epsilon, config.bn_inference_statistics,
                config.mesh_shape, config.cores_per_chip, replica_order)
    return resnet.resnet(config.depth, config.num_classes, image_size=config.image_size, norm=norm,
                         space_to_depth=config.space_to_depth,
                         tune_convolutions=None if config.tune_convolutions else False)


def build_export_network(config: Config, network: keras.Model) -> keras.Model:
    """``network``'s twin built outside any strategy, holding its trained values, for export.

    Exported from the distributed network itself, each moving statistic would be read in the SavedModel as a mean
    over per-replica reads pinned to the training devices (~2 x 53 x replicas reads, served elsewhere only by soft
    placement). The twin has one replica's layers (per-replica batch norm at inference is the same function of
    the same variables); ``get_weights`` reads each synchronized-on-read statistic as its mean over the replicas,
    the value a checkpoint holds. Call outside ``strategy.scope()``."""
    twin = build_network(dataclasses.replace(config, bn_group_size=1, bn_span=None), 1)
    twin.set_weights(network.get_weights())
    return twin


def export_settings(config: Config) -> dict:
    """export.export_saved_model's preprocessing settings from a Config: the evaluation crop of training."""
    return dict(image_size=config.image_size, crop_fraction=config.eval_crop, resize_method=config.resize_method,
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
                         variant=config.lars_variant)
    if config.optimizer == 'rmsprop_warmup':
        return rmsprop_warmup.RMSpropWarmup(learning_rate, build_alpha_sgd(config),
                                            rms_learning_rate=config.rms_learning_rate, momentum=config.momentum)
    return sgd.SGD(learning_rate, momentum=config.momentum, nesterov=config.nesterov)


def loss_weight_decay(config: Config) -> float:
    """Weight decay added to the loss: none with LARS, which decays inside its update, except for MLPerf v0.6's
    rule, which had it in the loss."""
    if config.optimizer == 'lars' and config.lars_variant != 'mlperf_v0.6':
        return 0.0
    return config.weight_decay


def loss_decayed_variables(config: Config, network: keras.Model):
    """Which variables the loss's weight decay applies to: kernels (regularization.is_decayed), or with LARS
    'mlperf_v0.6' every variable but the batch-norm parameters, as its resnet_main.py (lines 391-393) did."""
    if config.optimizer != 'lars' or config.lars_variant != 'mlperf_v0.6':
        return regularization.is_decayed
    batch_norm_variables = {variable.ref() for layer in batch_norm.batch_norm_layers(network)
                            for variable in layer.trainable_variables}
    return lambda variable: variable.ref() not in batch_norm_variables


def build_gradient_all_reduce(config: Config, strategy: tf.distribute.Strategy):
    """None for the strategy's own all-reduce, else a callable summing gradients with all_reduce_2d."""
    if config.allreduce == 'default' or strategy.num_replicas_in_sync == 1:
        return None
    mesh = strategy_lib.replica_mesh_shape(strategy, config.mesh_shape, config.cores_per_chip)
    dtype = tf.bfloat16 if config.allreduce_dtype == 'bfloat16' else None
    bucket_bytes = int(config.allreduce_bucket_mb * 2 ** 20)
    order = strategy_lib.replica_order(strategy)
    return lambda gradients: collectives.all_reduce_2d(gradients, mesh, bucket_bytes=bucket_bytes, dtype=dtype,
                                                       replica_order=order)


def build_classifier(config: Config) -> classifier_lib.Classifier:
    """Network and optimizer, compiled; call inside ``strategy.scope()`` (replicas and mesh come from it)."""
    strategy = tf.distribute.get_strategy()
    if config.gradient_noise_scale and strategy.num_replicas_in_sync < 2:
        raise ConfigError('--gradient_noise_scale needs 2 or more replicas: it compares the gradient of one '
                          "replica's batch with the global batch's")
    network = build_network(config, strategy.num_replicas_in_sync, strategy_lib.replica_order(strategy))
    classifier = classifier_lib.Classifier(network, global_batch_size=config.global_batch_size,
                                           noise_scale=noise_scale.GradientNoiseScale()
                                           if config.gradient_noise_scale else None,
                                           weight_decay=loss_weight_decay(config),
                                           decayed=loss_decayed_variables(config, network),
                                           label_smoothing=config.label_smoothing,
                                           gradient_all_reduce=build_gradient_all_reduce(config, strategy))
    # weighted_metrics=[]: Classifier.test_step weights its own metrics (padding has weight 0); without it Keras
    # warns at every evaluation that weights came without compiled weighted metrics.
    classifier.compile(optimizer=build_optimizer(config), jit_compile=use_jit(config, strategy),
                       steps_per_execution=steps_per_execution(config, strategy), weighted_metrics=[])
    # The step's outputs are the metrics' results, already over every replica: Keras's default ('auto') sums
    # them over the workers of a MultiWorkerMirroredStrategy, so progress lines showed loss x workers.
    classifier.distribute_reduction_method = 'first'
    # Create the optimizer's slots now, so a checkpoint restores into existing variables.
    classifier.optimizer.build(classifier.network.trainable_variables)
    return classifier


def tune_convolutions(network: keras.Model, config: Config, num_replicas: int, print_fn=print) -> None:
    """Times the convolutions' and batch norms' formulations on this machine before the input pipeline starts,
    for the per-replica batch (cpu/convolution.py, cpu/batch_norm.py: CPU-only machines, not --deterministic,
    float32); shapes timed before on this machine come from its tuning cache (cpu/tuning.py)."""
    started = time.perf_counter()
    tuned = cpu.tune_network(network, config.global_batch_size // num_replicas, num_replicas)
    convolutions, norms = tuned['convolution'], tuned['batch_norm']
    if convolutions or norms:
        others = sum(any(name != cpu.convolution.DEFAULT for name in choice.values()) for choice in convolutions.values())
        formulations = sorted(set(norms.values()))
        print_fn(f'kernels tuned to this machine: {len(convolutions)} convolution shapes ({others} computed another '
                 f"way than TensorFlow's convolution op), {len(norms)} batch-norm shapes "
                 f"({', '.join(f'{name} {list(norms.values()).count(name)}' for name in formulations) or 'none'}) "
                 f'in {time.perf_counter() - started:.1f} s')


def use_jit(config: Config, strategy: tf.distribute.Strategy) -> bool:
    """XLA for the train step: as configured (refused under several CPU replicas of one process), else on where
    every replica is a GPU (strategy.xla_by_default)."""
    if config.jit_compile is not None:
        if config.jit_compile:
            strategy_lib.check_jit_compile(strategy)
        return config.jit_compile
    return strategy_lib.xla_by_default(strategy)


def steps_per_execution(config: Config, strategy: tf.distribute.Strategy) -> int:
    """Steps run per host call (default_steps_per_execution for the strategy's kind)."""
    return default_steps_per_execution(config, strategy_lib.is_tpu_strategy(strategy))


def default_steps_per_execution(config: Config, on_tpu: bool) -> int:
    """Steps run per host call: as configured, else 100 on TPU (each call is a host round trip), capped by an
    epoch, and 1 elsewhere."""
    if config.steps_per_execution:
        return config.steps_per_execution
    if on_tpu:
        return min(100, config.steps_per_epoch)
    return 1


def planned_evaluations(config: Config) -> int:
    """Evaluations a fresh run does: those of its model.fit calls (checkpointing.fit_segments, Keras validating
    after every epoch e with (e + 1) % eval_every_epochs == 0) and a final one, unless the last epoch's validation
    was of the final weights already; none on synthetic data."""
    if config.synthetic_data:
        return 0
    segments = checkpointing.fit_segments(0, config.train_steps, config.steps_per_epoch)
    during = sum((epoch + 1) % config.eval_every_epochs == 0
                 for segment in segments for epoch in range(segment.initial_epoch, segment.epochs))
    return during + (0 if segments and validates_last_epoch(config, segments[-1]) else 1)


def validates_last_epoch(config: Config, segment: checkpointing.FitSegment) -> bool:
    """Whether Keras validates after the last epoch of the fit call ``segment`` (validation_freq: after epoch e
    with (e + 1) % eval_every_epochs == 0): then that validation, of the final weights, is the run's final
    evaluation, and none follows it."""
    return segment.epochs % config.eval_every_epochs == 0


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


def build_train_dataset(config: Config, strategy: tf.distribute.Strategy, start_step: int = 0,
                        skip_counts: Optional[SkipCounts] = None):
    """The distributed training stream from step ``start_step`` on (input_pipeline.train_dataset); bad
    records are counted into ``skip_counts``. Each model.fit call iterates its dataset from the beginning, so
    a fit that starts at step N needs the stream built for N."""
    if config.synthetic_data:
        return strategy.distribute_datasets_from_function(
            lambda context: input_pipeline.synthetic_dataset(config, context), _input_options(config))
    if config.data_service:
        data_service.check_reachable(config.data_service)
        print(f'training input from the tf.data service at {config.data_service} ({config.data_service_mode})',
              flush=True)
        return strategy.distribute_datasets_from_function(
            lambda context: data_service.train_dataset(config, context, start_step), _input_options(config))
    return strategy.distribute_datasets_from_function(
        lambda context: input_pipeline.train_dataset(config, context, start_step=start_step,
                                                     skip_counts=skip_counts), _input_options(config))


def build_eval_dataset(config: Config, strategy: tf.distribute.Strategy,
                       skip_counts: Optional[SkipCounts] = None):
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
        for path in record_io.list_shards(config.data_dir, split)[:LABEL_CHECK_SHARDS]:
            record_io.check_labels(path, config.num_classes, config.label_offset, config.bad_records == 'fatal')


def build_datasets(config: Config, strategy: tf.distribute.Strategy, start_step: int = 0,
                   skip_counts: Optional[SkipCounts] = None):
    """(train, eval) distributed datasets; eval is None for synthetic data."""
    if config.synthetic_data:
        return build_train_dataset(config, strategy), None
    if not start_step:     # checked at the run's start; a resumed run reads only where it resumes
        check_data(config)
    return (build_train_dataset(config, strategy, start_step, skip_counts),
            build_eval_dataset(config, strategy, skip_counts))



def build_callbacks(config: Config, classifier: classifier_lib.Classifier, strategy: tf.distribute.Strategy,
                    manager: Optional[tf.train.CheckpointManager], skip_counts: SkipCounts, train_data,
                    print_fn=print, on_sigterm: Optional[keras.callbacks.Callback] = None) -> list:
    """The run's callbacks, in the order they must run: InputWatchdog first (its clock starts before the others'
    work); Progress and ReportSkips add to the epoch logs, so they come before TensorBoard; StopOnNonFiniteLoss
    comes before Checkpoints, so a diverged step is never saved."""
    callbacks = [callbacks_lib.InputWatchdog(60 * config.input_timeout_minutes, describe_input(config))
                 ] if config.input_timeout_minutes else []
    callbacks += [callbacks_lib.Progress(config.train_steps, config.global_batch_size, config.log_every_steps,
                                         print_fn, config.num_train_images),
                  callbacks_lib.ReportSkips(skip_counts, print_fn), callbacks_lib.StopOnNonFiniteLoss()]
    if manager is not None:
        callbacks += [checkpointing.Checkpoints(manager, config.checkpoint_every_steps),
                      on_sigterm or checkpointing.SaveOnSigterm(manager, print_fn, config.termination_grace_seconds)]
    if config.norm != 'none':   # evaluation with the statistics a checkpoint and the export hold
        callbacks.append(callbacks_lib.AverageMovingStatistics(classifier.network, strategy))
        if config.bn_inference_statistics == 'reestimate':
            callbacks.append(callbacks_lib.ReestimateBatchNorm(classifier.network, train_data,
                                                               config.bn_reestimate_batches, strategy))
    if config.model_dir and checkpointing.is_chief(strategy) and config.profile_steps:
        callbacks.append(callbacks_lib.ProfileSteps(*config.profile_steps, os.path.join(config.model_dir, 'logs'),
                                                    print_fn))
    if config.model_dir and checkpointing.is_chief(strategy):
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(config.model_dir, 'logs'), update_freq='epoch',
                                                     profile_batch=0))
    return callbacks


def describe_input(config: Config) -> str:
    """What the training input reads, in a few words (for errors about it)."""
    if config.synthetic_data:
        return 'the synthetic input'
    if config.data_service:
        return f'the tf.data service at {config.data_service}'
    return f'the input ({tfrecord.file_pattern(config.data_dir or "", tfrecord.TRAIN)} and its validation files)'


# Marks of an error raised inside the input pipeline (the iterator's ops, the record reader, the decoders).
_INPUT_ERROR_MARKS = ('IteratorGetNext', 'MultiDeviceIterator', 'record at', 'JPEG', 'jpeg', 'image file format',
                      'Feature:', 'image too large', 'to_model_label', 'label', record_io.NO_USABLE_RECORD)


def is_input_error(error: tf.errors.OpError) -> bool:
    """Whether a runtime error of fit or evaluate came from the input pipeline rather than from the step."""
    return isinstance(error, tf.errors.DataLossError) or any(mark in error.message for mark in _INPUT_ERROR_MARKS)


@contextlib.contextmanager
def input_errors():
    """A bad record met inside the input pipeline under bad_records='fatal' (a JPEG that does not decode, a label
    outside the range, a missing feature, a file cut mid-record) surfaces from fit or evaluate as a TensorFlow
    runtime error; inside this block it becomes a DataError naming what was wrong, and an input in which every
    record fails a DataError saying so. Any other runtime error of the step is a StepError (not a bad record)."""
    try:
        yield
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
        summary = summarize_graph_error(error.message)
        if record_io.NO_USABLE_RECORD in error.message:
            found = error.message[error.message.index(record_io.NO_USABLE_RECORD):]
            raise DataError(found.splitlines()[0].split(' [Condition')[0].rstrip('] ')) from None
        if is_input_error(error):
            raise DataError(f'bad input record: {summary}') from None
        raise StepError(f'the step failed: {summary}') from None


def _step(classifier: keras.Model) -> int:
    return int(classifier.optimizer.iterations.numpy())


def fit(config: Config, classifier: classifier_lib.Classifier, strategy: tf.distribute.Strategy, train_data,
        eval_data, callbacks: list, skip_counts: SkipCounts) -> dict:
    """Trains from the classifier's step to config.train_steps, one model.fit call per fit segment, evaluating
    every eval_every_epochs epochs; returns the steps reached, the last epoch's train_loss and images_per_second,
    and, when the last epoch was validated, that validation's figures as 'final_validation' (the final weights'
    evaluation). Raises Preempted after a SIGTERM save, InputEnded when a fit call's input ran out."""
    start_step = _step(classifier)
    eval_steps = config.eval_steps_for(strategy_lib.num_input_pipelines(strategy))
    validate = eval_data is not None and config.eval_every_epochs
    sigterm = next((c for c in callbacks if isinstance(c, checkpointing.SaveOnSigterm)), None)
    train_loss, images_per_second, evaluations, noise, final_validation = float('nan'), 0.0, 0, None, None
    for segment in checkpointing.fit_segments(start_step, config.train_steps, config.steps_per_epoch):
        step = _step(classifier)
        if step != start_step:   # a later fit call: the stream must continue where the last one stopped
            train_data = build_train_dataset(config, strategy, step, skip_counts)
        planned = step + (segment.epochs - segment.initial_epoch) * segment.steps_per_epoch
        with callbacks_lib.watch_input_end() as input_end:
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
        reached = _step(classifier)
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
            if 'noise_scale' in history.history:
                noise = float(history.history['noise_scale'][-1])
        if history:
            evaluations += len(history.history.get('val_loss', []))
        final_validation = None
        if (history and validate and reached == config.train_steps and validates_last_epoch(config, segment)
                and history.history.get('val_loss')):
            # Keras's validation logs are evaluate()'s results, each name prefixed with 'val_'.
            final_validation = {name[len('val_'):]: float(values[-1]) for name, values in history.history.items()
                                if name.startswith('val_')}
    return {'steps': _step(classifier), 'train_loss': float(train_loss),
            'images_per_second': float(images_per_second), 'evaluations': evaluations,
            **({'noise_scale': noise} if noise is not None else {}),
            **({'final_validation': final_validation} if final_validation else {})}


def evaluate(config: Config, classifier: classifier_lib.Classifier, strategy: tf.distribute.Strategy,
             eval_data, callbacks: list, print_fn=print) -> dict:
    """Held-out loss, top_1 and top_5 over every validation image once, and eval_images (the count)."""
    eval_steps = config.eval_steps_for(strategy_lib.num_input_pipelines(strategy))
    kept = (callbacks_lib.InputWatchdog, callbacks_lib.AverageMovingStatistics, callbacks_lib.ReestimateBatchNorm,
            checkpointing.SaveOnSigterm)
    evaluated = classifier.evaluate(eval_data, steps=eval_steps, verbose=0, return_dict=True,
                                    callbacks=[c for c in callbacks if isinstance(c, kept)])
    return report_evaluation(config, classifier, evaluated, print_fn)


def report_evaluation(config: Config, classifier: classifier_lib.Classifier, evaluated: dict,
                      print_fn=print) -> dict:
    """An evaluation's results (Keras's figures, and eval_images from the metrics it has just updated),
    printed as the held-out line."""
    results = {name: float(value) for name, value in evaluated.items()}
    results['eval_images'] = int(classifier.top_1.count.numpy())
    print_fn(f'held-out top-1 {100 * results["top_1"]:.2f}% top-5 {100 * results["top_5"]:.2f}% '
             f'loss {results["loss"]:.4f} on {results["eval_images"]} images')
    if results['eval_images'] != config.num_eval_images:
        print_fn(f'warning: evaluated {results["eval_images"]} images but --num_eval_images='
                 f'{config.num_eval_images}; set it to the size of the validation set (or see the skipped '
                 'bad records above)')
    return results


def run_counts(config: Config, strategy: tf.distribute.Strategy) -> dict:
    """What the run was made of (results.json; imagenet-tpu-plan predicts the same counts): replicas, input
    pipelines, images per replica and per batch-norm group."""
    replicas = strategy.num_replicas_in_sync
    per_replica = config.global_batch_size // replicas
    group = config.bn_group_size_for(replicas) if config.norm != 'none' else 1
    return {'replicas': replicas, 'input_pipelines': strategy_lib.num_input_pipelines(strategy),
            'per_replica_batch': per_replica, 'bn_group_images': group * per_replica}


def train_and_evaluate(config: Config, strategy: Optional[tf.distribute.Strategy] = None, print_fn=print) -> dict:
    """Trains for config.train_steps (resuming from config.model_dir), evaluates, returns the final metrics; the
    command line is this function and nothing more.

    Returns a dict with top_1, top_5, loss (held-out; absent for synthetic data), train_loss, steps,
    images_per_second, wall_seconds and the input's bad_records and truncated_files. Raises a subclass of
    errors.RunError on failure: Preempted after saving a checkpoint when SIGTERM arrives during training (and if
    no step ends within config.termination_grace_seconds, the process exits with status 143: termination.py).
    """
    started = time.perf_counter()
    strategy = strategy or build_strategy(config)
    with termination.during_training(config.termination_grace_seconds):
        prepare_process(config)
        chief = checkpointing.is_chief(strategy)
        lock = checkpointing.prepare_model_dir(config, chief, print_fn) if config.model_dir else None
        try:
            return _train_and_evaluate(config, strategy, chief, started, print_fn)
        finally:
            if lock is not None:
                lock.release()


def _train_and_evaluate(config: Config, strategy: tf.distribute.Strategy, chief: bool, started: float,
                        print_fn) -> dict:
    check_replicas(config, strategy.num_replicas_in_sync)
    strategy_lib.check_mesh(strategy, config.mesh_shape, config.cores_per_chip)
    with strategy.scope():
        classifier = build_classifier(config)
    tune_convolutions(classifier.network, config, strategy.num_replicas_in_sync, print_fn)
    manager, on_sigterm = (checkpointing.resume(classifier, config.model_dir, strategy, print_fn,
                                                config.termination_grace_seconds)
                           if config.model_dir else (None, None))

    start_step = _step(classifier)
    skip_counts = SkipCounts()
    train_data, eval_data = build_datasets(config, strategy, start_step, skip_counts)
    if config.model_dir and chief:
        checkpointing.record_run(config)     # only now: the data has been checked
    callbacks = build_callbacks(config, classifier, strategy, manager, skip_counts, train_data, print_fn,
                                on_sigterm)
    print_fn(f'{config.depth}-layer ResNet, {strategy.num_replicas_in_sync} replicas '
             f'({type(strategy).__name__}), global batch {config.global_batch_size}, '
             f'{config.steps_per_epoch} steps/epoch, {config.train_steps} steps')
    if start_step >= config.train_steps:
        print_fn(f'step {start_step} of {config.train_steps} was reached by an earlier run: nothing to train')
    try:
        with input_errors():
            results = fit(config, classifier, strategy, train_data, eval_data, callbacks, skip_counts)
            validated = results.pop('final_validation', None)
            if validated is not None:      # the last epoch's validation evaluated the final weights
                results.update(report_evaluation(config, classifier, validated, print_fn))
            elif eval_data is not None:
                results.update(evaluate(config, classifier, strategy, eval_data, callbacks, print_fn))
                results['evaluations'] += 1
    finally:
        for callback in callbacks:
            if isinstance(callback, callbacks_lib.InputWatchdog):
                callback.close()
    results.update(skip_counts.totals())
    results.update(run_counts(config, strategy))

    if config.model_dir and chief and config.export_saved_model:
        path = os.path.join(config.model_dir, 'saved_model')
        names, _ = labels.class_names(config.num_classes, config.label_offset, config.data_dir)
        export.export_saved_model(build_export_network(config, classifier.network), path, names,
                                  **export_settings(config))
        print_fn(f'exported {path}')
    results['wall_seconds'] = time.perf_counter() - started
    if config.model_dir and chief:
        path = os.path.join(config.model_dir, 'results.json')
        if results['steps'] == start_step:
            results = {**training_figures(path), **results_without_training(results)}
        checkpointing.write_json(path, results)
    return results


TRAINING_FIGURES = ('train_loss', 'images_per_second', 'wall_seconds')


def training_figures(path: str) -> dict:
    """The training figures (TRAINING_FIGURES) of an earlier results.json, {} if it is missing or unreadable."""
    try:
        with tf.io.gfile.GFile(path) as f:
            previous = json.load(f)
    except (tf.errors.OpError, ValueError, UnicodeDecodeError):
        return {}
    return {name: previous[name] for name in TRAINING_FIGURES if isinstance(previous, dict) and name in previous}


def results_without_training(results: dict) -> dict:
    """A run that trained no step keeps the training figures of the run that did (training_figures)."""
    return {name: value for name, value in results.items() if name not in TRAINING_FIGURES}
