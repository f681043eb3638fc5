"""Config: every setting of a training run, as one frozen dataclass.

main.py builds it from absl flags; a Python user builds it directly (``Config(data_dir=..., ...)``) or with
``dataclasses.replace``. The library reads settings only from here, never from flags.
"""

import dataclasses
from typing import Optional, Tuple


class ConfigError(ValueError):
    """A setting or an input that cannot work; main.py prints its message as a one-line error."""


STRATEGIES = ('cpu', 'mirrored', 'multi_worker', 'tpu', 'default')
NORMS = ('batch_norm', 'none')
DECAYS = ('step', 'polynomial', 'cosine', 'slow_start')
OPTIMIZERS = ('sgd', 'lars', 'rmsprop_warmup')


@dataclasses.dataclass(frozen=True)
class Config:
    # Data.
    data_dir: Optional[str] = None          # holds train-*-of-* and validation-*-of-* shards; None = synthetic
    num_classes: int = 1000                 # classes the model predicts
    label_offset: int = 1                   # on-disk label of model class 0 (ImageNet shards store 1..1000)
    num_train_images: int = 1281167         # size of one training epoch, in images
    num_eval_images: int = 50000            # validation images; every one is evaluated
    image_size: int = 224                   # side of the square network input, in pixels
    random_crop_min_area: float = 0.08      # smallest crop, as a fraction of the image area
    crop_boxes: bool = False                # sample crops against the record's ILSVRC boxes; False: whole image
    eval_crop_fraction: float = 0.875       # evaluation keeps this share of the shorter side, centred
    eval_crop_padding: Optional[int] = None     # when set: image_size / (image_size + padding) instead (tpu: 32)
    random_flip: bool = True
    shuffle_buffer: int = 10000             # in records, per input pipeline
    interleave_cycle_length: int = 16       # training files read at once per input pipeline
    interleave_block_length: int = 1        # consecutive records taken from one file before moving on
    read_buffer_mb: float = 8.0             # read buffer of each open TFRecord file
    input_threads: int = 0                  # private tf.data thread pool size per pipeline; 0 = TensorFlow's pool
    deterministic_input: bool = False       # reproducible record order (exact resume); False lets tf.data reorder
    input_cache: str = 'none'               # 'none', 'records' (encoded, in memory) or 'images' (decoded; small sets)
    bad_records: str = 'skip'               # 'skip': skip and count undecodable records; 'fatal': stop the run
    prefetch_to_device: int = 2             # batches buffered on each replica's device

    # Model.
    depth: int = 50                         # ResNet depth: 10, 18, 34, 50, 101, 152 or 200
    norm: str = 'batch_norm'                # 'batch_norm' or 'none' (no normalization layers)
    space_to_depth: bool = False            # MLPerf v0.7 TPU stem: 2x2 space-to-depth input, 4x4 stride-1 conv
    precision: str = 'float32'              # 'float32', 'mixed_bfloat16' (TPU, recent CPUs) or 'mixed_float16' (GPU)
    jit_compile: Optional[bool] = None      # XLA-compile the train step; None: on with GPUs, else off (TPUs always)
    steps_per_execution: Optional[int] = None   # steps per host call; None: 100 (capped by an epoch) on TPU, else 1
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    bn_group_size: int = 1                  # replicas whose batches one batch norm normalizes over (1 = per replica)
    bn_span: Optional[int] = None           # images per batch norm; when set, bn_group_size = span / per-replica batch
    bn_inference_statistics: str = 'moving_average'   # 'moving_average', 'last_batch' (Akiba) or 'reestimate'
    bn_reestimate_batches: int = 10         # training batches that 'reestimate' pools before each evaluation
    mesh_shape: Optional[Tuple[int, int]] = None      # (X, Y) chips of the TPU torus: BN groups become 2-D tiles
    cores_per_chip: int = 2                 # replicas per chip on the mesh (TPU v3: 2)

    # Optimization.
    global_batch_size: int = 1024           # images per step summed over all replicas
    eval_batch_size: int = 1024             # images per evaluation step summed over all replicas
    train_epochs: float = 90.0
    total_steps: Optional[int] = None       # when set, the run's length in steps (overrides train_epochs)
    optimizer: str = 'sgd'                  # 'sgd' (momentum), 'lars' or 'rmsprop_warmup' (Akiba et al.)
    base_learning_rate: float = 0.1         # per 256 images: lr = base_learning_rate * global_batch_size / 256
    learning_rate: Optional[float] = None   # when set, the peak learning rate itself (overrides base_learning_rate)
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4              # L2 on conv and dense kernels; never on BN parameters or biases
    label_smoothing: float = 0.0
    lars_eeta: float = 0.001                # LARS trust coefficient
    lars_epsilon: float = 0.0               # added to the LARS trust ratio's denominator
    lars_trust_ratio: str = 'mlperf'        # 'mlperf' (MLPerf / TF contrib) or 'tfm' (tf-models-official)
    rms_learning_rate: float = 3e-4         # eta_rms of RMSprop warm-up
    alpha_sgd_center_epochs: float = 10.0   # RMSprop warm-up: alpha_sgd = 1/2 here
    alpha_sgd_period_epochs: float = 5.0    # RMSprop warm-up: alpha_sgd reaches 1 at center + period / 2
    warmup_epochs: float = 5.0
    lr_decay: str = 'step'                  # 'step' (x0.1 at lr_decay_epochs), 'polynomial', 'cosine', 'slow_start'
    lr_decay_epochs: Tuple[float, ...] = (30.0, 60.0, 80.0)
    end_learning_rate: float = 1e-4         # for 'polynomial'
    polynomial_power: float = 2.0

    # Distribution.
    allreduce: str = 'default'              # gradient summation: the strategy's own, or '2d' (collectives.all_reduce_2d)
    allreduce_dtype: str = 'float32'        # 'bfloat16' sums gradients in half the bytes ('2d' only)
    allreduce_bucket_mb: float = 32.0       # gradients are packed into buckets of about this size ('2d')
    strategy: str = 'cpu'                   # 'cpu', 'mirrored' (GPUs), 'multi_worker', 'tpu' or 'default'
    num_cpu_devices: int = 8                # logical CPU devices for strategy='cpu'
    tpu: str = ''                           # TPU name or 'local', for strategy='tpu'

    # Run.
    model_dir: Optional[str] = None         # checkpoints and TensorBoard logs; None = neither
    export_saved_model: bool = False        # write model_dir/saved_model (images -> logits) at the end
    checkpoint_every_steps: int = 1000
    eval_every_epochs: int = 1
    log_every_steps: int = 100              # progress lines inside an epoch
    seed: Optional[int] = None

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ConfigError(f'unknown strategy {self.strategy!r}; choose one of {", ".join(STRATEGIES)}')
        if self.norm not in NORMS:
            raise ConfigError(f'unknown norm {self.norm!r}; choose one of {", ".join(NORMS)}')
        if self.lr_decay not in DECAYS:
            raise ConfigError(f'unknown lr_decay {self.lr_decay!r}; choose one of {", ".join(DECAYS)}')
        for name in ('global_batch_size', 'eval_batch_size', 'num_classes', 'image_size', 'num_train_images',
                     'num_eval_images', 'checkpoint_every_steps', 'eval_every_epochs', 'num_cpu_devices'):
            if getattr(self, name) <= 0:
                raise ConfigError(f'{name} must be positive, got {getattr(self, name)}')
        if self.bn_inference_statistics not in ('moving_average', 'last_batch', 'reestimate'):
            raise ConfigError(f"bn_inference_statistics must be 'moving_average', 'last_batch' or 'reestimate', "
                              f'got {self.bn_inference_statistics!r}')
        if self.bn_group_size < 1 or (self.bn_span is not None and self.bn_span < 1):
            raise ConfigError('bn_group_size and bn_span must be positive')
        if self.allreduce not in ('default', '2d') or self.allreduce_dtype not in ('float32', 'bfloat16'):
            raise ConfigError(f"allreduce must be 'default' or '2d' and allreduce_dtype 'float32' or 'bfloat16', "
                              f'got {self.allreduce!r}, {self.allreduce_dtype!r}')
        if self.precision not in ('float32', 'mixed_bfloat16', 'mixed_float16'):
            raise ConfigError(f"precision must be 'float32', 'mixed_bfloat16' or 'mixed_float16', "
                              f'got {self.precision!r}')
        if self.steps_per_execution is not None and self.steps_per_execution < 1:
            raise ConfigError(f'steps_per_execution must be positive, got {self.steps_per_execution}')
        if self.bad_records not in ('skip', 'fatal'):
            raise ConfigError(f"bad_records must be 'skip' or 'fatal', got {self.bad_records!r}")
        if self.input_cache not in ('none', 'records', 'images'):
            raise ConfigError(f"input_cache must be 'none', 'records' or 'images', got {self.input_cache!r}")
        if not 0 < self.eval_crop_fraction <= 1 or (self.eval_crop_padding is not None and self.eval_crop_padding < 0):
            raise ConfigError(f'eval_crop_fraction must be in (0, 1] and eval_crop_padding non-negative, got '
                              f'{self.eval_crop_fraction}, {self.eval_crop_padding}')
        if self.crop_boxes and self.input_cache == 'images':
            raise ConfigError("crop_boxes needs the records' boxes, which input_cache='images' does not keep")
        if self.interleave_cycle_length < 1 or self.interleave_block_length < 1 or self.input_threads < 0:
            raise ConfigError('interleave_cycle_length and interleave_block_length must be positive and '
                              'input_threads non-negative')
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f'unknown optimizer {self.optimizer!r}; choose one of {", ".join(OPTIMIZERS)}')
        if self.lars_trust_ratio not in ('mlperf', 'tfm'):
            raise ConfigError(f"lars_trust_ratio must be 'mlperf' or 'tfm', got {self.lars_trust_ratio!r}")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ConfigError(f'total_steps must be positive, got {self.total_steps}')
        if not 0 < self.random_crop_min_area <= 1:
            raise ConfigError(f'random_crop_min_area must be in (0, 1], got {self.random_crop_min_area}')
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f'label_smoothing must be in [0, 1), got {self.label_smoothing}')

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
        every num_input_pipelines-th image (input_pipeline.eval_dataset): enough for the largest share."""
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
