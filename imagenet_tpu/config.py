"""Config: every setting of a training run, as one frozen dataclass, and the one place each setting is written.

Each field carries its default, help text, choices and unit (``setting``'s metadata). commands/common.py turns every
field into a command-line flag of the same name; __post_init__ checks choices and bounds from the same metadata. A
Python user builds a Config directly (``Config(data_dir=..., ...)``) or with ``dataclasses.replace``; the library
reads settings only from here, never from flags. Adding a setting is one line below.
"""

import dataclasses
import json
import math
import typing
from typing import Optional, Tuple

from imagenet_tpu.errors import ConfigError
from imagenet_tpu.hardware import fewest_hosts, parse_topology
from imagenet_tpu.parsing import (SERVICE_PROTOCOL, parse_floats, parse_mesh_shape, parse_service_address,
                                  parse_step_range)

__all__ = ['Config', 'ConfigError', 'SECTIONS', 'settings', 'RESNET_DEPTHS', 'RESIZE_METHODS',
           'BN_INFERENCE_STATISTICS', 'SERVICE_MODES', 'SERVICE_PROTOCOL', 'parse_floats', 'parse_mesh_shape',
           'parse_service_address', 'parse_step_range']

SECTIONS = ('data', 'model', 'optimization', 'distribution', 'run')

# Value lists the lower layers check against (each written here once).
RESNET_DEPTHS = (10, 18, 34, 50, 101, 152, 200)        # model/resnet.py's DEPTHS has one entry for each
RESIZE_METHODS = ('bilinear', 'bicubic')                # data/preprocessing.py
BN_INFERENCE_STATISTICS = ('moving_average', 'last_batch', 'reestimate')   # model/batch_norm.py


def _section(name: str):
    def setting(default, help: str, *, choices=None, unit: str = '', minimum=None, parse=None):   # noqa: A002
        """A Config field: ``default``, one-sentence ``help``, optional ``choices``, ``unit`` and inclusive
        ``minimum`` (checked when the value is not None), and for a flag whose text is not the value itself,
        ``parse`` (text -> value)."""
        return dataclasses.field(default=default, metadata={
            'section': name, 'help': help, 'choices': tuple(choices) if choices else None, 'unit': unit,
            'minimum': minimum, 'parse': parse})
    return setting


data, model, optimization, distribution, run = (_section(name) for name in SECTIONS)


SERVICE_MODES = ('distributed_epoch', 'parallel_epochs')    # how a tf.data service shares work (data_service.py)


@dataclasses.dataclass(frozen=True)
class Config:
    # Data.
    data_dir: Optional[str] = data(None, 'Directory of train-*-of-* and validation-*-of-* TFRecord shards, or a '
                                         "tensorflow_datasets folder (its dataset_info.json and tfrecord shards, "
                                         'such as imagenet2012/5.1.0).')
    synthetic_data: bool = data(False, 'Train on one fixed random batch (no input cost, no evaluation): measures '
                                       'the model alone.')
    num_classes: int = data(1000, 'Classes the model predicts.', minimum=1)
    label_offset: int = data(1, 'On-disk label of model class 0. ImageNet shards store 1..1000 (and '
                                "tensorflow_datasets' 0..999 are read as 1..1000): 1 with --num_classes=1000, or 0 "
                                'with --num_classes=1001 (unused background class 0).')
    num_train_images: int = data(1281167, 'Images in one training epoch (ImageNet: 1,281,167).', unit='images',
                                 minimum=1)
    num_eval_images: int = data(50000, 'Validation images (ImageNet: 50,000); every one is evaluated.',
                                unit='images', minimum=1)
    image_size: int = data(224, 'Side of the square network input.', unit='pixels', minimum=1)
    random_crop_min_area: float = data(0.08, 'Smallest random crop as a fraction of the image area (Inception: '
                                             '0.08).')
    crop_boxes: bool = data(False, "Sample training crops to cover at least 10% of one of the record's ILSVRC "
                                   'boxes. Off: against the whole image, as tensorflow/tpu, the MLPerf submissions '
                                   'and tf-models-official do.')
    eval_crop_fraction: float = data(0.875, 'Evaluation keeps this share of the shorter side, centred (224 of '
                                            '256).')
    eval_crop_padding: Optional[int] = data(None, "Instead of --eval_crop_fraction, tensorflow/tpu's convention: "
                                                  'keep image_size / (image_size + padding) of the shorter side '
                                                  '(its CROP_PADDING is 32: 0.875 at 224, 0.8 at 128).',
                                            unit='pixels', minimum=0)
    resize_method: str = data('bilinear', 'Filter that resizes crops to image_size, in training and evaluation.',
                              choices=RESIZE_METHODS)
    random_flip: bool = data(True, 'Random left-right flips in training.')
    shuffle_buffer: int = data(10000, 'Records shuffled together: each input pipeline reads its files one after '
                               'another and shuffles each window of this many records in full, at most an eighth '
                               'of its epoch (num_train_images / hosts), so that a resume reads little (the '
                               'cached sets: a shuffle buffer of this size). Memory: about 3 windows of records.',
                               unit='records', minimum=1)
    interleave_cycle_length: int = data(16, 'Training files read at once (in parallel, ahead of the one in use) by '
                                        'each input pipeline.', minimum=1)
    read_buffer_mb: float = data(8.0, 'Read buffer of each open TFRecord file.', unit='MiB', minimum=0)
    input_threads: int = data(0, "Threads of each input pipeline's private pool (0: TensorFlow's shared pool).",
                              minimum=0)
    input_cache: str = data('none', 'Keep the training set in memory: encoded records, or decoded images (small '
                                    'sets only: about 500 KB per ImageNet image).',
                            choices=('none', 'records', 'images'))
    data_service: str = data('', 'tf.data service dispatcher (grpc://HOST:PORT) whose workers read, decode and batch '
                                 'the training images (tools/launch/run_data_service.py); empty: this process does. '
                                 'Evaluation stays local.')
    data_service_mode: str = data('distributed_epoch', 'How the service shares the work: distributed_epoch (files '
                                  'handed out to workers: every image once per epoch, no exact resume) or '
                                  'parallel_epochs (every worker runs the whole stream: exact with one worker).',
                                  choices=SERVICE_MODES)
    bad_records: str = data('skip', 'A record whose JPEG does not decode, that lacks a feature or has a label '
                                    'out of range, or a TFRecord file cut mid-record: skip and count it, or stop.',
                            choices=('skip', 'fatal'))
    prefetch_to_device: int = data(2, "Batches buffered on each replica's device.", unit='batches', minimum=0)

    # Model.
    depth: int = model(50, 'ResNet depth.', choices=RESNET_DEPTHS)
    norm: str = model('batch_norm', 'Normalization layers.', choices=('batch_norm', 'none'))
    space_to_depth: bool = model(False, "MLPerf v0.7's TPU stem: 2x2 space-to-depth images and a masked 8x8 kernel "
                                        'folded to a 4x4 stride-1 convolution: the 7x7 stride-2 one, also after '
                                        'training.')
    precision: str = model('float32', 'Compute precision: mixed_bfloat16 on TPU (and CPUs with bfloat16), '
                                      'mixed_float16 with loss scaling on GPU. Variables, BN statistics and the loss '
                                      'stay float32.', choices=('float32', 'mixed_bfloat16', 'mixed_float16'))
    jit_compile: Optional[bool] = model(None, 'XLA-compile the train step (default: on with GPUs, off on CPUs; '
                                              'TPUs always compile).')
    steps_per_execution: Optional[int] = model(None, 'Training steps per host call (default: 100 on TPU, capped '
                                                     'by an epoch; 1 elsewhere).', unit='steps', minimum=1)
    bn_momentum: float = model(0.9, 'Batch-norm moving-average momentum (0.9 as the recipes; 0.99 lags on short '
                                    'runs).')
    bn_epsilon: float = model(1e-5, 'Batch-norm epsilon.')
    bn_group_size: int = model(1, 'Replicas per batch-norm group (1: per replica). Must divide the replica count.',
                               unit='replicas', minimum=1)
    bn_span: Optional[int] = model(None, 'Images per batch norm (Ying et al.: ~32-64); sets the group size to '
                                         'span / per-replica batch. Overrides --bn_group_size.',
                                   unit='images', minimum=1)
    bn_inference_statistics: str = model(
        'moving_average', "Statistics used for evaluation and export: moving averages; 'last_batch' (Akiba et "
                          "al.: the last training batch's, over all replicas); 'reestimate' "
                          '(--bn_reestimate_batches training batches before each evaluation).',
        choices=BN_INFERENCE_STATISTICS)
    bn_reestimate_batches: int = model(10, "Training batches pooled by --bn_inference_statistics=reestimate.",
                                       unit='batches', minimum=1)
    mesh_shape: Optional[Tuple[int, int]] = model(
        None, 'Torus as XxY chips (e.g. 16x32): batch-norm groups become 2-D tiles of neighbouring chips, and '
              '--allreduce=2d uses rows of X chips. Default: contiguous BN groups; for 2d, the TPU topology or a '
              'square mesh.', parse=parse_mesh_shape)
    cores_per_chip: int = model(2, 'Replicas per chip on --mesh_shape (TPU v3: 2).', minimum=1)

    # Optimization.
    global_batch_size: int = optimization(1024, 'Images per training step, summed over all replicas.',
                                          unit='images', minimum=1)
    eval_batch_size: int = optimization(1024, 'Images per evaluation step, summed over all replicas.',
                                        unit='images', minimum=1)
    train_epochs: float = optimization(90.0, 'Length of training.', unit='epochs')
    total_steps: Optional[int] = optimization(None, 'Length of training in steps; overrides --train_epochs (MLPerf '
                                                    'recipes state steps).', unit='steps', minimum=1)
    optimizer: str = optimization('sgd', "'sgd' (momentum), 'lars' (large batch), 'rmsprop_warmup' (Akiba et "
                                         'al.).', choices=('sgd', 'lars', 'rmsprop_warmup'))
    base_learning_rate: float = optimization(0.1, 'Learning rate per 256 images; the peak is base_learning_rate * '
                                                  'global_batch_size / 256 (Goyal et al.).')
    learning_rate: Optional[float] = optimization(None, 'Peak learning rate itself; overrides --base_learning_rate '
                                                        '(the LARS recipes state it: 31.2 at batch 32k).')
    momentum: float = optimization(0.9, 'Momentum of SGD, LARS and RMSprop warm-up (mu1).')
    nesterov: bool = optimization(False, 'Nesterov momentum (sgd, lars).')
    weight_decay: float = optimization(1e-4, 'L2 weight decay on kernels (never on batch-norm parameters or '
                                             'biases).')
    label_smoothing: float = optimization(0.0, 'Label smoothing (0.1 in the large-batch recipes).')
    gradient_noise_scale: bool = optimization(False, "Estimate McCandlish et al.'s gradient noise scale B_simple at "
                                                     "every step from the replicas' gradients and their sum "
                                                     '(needs 2 or more replicas); shown in progress lines, '
                                                     'TensorBoard and results.json.')
    lars_eeta: float = optimization(0.001, 'LARS trust coefficient (MLPerf: 0.001).')
    lars_epsilon: float = optimization(0.0, 'Added to the LARS trust-ratio denominator (MLPerf v0.6: 1e-5, v0.7: '
                                            '0).')
    lars_variant: str = optimization('mlperf', "LARS update rule: 'mlperf' (MLPerf v0.7, TF 1.15 contrib), "
                                               "'mlperf_v0.6' (TF 1.14 contrib, weight decay in the loss) or 'tfm' "
                                               '(tf-models-official, to reuse its hyperparameters); lars.py.',
                                     choices=('mlperf', 'mlperf_v0.6', 'tfm'))
    rms_learning_rate: float = optimization(3e-4, 'RMSprop warm-up: rate of the RMSprop part (Akiba et al.: '
                                                  '3e-4).')
    alpha_sgd_center_epochs: float = optimization(10.0, 'RMSprop warm-up: epoch where the blend is half SGD '
                                                        '(Akiba: 10).', unit='epochs')
    alpha_sgd_period_epochs: float = optimization(5.0, 'RMSprop warm-up: pure SGD from center + period/2 '
                                                       '(Akiba: 5).', unit='epochs')
    warmup_epochs: float = optimization(5.0, 'Linear warm-up from 0.', unit='epochs')
    lr_decay: str = optimization('step', "Decay after warm-up; 'slow_start' is Akiba et al.'s "
                                         'x0.5/0.075/0.01/0.001 at epochs 0/40/70/85.',
                                 choices=('step', 'polynomial', 'cosine', 'slow_start'))
    lr_decay_epochs: Tuple[float, ...] = optimization((30.0, 60.0, 80.0), "Epochs at which 'step' decay "
                                                                          'multiplies the rate by 0.1.',
                                                      unit='epochs', parse=parse_floats)
    end_learning_rate: float = optimization(1e-4, "Final rate of 'polynomial' decay.")
    polynomial_power: float = optimization(2.0, "Power of 'polynomial' decay (MLPerf: 2).")

    # Distribution.
    allreduce: str = distribution('default', "Gradient summation: the strategy's own all-reduce, or '2d' (Ying et "
                                             "al.'s 2-D torus all-reduce: reduce-scatter in rows, all-reduce in "
                                             'columns, all-gather in rows).', choices=('default', '2d'))
    allreduce_dtype: str = distribution('float32', 'Type gradients are summed in with --allreduce=2d (bfloat16: '
                                                   'half the bytes).', choices=('float32', 'bfloat16'))
    allreduce_bucket_mb: float = distribution(32.0, 'With --allreduce=2d, gradients are packed into buckets of '
                                                    'about this size (a ResNet-50 has ~160 gradient tensors).',
                                              unit='MiB')
    strategy: str = distribution('cpu', "'cpu' (N logical CPU devices), 'mirrored' (local GPUs), 'multi_worker' "
                                        "(TF_CONFIG, or Slurm's tasks: --cluster), 'tpu' or 'default' (no "
                                        'distribution).', choices=('cpu', 'mirrored', 'multi_worker', 'tpu', 'default'))
    cluster: str = distribution('auto', "Where --strategy=multi_worker finds its workers: 'tf_config' (the TF_CONFIG "
                                        "variable), 'slurm' (every task of the srun job step, from Slurm's variables) "
                                        "or 'auto' (TF_CONFIG when set, else Slurm's under srun).",
                                choices=('auto', 'tf_config', 'slurm'))
    cluster_port: int = distribution(8888, 'With a Slurm cluster, the port of the first task on each node (the '
                                           'next tasks there take the ports after it).', minimum=1)
    num_cpu_devices: int = distribution(8, 'Logical CPU devices (replicas) for --strategy=cpu.', minimum=1)
    cpu_devices_per_worker: int = distribution(
        1, "Logical CPU devices (replicas) of each worker of --strategy=multi_worker on machines without GPUs: "
        "several workers on one machine then stand for a pod of several accelerators per host.", minimum=1)
    tpu: str = distribution('', "TPU name, or 'local' on a TPU VM (one host: a pod slice must be named).")
    topology: str = distribution('', 'Hardware the run is written for: a TPU slice (v3-1024, v4-128, v5litepod-256), '
                                     'GPUs (8xH100, 32x8xA100) or cpu. On TPU, a slice that shows fewer hosts stops '
                                     'the run at start, and --tpu=local is refused for a slice of several hosts; '
                                     'imagenet-tpu-plan plans for it.')

    # Run.
    model_dir: Optional[str] = run(None, 'Checkpoints, TensorBoard logs and results.json; a run restarted with the '
                                         'same model_dir resumes from its latest checkpoint.')
    export_saved_model: bool = run(False, 'Write MODEL_DIR/saved_model (images -> logits, inference mode) at the '
                                          'end of training.')
    checkpoint_every_steps: int = run(1000, 'Steps between checkpoints (one more is written at the end).',
                                      unit='steps', minimum=1)
    eval_every_epochs: int = run(1, 'Epochs between evaluations on the validation set.', unit='epochs', minimum=1)
    log_every_steps: int = run(100, 'Steps between progress lines inside an epoch (0: once per epoch).',
                               unit='steps', minimum=0)
    profile_steps: Optional[Tuple[int, int]] = run(
        None, "TensorBoard's profile of training steps START,END (e.g. 100,110; the run's steps, counted from 1, "
              'also after a resume) in MODEL_DIR/logs, by the chief: `tensorboard --logdir MODEL_DIR/logs`, Profile '
              'tab (pip install tensorboard-plugin-profile).', parse=parse_step_range)
    seed: Optional[int] = run(None, 'Seed of initialization and of the data order (None: random initialization; '
                                    'the data order then uses seed 0, so a resumed run continues it).')
    termination_grace_seconds: float = run(25.0, 'After SIGTERM, training saves at the end of the current step and '
                                           'exits with status 143; if no step ends within this time (a stalled '
                                           'input, a peer that does not answer), the process exits without saving '
                                           '(the checkpoints written are intact). Below the 30 s notice of cloud '
                                           'VMs and Kubernetes.', unit='seconds', minimum=0)
    input_timeout_minutes: float = run(30.0, 'A run in which no training or evaluation step ends for this long '
                                             '(the input yields nothing: a stalled file system or tf.data service) '
                                             'stops with an error naming its input (0: waits forever).',
                                       unit='minutes', minimum=0)
    deterministic: bool = run(False, 'Reproducible runs: deterministic TensorFlow ops and record order, so a run '
                                     'resumed after a crash ends with the same weights as an uninterrupted one '
                                     '(slower input on slow file systems).')

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, choices, minimum = getattr(self, field.name), field.metadata['choices'], field.metadata['minimum']
            if any(isinstance(item, float) and not math.isfinite(item)
                   for item in (value if isinstance(value, tuple) else (value,))):
                raise ConfigError(f'--{field.name} must be a finite number, got {value}')
            if choices and value not in choices:
                raise ConfigError(f'unknown {field.name} {value!r}; choose one of '
                                  f'{", ".join(str(choice) for choice in choices)}')
            if minimum is not None and value is not None and value < minimum:
                raise ConfigError(f'{field.name} must be at least {minimum}, got {value}')
        if self.total_steps is None and not self.train_epochs > 0:
            raise ConfigError(f'--train_epochs must be above 0, got {self.train_epochs} (or set --total_steps)')
        if not 0 < self.eval_crop_fraction <= 1:
            raise ConfigError(f'eval_crop_fraction must be in (0, 1], got {self.eval_crop_fraction}')
        if self.data_service:
            parse_service_address(self.data_service)
            if self.input_cache != 'none':
                raise ConfigError('--input_cache keeps the set in this process; with --data_service the workers '
                                  'read it (use --input_cache=none)')
        if self.crop_boxes and self.input_cache == 'images':
            raise ConfigError("crop_boxes needs the records' boxes, which input_cache='images' does not keep")
        if not 0 < self.random_crop_min_area <= 1:
            raise ConfigError(f'random_crop_min_area must be in (0, 1], got {self.random_crop_min_area}')
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f'label_smoothing must be in [0, 1), got {self.label_smoothing}')
        if self.strategy == 'tpu' and self.precision == 'mixed_float16':
            raise ConfigError('--precision=mixed_float16 needs loss scaling, which TPUStrategy does not support '
                              '(tf_keras refuses it at the first step): use --precision=mixed_bfloat16 on TPU')
        if self.topology:
            parse_topology(self.topology)
        if self.topology and self.strategy == 'tpu' and self.tpu == 'local' and self.topology_hosts > 1:
            raise ConfigError(f'--topology={self.topology} spans {self.topology_hosts} hosts but --tpu=local sees '
                              'only this host: name the pod slice with --tpu=NAME')

    @property
    def topology_hosts(self) -> int:
        """The fewest hosts the --topology hardware can have (hardware.fewest_hosts; 0 when none is set)."""
        return fewest_hosts(self.topology) if self.topology else 0

    def to_json(self) -> str:
        """Every setting as a JSON object (model_dir/config.json: what the evaluation command starts from)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, overrides: Optional[dict] = None) -> 'Config':
        """The Config of ``to_json``'s text, with ``overrides`` applied; settings this version does not know are
        left out (a run written by an older or newer version still loads), lists become tuples again."""
        values = json.loads(text)
        kinds = {field.name: kind for field, kind in settings()}
        values = {name: tuple(value) if isinstance(value, list) else value
                  for name, value in values.items() if name in kinds}
        return cls(**{**values, **(overrides or {})})

    @property
    def eval_crop(self) -> float:
        """Share of the shorter side the evaluation crop keeps: eval_crop_fraction, or with eval_crop_padding the
        convention of tensorflow/tpu's resnet_preprocessing.py, image_size / (image_size + CROP_PADDING), whose
        CROP_PADDING is 32 (0.875 at 224, 0.8 at 128)."""
        if self.eval_crop_padding is None:
            return self.eval_crop_fraction
        return self.image_size / (self.image_size + self.eval_crop_padding)

    @property
    def steps_per_epoch(self) -> int:
        """Steps in one Keras epoch (the unit of progress lines and evaluation): images / batch, rounded.

        The data itself is an endless shuffled stream, so no image is dropped at epoch ends; schedules convert
        epochs to steps at the exact ratio (epochs_to_steps).
        """
        return max(1, int(round(self.num_train_images / self.global_batch_size)))

    def epochs_to_steps(self, epochs: float) -> int:
        """Steps in ``epochs`` epochs at the exact (fractional) images/batch ratio, as the MLPerf schedules count."""
        return int(round(epochs * self.num_train_images / self.global_batch_size))

    @property
    def train_steps(self) -> int:
        return self.total_steps or max(1, self.epochs_to_steps(self.train_epochs))

    @property
    def eval_steps(self) -> int:
        """Evaluation steps that cover every validation image once with one input pipeline."""
        return self.eval_steps_for(1)

    def eval_steps_for(self, num_input_pipelines: int) -> int:
        """Evaluation steps that cover every validation image once when ``num_input_pipelines`` hosts each read
        every num_input_pipelines-th image (eval_input.eval_dataset): enough for the largest share."""
        largest_share = -(-self.num_eval_images // num_input_pipelines)
        per_pipeline_step = self.eval_batch_size // num_input_pipelines
        return -(-largest_share // max(1, per_pipeline_step))

    def bn_group_size_for(self, num_replicas: int) -> int:
        """Replicas per batch-norm group, from bn_span (images per batch norm) when set, else bn_group_size."""
        if num_replicas < 1 or self.global_batch_size % num_replicas:
            raise ConfigError(f'--global_batch_size={self.global_batch_size} is not divisible by the '
                              f'{num_replicas} replicas')
        per_replica = self.global_batch_size // num_replicas
        if self.bn_span is not None:
            if self.bn_span % per_replica:
                raise ConfigError(f'--bn_span={self.bn_span} is not a multiple of the per-replica batch '
                                  f'{per_replica} ({self.global_batch_size} images / {num_replicas} replicas)')
            group_size = self.bn_span // per_replica
        else:
            group_size = self.bn_group_size
        if num_replicas % group_size:
            raise ConfigError(f'batch-norm group of {group_size} replicas does not divide the {num_replicas} '
                              f'replicas (--bn_group_size={self.bn_group_size}, --bn_span={self.bn_span})')
        return group_size

    @property
    def peak_learning_rate(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return self.base_learning_rate * self.global_batch_size / 256


def settings():
    """(field, type without Optional) of every setting, in declaration order: what commands/common.py makes flags
    from."""
    hints = typing.get_type_hints(Config)
    result = []
    for field in dataclasses.fields(Config):
        kind = hints[field.name]
        arguments = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if typing.get_origin(kind) is typing.Union and len(arguments) == 1:
            kind = arguments[0]
        result.append((field, kind))
    return result
