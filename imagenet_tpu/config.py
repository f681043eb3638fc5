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
DECAYS = ('step', 'polynomial', 'cosine')


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
    random_flip: bool = True
    shuffle_buffer: int = 10000             # in records, per input pipeline

    # Model.
    depth: int = 50                         # ResNet depth: 18, 34, 50, 101, 152 or 200
    norm: str = 'batch_norm'                # 'batch_norm' or 'none' (no normalization layers)
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5

    # Optimization.
    global_batch_size: int = 1024           # images per step summed over all replicas
    eval_batch_size: int = 1024             # images per evaluation step summed over all replicas
    train_epochs: float = 90.0
    base_learning_rate: float = 0.1         # per 256 images: lr = base_learning_rate * global_batch_size / 256
    momentum: float = 0.9
    weight_decay: float = 1e-4              # L2 on conv and dense kernels; never on BN parameters or biases
    label_smoothing: float = 0.0
    warmup_epochs: float = 5.0
    lr_decay: str = 'step'                  # 'step' (x0.1 at lr_decay_epochs), 'polynomial' or 'cosine'
    lr_decay_epochs: Tuple[float, ...] = (30.0, 60.0, 80.0)
    end_learning_rate: float = 1e-4         # for 'polynomial'
    polynomial_power: float = 2.0

    # Distribution.
    strategy: str = 'cpu'                   # 'cpu', 'mirrored' (GPUs), 'multi_worker', 'tpu' or 'default'
    num_cpu_devices: int = 8                # logical CPU devices for strategy='cpu'
    tpu: str = ''                           # TPU name or 'local', for strategy='tpu'

    # Run.
    model_dir: Optional[str] = None         # checkpoints and TensorBoard logs; None = neither
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
        if not 0 < self.random_crop_min_area <= 1:
            raise ConfigError(f'random_crop_min_area must be in (0, 1], got {self.random_crop_min_area}')
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f'label_smoothing must be in [0, 1), got {self.label_smoothing}')

    @property
    def steps_per_epoch(self) -> int:
        """Training steps in one epoch; the last partial batch of an epoch is carried into the next."""
        return max(1, self.num_train_images // self.global_batch_size)

    @property
    def train_steps(self) -> int:
        return max(1, int(round(self.train_epochs * self.steps_per_epoch)))

    @property
    def eval_steps(self) -> int:
        """Evaluation steps that cover every validation image once (the last batch is partial)."""
        return -(-self.num_eval_images // self.eval_batch_size)

    @property
    def peak_learning_rate(self) -> float:
        return self.base_learning_rate * self.global_batch_size / 256
