"""The builders: Config -> the objects of a run (strategy, network, optimizer, compiled classifier, datasets,
callbacks, and the export twin). train.py, evaluate.py, deploy.py and plan/ build from here; a user who prefers
plain Keras calls them one by one and gets plain Keras objects (docs/guide.md, "From Python").
"""

import contextlib
import dataclasses
import os
from typing import Optional

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu import files
from imagenet_tpu.config import Config
from imagenet_tpu.data import data_service, eval_input, input_pipeline, record_io, tfrecord
from imagenet_tpu.data.record_io import SkipCounts
from imagenet_tpu.distribute import collectives
from imagenet_tpu.distribute import strategy as strategy_lib
from imagenet_tpu.errors import ConfigError, summarize_graph_error
from imagenet_tpu.model import batch_norm, resnet
from imagenet_tpu.model import classifier as classifier_lib
from imagenet_tpu.optim import lars, noise_scale, regularization, rmsprop_warmup, schedules, sgd
from imagenet_tpu.training import callbacks as callbacks_lib
from imagenet_tpu.training import checkpoints, sigterm_saves


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

    Per-replica batch norm with moving averages is Keras's layer; replica groups, and the Akiba et al. or
    re-estimated inference statistics, use batch_norm.GroupBatchNormalization.
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
                         space_to_depth=config.space_to_depth)


def build_export_network(config: Config, network: keras.Model) -> keras.Model:
    """``network``'s twin built outside any strategy, holding its trained values, for export.

    Exported from the distributed network itself, each moving statistic would be read in the SavedModel as a mean
    over per-replica reads pinned to the training devices (~2 x 53 x replicas reads, served elsewhere only by soft
    placement). The twin has one replica's layers (per-replica batch norm at inference is the same function of
    the same variables); ``get_weights`` reads each synchronized-on-read statistic as its mean over the replicas,
    the value a checkpoint holds. Call outside ``strategy.scope()``.

    The twin computes in float32 whatever the run's precision: a bfloat16 network's graph does not convert to
    TensorFlow Lite ("'tf.Sub' op is neither a custom op nor a flex op") and serves slowly on CPUs. Its variables
    are float32 under every policy, so the trained values carry over unchanged."""
    twin = build_network(dataclasses.replace(config, bn_group_size=1, bn_span=None, precision='float32'), 1)
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
    if (config.gradient_noise_scale and config.norm != 'none'
            and config.bn_group_size_for(strategy.num_replicas_in_sync) > 1):
        raise ConfigError("--gradient_noise_scale needs each replica's gradient to depend on its own images only; "
                          'batch norm over groups of replicas couples them and biases the estimate: measure it with '
                          '--bn_group_size=1')
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
        try:
            return strategy.distribute_datasets_from_function(
                lambda context: data_service.train_dataset(config, context, start_step), _input_options(config))
        except tf.errors.OpError as error:     # e.g. a worker's port: it answers, but not as a dispatcher
            raise ConfigError(f'the tf.data service at {config.data_service} did not take the dataset '
                              f'({type(error).__name__}: {summarize_graph_error(error.message)}); is it the '
                              "dispatcher's address (not a worker's)?") from None
    paths = record_io.list_shards(config.data_dir, tfrecord.TRAIN)    # once, for every host's pipeline
    shards = (paths, record_io.file_sizes(paths))
    return strategy.distribute_datasets_from_function(
        lambda context: input_pipeline.train_dataset(config, context, start_step=start_step,
                                                     skip_counts=skip_counts, shards=shards), _input_options(config))


def build_eval_dataset(config: Config, strategy: tf.distribute.Strategy,
                       skip_counts: Optional[SkipCounts] = None):
    """The distributed evaluation batches: every validation image once (eval_input.eval_dataset)."""
    return strategy.distribute_datasets_from_function(
        lambda context: eval_input.eval_dataset(config, context, skip_counts=skip_counts),
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
                    print_fn=print, on_sigterm: Optional[keras.callbacks.Callback] = None,
                    watchdog: Optional[callbacks_lib.InputWatchdog] = None) -> list:
    """The run's callbacks, in the order they must run: InputWatchdog first (its clock starts before the others'
    work; ``watchdog``: the one build_watchdog made to watch the start-up); Progress and ReportSkips add to the
    epoch logs, so they come before TensorBoard; StopOnNonFiniteLoss comes before Checkpoints, so a diverged step
    is never saved."""
    watchdog = watchdog or build_watchdog(config)
    callbacks = [watchdog] if watchdog else []
    callbacks += [callbacks_lib.Progress(config.train_steps, config.global_batch_size, config.log_every_steps,
                                         print_fn, config.num_train_images),
                  callbacks_lib.ReportSkips(skip_counts, print_fn),
                  callbacks_lib.StopOnNonFiniteLoss(nonfinite=checkpoints.nonfinite_variables)]
    if manager is not None:
        callbacks += [checkpoints.Checkpoints(manager, config.checkpoint_every_steps),
                      on_sigterm or sigterm_saves.SaveOnSigterm(manager, print_fn, config.termination_grace_seconds)]
    if config.norm != 'none':   # evaluation with the statistics a checkpoint and the export hold
        callbacks.append(callbacks_lib.AverageMovingStatistics(classifier.network, strategy))
        if config.bn_inference_statistics == 'reestimate':
            callbacks.append(callbacks_lib.ReestimateBatchNorm(classifier.network, train_data,
                                                               config.bn_reestimate_batches, strategy))
    if config.model_dir and checkpoints.is_chief(strategy):
        files.real_directory(os.path.join(config.model_dir, 'logs'))     # a link planted there: removed, not followed
    if config.model_dir and checkpoints.is_chief(strategy) and config.profile_steps:
        callbacks.append(callbacks_lib.ProfileSteps(*config.profile_steps, os.path.join(config.model_dir, 'logs'),
                                                    print_fn))
    if config.model_dir and checkpoints.is_chief(strategy):
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(config.model_dir, 'logs'), update_freq='epoch',
                                                     profile_batch=0))
    return callbacks


def build_watchdog(config: Config) -> Optional[callbacks_lib.InputWatchdog]:
    """The run's InputWatchdog (None with --input_timeout_minutes=0)."""
    if not config.input_timeout_minutes:
        return None
    return callbacks_lib.InputWatchdog(60 * config.input_timeout_minutes, describe_input(config))


def describe_input(config: Config) -> str:
    """What the training input reads, in a few words (for errors about it)."""
    if config.synthetic_data:
        return 'the synthetic input'
    if config.data_service:
        return f'the tf.data service at {config.data_service}'
    return f'the input ({tfrecord.file_pattern(config.data_dir or "", tfrecord.TRAIN)} and its validation files)'


def run_counts(config: Config, strategy: tf.distribute.Strategy) -> dict:
    """What the run was made of (results.json; imagenet-tpu-plan predicts the same counts): replicas, input
    pipelines, images per replica and per batch-norm group."""
    replicas = strategy.num_replicas_in_sync
    per_replica = config.global_batch_size // replicas
    group = config.bn_group_size_for(replicas) if config.norm != 'none' else 1
    return {'replicas': replicas, 'input_pipelines': strategy_lib.num_input_pipelines(strategy),
            'per_replica_batch': per_replica, 'bn_group_images': group * per_replica}
