"""Command line: absl flags -> Config -> train.train_and_evaluate. The only module that defines flags.

    imagenet-tpu-train --flagfile=flags/demo.cfg
    imagenet-tpu-train --flagfile=flags/tpu_v3_8.cfg --data_dir=gs://... --model_dir=gs://...

Bad input (missing data, settings that cannot work) ends with one line `error: ...` on stderr and exit status 2;
SIGTERM during training saves a checkpoint and exits with status 143 (run the same command to continue).
"""

import functools
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # keep TensorFlow's C++ start-up chatter out of the progress

from imagenet_tpu import runtime  # first: sets oneDNN before TensorFlow is imported (runtime.py)

tf = runtime.import_tensorflow()
from absl import app, flags, logging  # noqa: E402
import tf_keras as keras  # noqa: E402

from imagenet_tpu import input_pipeline, strategy, train  # noqa: E402
from imagenet_tpu.config import Config, ConfigError

_DEFAULTS = Config()

# Data.
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'Directory of train-*-of-* and validation-*-of-* TFRecord shards.')
_SYNTHETIC_DATA = flags.DEFINE_bool('synthetic_data', False, 'Train on one fixed random batch (no input cost, '
                                    'no evaluation): measures the model alone.')
_NUM_CLASSES = flags.DEFINE_integer('num_classes', _DEFAULTS.num_classes, 'Classes the model predicts.')
_LABEL_OFFSET = flags.DEFINE_integer(
    'label_offset', _DEFAULTS.label_offset,
    'On-disk label of model class 0. ImageNet shards store 1..1000: 1 with --num_classes=1000, '
    'or 0 with --num_classes=1001 (unused background class 0).')
_NUM_TRAIN_IMAGES = flags.DEFINE_integer('num_train_images', _DEFAULTS.num_train_images,
                                         'Images in one training epoch (ImageNet: 1,281,167).')
_NUM_EVAL_IMAGES = flags.DEFINE_integer('num_eval_images', _DEFAULTS.num_eval_images,
                                        'Validation images (ImageNet: 50,000); all are evaluated.')
_IMAGE_SIZE = flags.DEFINE_integer('image_size', _DEFAULTS.image_size, 'Network input side, in pixels.')
_RANDOM_CROP_MIN_AREA = flags.DEFINE_float('random_crop_min_area', _DEFAULTS.random_crop_min_area,
                                           'Smallest random crop as a fraction of the image area (Inception: 0.08).')
_CROP_BOXES = flags.DEFINE_bool(
    'crop_boxes', _DEFAULTS.crop_boxes,
    "Sample training crops to cover at least 10% of one of the record's ILSVRC boxes. Off (default): against the "
    'whole image, as tensorflow/tpu, the MLPerf submissions and tf-models-official do.')
_EVAL_CROP_FRACTION = flags.DEFINE_float('eval_crop_fraction', _DEFAULTS.eval_crop_fraction,
                                         'Evaluation keeps this share of the shorter side, centred (224 of 256).')
_EVAL_CROP_PADDING = flags.DEFINE_integer(
    'eval_crop_padding', None, "Instead of --eval_crop_fraction, tensorflow/tpu's convention: keep image_size / "
    '(image_size + padding) of the shorter side (its CROP_PADDING is 32: 0.875 at 224, 0.8 at 128).')
_RANDOM_FLIP = flags.DEFINE_bool('random_flip', _DEFAULTS.random_flip, 'Random left-right flips in training.')
_SHUFFLE_BUFFER = flags.DEFINE_integer('shuffle_buffer', _DEFAULTS.shuffle_buffer,
                                       'Records in the shuffle buffer of each input pipeline.')
_INTERLEAVE_CYCLE_LENGTH = flags.DEFINE_integer('interleave_cycle_length', _DEFAULTS.interleave_cycle_length,
                                               'Training files read at once by each input pipeline.')
_INTERLEAVE_BLOCK_LENGTH = flags.DEFINE_integer('interleave_block_length', _DEFAULTS.interleave_block_length,
                                               'Consecutive records taken from one file before the next.')
_READ_BUFFER_MB = flags.DEFINE_float('read_buffer_mb', _DEFAULTS.read_buffer_mb,
                                     'Read buffer of each open TFRecord file, in MiB.')
_INPUT_THREADS = flags.DEFINE_integer('input_threads', _DEFAULTS.input_threads,
                                      "Threads of each input pipeline's private pool (0: TensorFlow's shared pool).")
_INPUT_CACHE = flags.DEFINE_enum('input_cache', _DEFAULTS.input_cache, ['none', 'records', 'images'],
                                 'Keep the training set in memory: encoded records, or decoded images (small '
                                 'sets only: about 500 KB per ImageNet image).')
_BAD_RECORDS = flags.DEFINE_enum('bad_records', _DEFAULTS.bad_records, ['skip', 'fatal'],
                                 'A record whose JPEG does not decode, that lacks a feature or has a label out '
                                 'of range, or a TFRecord file cut mid-record: skip and count it, or stop.')
_PREFETCH_TO_DEVICE = flags.DEFINE_integer('prefetch_to_device', _DEFAULTS.prefetch_to_device,
                                           "Batches buffered on each replica's device.")
_DETERMINISTIC = flags.DEFINE_bool('deterministic', False,
                                   'Reproducible runs: deterministic TensorFlow ops and record order, so a run '
                                   'resumed after a crash ends with the same weights as an uninterrupted one '
                                   '(slower input on slow file systems).')

# Model.
_DEPTH = flags.DEFINE_enum('depth', str(_DEFAULTS.depth), ['10', '18', '34', '50', '101', '152', '200'],
                            'ResNet depth.')
_NORM = flags.DEFINE_enum('norm', _DEFAULTS.norm, ['batch_norm', 'none'], 'Normalization layers.')
_SPACE_TO_DEPTH = flags.DEFINE_bool('space_to_depth', False, "MLPerf v0.7's TPU stem: 2x2 space-to-depth images "
                                    'and a 4x4 stride-1 convolution, exactly equivalent to the 7x7 stride-2 one.')
_PRECISION = flags.DEFINE_enum('precision', 'float32', ['float32', 'mixed_bfloat16', 'mixed_float16'],
                               'Compute precision: mixed_bfloat16 on TPU (and CPUs with bfloat16), mixed_float16 '
                               'with loss scaling on GPU. Variables, BN statistics and the loss stay float32.')
_JIT_COMPILE = flags.DEFINE_bool('jit_compile', None, 'XLA-compile the train step (default: on with GPUs, off on '
                                 'CPUs; TPUs always compile).')
_STEPS_PER_EXECUTION = flags.DEFINE_integer('steps_per_execution', None, 'Training steps per host call (default: '
                                            '100 on TPU, capped by an epoch; 1 elsewhere).')
_BN_MOMENTUM = flags.DEFINE_float('bn_momentum', _DEFAULTS.bn_momentum,
                                  'Batch-norm moving-average momentum (0.9 as the recipes; 0.99 lags on short runs).')
_BN_EPSILON = flags.DEFINE_float('bn_epsilon', _DEFAULTS.bn_epsilon, 'Batch-norm epsilon.')
_BN_GROUP_SIZE = flags.DEFINE_integer('bn_group_size', _DEFAULTS.bn_group_size,
                                      'Replicas per batch-norm group (1: per replica; all: synchronized). '
                                      'Must divide the replica count.')
_BN_SPAN = flags.DEFINE_integer('bn_span', None, 'Images per batch norm (Ying et al.: ~32-64); sets the group '
                                'size to span / per-replica batch. Overrides --bn_group_size.')
_BN_INFERENCE_STATISTICS = flags.DEFINE_enum(
    'bn_inference_statistics', _DEFAULTS.bn_inference_statistics, ['moving_average', 'last_batch', 'reestimate'],
    "Statistics used for evaluation and export: moving averages; 'last_batch' (Akiba et al.: the last training "
    "batch's, over all replicas); 'reestimate' (--bn_reestimate_batches training batches before each evaluation).")
_BN_REESTIMATE_BATCHES = flags.DEFINE_integer('bn_reestimate_batches', _DEFAULTS.bn_reestimate_batches,
                                              "Training batches pooled by --bn_inference_statistics=reestimate.")
_MESH_SHAPE = flags.DEFINE_string('mesh_shape', None, 'Torus as XxY chips (e.g. 16x32): batch-norm groups become '
                                  '2-D tiles of neighbouring chips, and --allreduce=2d uses rows of X chips. '
                                  'Default: contiguous BN groups; for 2d, the TPU topology or a square mesh.')
_CORES_PER_CHIP = flags.DEFINE_integer('cores_per_chip', _DEFAULTS.cores_per_chip,
                                       'Replicas per chip on --mesh_shape (TPU v3: 2).')

# Optimization.
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer('global_batch_size', _DEFAULTS.global_batch_size,
                                          'Images per training step, summed over all replicas.')
_EVAL_BATCH_SIZE = flags.DEFINE_integer('eval_batch_size', _DEFAULTS.eval_batch_size,
                                        'Images per evaluation step, summed over all replicas.')
_TRAIN_EPOCHS = flags.DEFINE_float('train_epochs', _DEFAULTS.train_epochs, 'Length of training, in epochs.')
_TOTAL_STEPS = flags.DEFINE_integer('total_steps', None, 'Length of training in steps; overrides --train_epochs '
                                    '(MLPerf recipes state steps).')
_OPTIMIZER = flags.DEFINE_enum('optimizer', _DEFAULTS.optimizer, ['sgd', 'lars', 'rmsprop_warmup'],
                               "'sgd' (momentum), 'lars' (large batch), 'rmsprop_warmup' (Akiba et al.).")
_BASE_LEARNING_RATE = flags.DEFINE_float(
    'base_learning_rate', _DEFAULTS.base_learning_rate,
    'Learning rate per 256 images; the peak is base_learning_rate * global_batch_size / 256 (Goyal et al.).')
_LEARNING_RATE = flags.DEFINE_float('learning_rate', None, 'Peak learning rate itself; overrides '
                                    '--base_learning_rate (the LARS recipes state it: 31.2 at batch 32k).')
_MOMENTUM = flags.DEFINE_float('momentum', _DEFAULTS.momentum, 'Momentum of SGD, LARS and RMSprop warm-up (mu1).')
_NESTEROV = flags.DEFINE_bool('nesterov', _DEFAULTS.nesterov, 'Nesterov momentum (sgd, lars).')
_LARS_EETA = flags.DEFINE_float('lars_eeta', _DEFAULTS.lars_eeta, 'LARS trust coefficient (MLPerf: 0.001).')
_LARS_EPSILON = flags.DEFINE_float('lars_epsilon', _DEFAULTS.lars_epsilon,
                                   'Added to the LARS trust-ratio denominator (MLPerf v0.6: 1e-5, v0.7: 0).')
_LARS_TRUST_RATIO = flags.DEFINE_enum('lars_trust_ratio', _DEFAULTS.lars_trust_ratio, ['mlperf', 'tfm'],
                                      "LARS trust ratio: 'mlperf' (MLPerf / TF contrib) or 'tfm' "
                                      '(tf-models-official, to reuse its hyperparameters).')
_RMS_LEARNING_RATE = flags.DEFINE_float('rms_learning_rate', _DEFAULTS.rms_learning_rate,
                                        'RMSprop warm-up: rate of the RMSprop part (Akiba et al.: 3e-4).')
_ALPHA_SGD_CENTER_EPOCHS = flags.DEFINE_float('alpha_sgd_center_epochs', _DEFAULTS.alpha_sgd_center_epochs,
                                              'RMSprop warm-up: epoch where the blend is half SGD (Akiba: 10).')
_ALPHA_SGD_PERIOD_EPOCHS = flags.DEFINE_float('alpha_sgd_period_epochs', _DEFAULTS.alpha_sgd_period_epochs,
                                              'RMSprop warm-up: pure SGD from center + period/2 (Akiba: 5).')
_WEIGHT_DECAY = flags.DEFINE_float('weight_decay', _DEFAULTS.weight_decay,
                                   'L2 weight decay on kernels (never on batch-norm parameters or biases).')
_LABEL_SMOOTHING = flags.DEFINE_float('label_smoothing', _DEFAULTS.label_smoothing,
                                      'Label smoothing (0.1 in the large-batch recipes).')
_WARMUP_EPOCHS = flags.DEFINE_float('warmup_epochs', _DEFAULTS.warmup_epochs, 'Linear warm-up from 0, in epochs.')
_LR_DECAY = flags.DEFINE_enum('lr_decay', _DEFAULTS.lr_decay, ['step', 'polynomial', 'cosine', 'slow_start'],
                              "Decay after warm-up; 'slow_start' is Akiba et al.'s x0.5/0.075/0.01/0.001 at "
                              'epochs 0/40/70/85.')
_LR_DECAY_EPOCHS = flags.DEFINE_list('lr_decay_epochs', [str(e) for e in _DEFAULTS.lr_decay_epochs],
                                     "Epochs at which 'step' decay multiplies the rate by 0.1.")
_END_LEARNING_RATE = flags.DEFINE_float('end_learning_rate', _DEFAULTS.end_learning_rate,
                                        "Final rate of 'polynomial' decay.")
_POLYNOMIAL_POWER = flags.DEFINE_float('polynomial_power', _DEFAULTS.polynomial_power,
                                       "Power of 'polynomial' decay (MLPerf: 2).")

# Distribution.
_ALLREDUCE = flags.DEFINE_enum('allreduce', 'default', ['default', '2d'],
                               "Gradient summation: the strategy's own all-reduce, or '2d' (Ying et al.'s 2-D torus "
                               'all-reduce: reduce-scatter in rows, all-reduce in columns, all-gather in rows).')
_ALLREDUCE_DTYPE = flags.DEFINE_enum('allreduce_dtype', 'float32', ['float32', 'bfloat16'],
                                     "Type gradients are summed in with --allreduce=2d (bfloat16: half the bytes).")
_ALLREDUCE_BUCKET_MB = flags.DEFINE_float('allreduce_bucket_mb', 32.0,
                                          'With --allreduce=2d, gradients are packed into buckets of about this '
                                          'many MiB (a ResNet-50 has ~160 gradient tensors).')
_STRATEGY = flags.DEFINE_string('strategy', _DEFAULTS.strategy,
                                "'cpu' (N logical CPU devices), 'mirrored' (local GPUs), 'multi_worker' "
                                "(TF_CONFIG), 'tpu' or 'default' (no distribution).")
_NUM_CPU_DEVICES = flags.DEFINE_integer('num_cpu_devices', _DEFAULTS.num_cpu_devices,
                                        "Logical CPU devices (replicas) for --strategy=cpu.")
_TPU = flags.DEFINE_string('tpu', _DEFAULTS.tpu, "TPU name, or 'local' on a TPU VM.")

# Run.
_MODEL_DIR = flags.DEFINE_string('model_dir', None, 'Checkpoints, TensorBoard logs and results.json; a run '
                                 'restarted with the same model_dir resumes from its latest checkpoint.')
_EXPORT_SAVED_MODEL = flags.DEFINE_bool('export_saved_model', False, 'Write MODEL_DIR/saved_model (images -> '
                                        'logits, inference mode) at the end of training.')
_CHECKPOINT_EVERY_STEPS = flags.DEFINE_integer('checkpoint_every_steps', _DEFAULTS.checkpoint_every_steps,
                                               'Steps between checkpoints (one more is written at the end).')
_EVAL_EVERY_EPOCHS = flags.DEFINE_integer('eval_every_epochs', _DEFAULTS.eval_every_epochs,
                                          'Epochs between evaluations on the validation set.')
_LOG_EVERY_STEPS = flags.DEFINE_integer('log_every_steps', _DEFAULTS.log_every_steps,
                                        'Steps between progress lines inside an epoch (0: once per epoch).')
_SEED = flags.DEFINE_integer('seed', None, 'Seed of initialization and of the data order (None: random '
                             'initialization; the data order then uses seed 0, so a resumed run continues it).')


def parse_mesh_shape(text):
    """'16x32' -> (16, 32); None stays None."""
    if not text:
        return None
    try:
        x, y = (int(part) for part in text.lower().split('x'))
    except ValueError:
        raise ConfigError(f"--mesh_shape must look like 16x32 (chips in x and y), got {text!r}") from None
    return x, y


def config_from_flags() -> Config:
    return Config(
        data_dir=_DATA_DIR.value, num_classes=_NUM_CLASSES.value, label_offset=_LABEL_OFFSET.value,
        num_train_images=_NUM_TRAIN_IMAGES.value, num_eval_images=_NUM_EVAL_IMAGES.value,
        image_size=_IMAGE_SIZE.value, random_crop_min_area=_RANDOM_CROP_MIN_AREA.value, crop_boxes=_CROP_BOXES.value,
        eval_crop_fraction=_EVAL_CROP_FRACTION.value, eval_crop_padding=_EVAL_CROP_PADDING.value,
        random_flip=_RANDOM_FLIP.value, shuffle_buffer=_SHUFFLE_BUFFER.value,
        interleave_cycle_length=_INTERLEAVE_CYCLE_LENGTH.value, interleave_block_length=_INTERLEAVE_BLOCK_LENGTH.value,
        read_buffer_mb=_READ_BUFFER_MB.value, input_threads=_INPUT_THREADS.value, input_cache=_INPUT_CACHE.value,
        bad_records=_BAD_RECORDS.value, prefetch_to_device=_PREFETCH_TO_DEVICE.value,
        deterministic_input=_DETERMINISTIC.value,
        space_to_depth=_SPACE_TO_DEPTH.value, precision=_PRECISION.value, jit_compile=_JIT_COMPILE.value,
        steps_per_execution=_STEPS_PER_EXECUTION.value,
        depth=int(_DEPTH.value), norm=_NORM.value, bn_momentum=_BN_MOMENTUM.value, bn_epsilon=_BN_EPSILON.value,
        bn_group_size=_BN_GROUP_SIZE.value, bn_span=_BN_SPAN.value,
        bn_inference_statistics=_BN_INFERENCE_STATISTICS.value, bn_reestimate_batches=_BN_REESTIMATE_BATCHES.value,
        mesh_shape=parse_mesh_shape(_MESH_SHAPE.value), cores_per_chip=_CORES_PER_CHIP.value,
        export_saved_model=_EXPORT_SAVED_MODEL.value,
        global_batch_size=_GLOBAL_BATCH_SIZE.value, eval_batch_size=_EVAL_BATCH_SIZE.value,
        train_epochs=_TRAIN_EPOCHS.value, total_steps=_TOTAL_STEPS.value, optimizer=_OPTIMIZER.value,
        base_learning_rate=_BASE_LEARNING_RATE.value, learning_rate=_LEARNING_RATE.value, momentum=_MOMENTUM.value,
        nesterov=_NESTEROV.value, lars_eeta=_LARS_EETA.value, lars_epsilon=_LARS_EPSILON.value,
        lars_trust_ratio=_LARS_TRUST_RATIO.value, rms_learning_rate=_RMS_LEARNING_RATE.value,
        alpha_sgd_center_epochs=_ALPHA_SGD_CENTER_EPOCHS.value,
        alpha_sgd_period_epochs=_ALPHA_SGD_PERIOD_EPOCHS.value,
        weight_decay=_WEIGHT_DECAY.value, label_smoothing=_LABEL_SMOOTHING.value,
        warmup_epochs=_WARMUP_EPOCHS.value, lr_decay=_LR_DECAY.value,
        lr_decay_epochs=tuple(float(e) for e in _LR_DECAY_EPOCHS.value),
        end_learning_rate=_END_LEARNING_RATE.value, polynomial_power=_POLYNOMIAL_POWER.value,
        allreduce=_ALLREDUCE.value, allreduce_dtype=_ALLREDUCE_DTYPE.value,
        allreduce_bucket_mb=_ALLREDUCE_BUCKET_MB.value, strategy=_STRATEGY.value, num_cpu_devices=_NUM_CPU_DEVICES.value, tpu=_TPU.value,
        model_dir=_MODEL_DIR.value, checkpoint_every_steps=_CHECKPOINT_EVERY_STEPS.value,
        eval_every_epochs=_EVAL_EVERY_EPOCHS.value, log_every_steps=_LOG_EVERY_STEPS.value, seed=_SEED.value)


# Exit status after SIGTERM (128 + 15, as if the signal had ended the process): not done, run again to continue.
PREEMPTED_EXIT_STATUS = 143


def fail(message: str) -> None:
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel('WARNING')
    if len(argv) > 1:
        fail(f'unexpected arguments: {" ".join(argv[1:])}')
    runtime.limit_malloc_arenas()
    try:
        config = config_from_flags()
        # Logical CPU devices must exist before anything initializes TensorFlow's devices.
        if config.strategy == 'cpu':
            strategy.use_logical_cpus(config.num_cpu_devices)
        if config.seed is not None:
            keras.utils.set_random_seed(config.seed)
        if _DETERMINISTIC.value:
            tf.config.experimental.enable_op_determinism()
        # Flushed lines: progress reaches a log file or pipe as it happens, and survives a kill.
        train.train_and_evaluate(config, synthetic=_SYNTHETIC_DATA.value,
                                 print_fn=functools.partial(print, flush=True))
    except (ConfigError, train.TrainingDiverged, train.InputEnded) as error:
        fail(str(error))
    except train.Preempted as error:
        print(str(error), file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_STATUS)
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
        # Raised inside the input pipeline with --bad_records=fatal: a corrupt JPEG, a label outside the
        # range (tfrecord.to_model_label), a missing feature, a TFRecord file cut mid-record.
        fail(f'bad input record: {input_pipeline.summarize_graph_error(error.message)}')


def run():
    app.run(main)


if __name__ == '__main__':
    run()
