"""Every recipe in flags/ parses, builds its optimizer and schedule, and sets what its source ran: the tables
below are written from the sources (papers, MLPerf submissions, tensorflow/tpu), not from this package's code."""

import os
import glob

from absl import flags
from absl.testing import flagsaver, parameterized
import tensorflow as tf

import helpers
from imagenet_tpu import builders
from imagenet_tpu.commands import common
from imagenet_tpu.commands import train as command  # noqa: F401  (defines the flags)

REPO = helpers.REPO
RECIPES = sorted(glob.glob(os.path.join(REPO, 'flags', '*.cfg')))

# Each recipe's global batch and the highest learning rate its schedule reaches, as its source gives them (not
# computed by this package). Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
# (arXiv:1706.02677): lr = 0.1 x batch / 256 (linear scaling rule), reached after a 5-epoch warm-up.
PUBLISHED = {
    # Not a published run: our demo, on Goyal et al.'s rule at batch 256.
    'demo.cfg': (256, 0.1),
    # Akiba, Suzuki, Fukuda 2017, arXiv:1711.04325, batch 32,768: eta = 0.1 x 32768 / 256 = 12.8, and the
    # slow-start schedule holds 0.5 eta until epoch 40, so the highest rate is 6.4 (the values the recipe's
    # header gives from the paper; it notes they are not yet checked line by line against it).
    'gpu_1024_bs32k_akiba.cfg': (32768, 6.4),
    # Goyal et al. 2017's run: 256 GPUs, batch 8,192, lr 0.1 x 8192 / 256 = 3.2.
    'gpu_256_bs8k_goyal.cfg': (8192, 3.2),
    # Goyal et al.'s rule at batch 1,024: 0.4.
    'gpu_8.cfg': (1024, 0.4),
    # MLPerf Training v0.6, Google, ResNet-50 on TPU v3-1024: mlcommons/training_results_v0.6,
    # Google/benchmarks/resnet/tpu-v3-1024/run_and_time.sh: --train_batch_size=32768
    # --lars_base_learning_rate=31.2, the rate its polynomial schedule warms up to (lars_util.poly_rate_schedule).
    'tpu_v3_1024_bs32k.cfg': (32768, 31.2),
    # MLPerf Training v0.7, Google, ResNet-50 on TPU v3-8192 cores: mlcommons/training_results_v0.7,
    # Google/benchmarks/resnet/tpu-v3-8192-TF/run_and_time.sh: --train_batch_size=65536
    # --lars_base_learning_rate=24.699.
    'tpu_v3_4096_bs64k.cfg': (65536, 24.699),
    # tensorflow/tpu models/official/resnet/configs/resnet_config.py: train_batch_size 1024 (line 20),
    # base_learning_rate 0.1 per 256 images (line 25), so 0.4.
    'tpu_v3_8.cfg': (1024, 0.4),
}


MLPERF_COMMON = dict(optimizer='lars', lr_decay='polynomial', polynomial_power=2.0, end_learning_rate=1e-4,
                     weight_decay=1e-4, label_smoothing=0.1, lars_eeta=0.001, nesterov=False,
                     resize_method='bicubic', crop_boxes=False)
PUBLISHED_SETTINGS = {
    # mlcommons/training_results_v0.6, Google/benchmarks/resnet/tpu-v3-1024/run_and_time.sh (lars_epsilon 1e-5,
    # lars_warmup_epochs 25, train_steps 2983, distributed_group_size 1, label_smoothing 0.1, weight_decay 1e-4);
    # implementations/tpu-v3-1024-resnet/resnet/: lars_util.py 92-96 (power 2, tf.train.polynomial_decay's
    # default end rate 1e-4), 109-114 (TF 1.14 contrib LARS, eeta default 0.001, no Nesterov), resnet_main.py
    # 221 (momentum 0.9), 391-393 (weight decay in the loss), resnet_preprocessing.py 107, 126 (bicubic).
    'tpu_v3_1024_bs32k.cfg': dict(MLPERF_COMMON, warmup_epochs=25.0, train_steps=2983, momentum=0.9,
                                  lars_epsilon=1e-5, lars_variant='mlperf_v0.6', bn_group_size=1,
                                  space_to_depth=False),
    # mlcommons/training_results_v0.7, Google/benchmarks/resnet/tpu-v3-8192-TF/run_and_time.sh (lars_warmup_epochs
    # 31, momentum 0.951807, lars_epsilon 0, train_steps 1738, distributed_group_size 8, use_space_to_depth);
    # implementations/resnet-research-TF-tpu-v3-8192/: lars_util.py 81-95 (end rate 1e-4, power 2), 107-112
    # (TF 1.15 contrib LARS), imagenet_input.py 78-80, 117 (bicubic).
    'tpu_v3_4096_bs64k.cfg': dict(MLPERF_COMMON, warmup_epochs=31.0, train_steps=1738, momentum=0.951807,
                                  lars_epsilon=0.0, lars_variant='mlperf', bn_group_size=8, space_to_depth=True),
    # tensorflow/tpu models/official/resnet: configs/resnet_config.py 24 (112,590 steps), 36-38 (momentum 0.9,
    # weight decay 1e-4, label smoothing 0), resnet_main.py 243-248, 275-276 (5-epoch warm-up, x0.1 at 30/60/80),
    # 500-503 (Nesterov), resnet_preprocessing.py 102-106, 129 (bicubic).
    'tpu_v3_8.cfg': dict(optimizer='sgd', warmup_epochs=5.0, lr_decay='step', lr_decay_epochs=(30.0, 60.0, 80.0),
                         train_steps=112590, momentum=0.9, nesterov=True, weight_decay=1e-4, label_smoothing=0.0,
                         resize_method='bicubic', crop_boxes=False, bn_group_size=1, space_to_depth=False),
    # Goyal et al. 2017 (arXiv:1706.02677) section 5.1: 90 epochs, 5-epoch warm-up, x0.1 at 30/60/80, Nesterov
    # momentum 0.9, weight decay 1e-4, batch norm per worker; no label smoothing is described.
    'gpu_8.cfg': dict(optimizer='sgd', warmup_epochs=5.0, lr_decay='step', lr_decay_epochs=(30.0, 60.0, 80.0),
                      train_epochs=90.0, momentum=0.9, nesterov=True, weight_decay=1e-4, label_smoothing=0.0,
                      bn_group_size=1),
    'gpu_256_bs8k_goyal.cfg': dict(optimizer='sgd', warmup_epochs=5.0, lr_decay='step',
                                   lr_decay_epochs=(30.0, 60.0, 80.0), train_epochs=90.0, momentum=0.9,
                                   nesterov=True, weight_decay=1e-4, label_smoothing=0.0, bn_group_size=1),
    # Akiba et al. 2017 (arXiv:1711.04325), as the recipe's header summarizes it (not yet checked line by line):
    # RMSprop warm-up (centre 10 epochs, period 5, eta_rms 3e-4), slow start, 90 epochs, batch norm without
    # moving averages.
    'gpu_1024_bs32k_akiba.cfg': dict(optimizer='rmsprop_warmup', lr_decay='slow_start', train_epochs=90.0,
                                     alpha_sgd_center_epochs=10.0, alpha_sgd_period_epochs=5.0,
                                     rms_learning_rate=3e-4, bn_inference_statistics='last_batch'),
    'demo.cfg': {},
}


class RecipesTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(*RECIPES)
    def test_every_recipe_parses_and_builds_its_optimizer_and_schedule(self, path):
        name = os.path.basename(path)
        self.assertIn(name, PUBLISHED, f'flags/{name} has no entry in PUBLISHED: add its source\'s global batch and '
                                       'peak learning rate, with a comment citing the source')
        batch, published_peak = PUBLISHED[name]
        with flagsaver.flagsaver():
            flags.FLAGS(['imagenet-tpu-train', f'--flagfile={path}'])
            config = common.config_from_flags()
        self.assertEqual(config.global_batch_size, batch)
        with open(path) as f:     # set in the file, not left to the default
            self.assertEqual([line.strip() for line in f if line.startswith('--global_batch_size=')],
                             [f'--global_batch_size={batch}'])
        optimizer = builders.build_optimizer(config)
        self.assertEqual(type(optimizer).__name__, {'sgd': 'SGD', 'lars': 'LARS',
                                                    'rmsprop_warmup': 'RMSpropWarmup'}[config.optimizer])
        rate = builders.build_learning_rate(config)
        # The schedule sampled at ~200 steps: at most 1/200 of the run away from the warm-up's end (the peak).
        peak = max(float(rate(step)) for step in range(0, config.train_steps + 1, max(1, config.train_steps // 200)))
        self.assertAllClose(peak, published_peak, rtol=0.02)

    def test_the_published_table_has_only_existing_recipes(self):
        self.assertCountEqual(PUBLISHED, [os.path.basename(path) for path in RECIPES])
        self.assertCountEqual(PUBLISHED_SETTINGS, [os.path.basename(path) for path in RECIPES])

    @parameterized.parameters(*RECIPES)
    def test_every_recipe_sets_what_its_source_ran(self, path):
        name = os.path.basename(path)
        with flagsaver.flagsaver():
            flags.FLAGS(['imagenet-tpu-train', f'--flagfile={path}'])
            config = common.config_from_flags()
        with open(path) as f:
            written = {line.split('=')[0].strip().lstrip('-').removeprefix('no') for line in f
                       if line.startswith('--')}
        for setting, published in PUBLISHED_SETTINGS[name].items():
            value = config.train_steps if setting == 'train_steps' else getattr(config, setting)
            self.assertEqual(value, published, f'{name}: {setting}')
            if setting not in ('train_steps', 'train_epochs'):   # stated in the file, not left to a default
                self.assertIn(setting, written, f'{name} leaves {setting} to the default')


if __name__ == '__main__':
    tf.test.main()
