"""Draws the learning rate of a recipe over its whole run to a PNG (and alpha_sgd, for RMSprop warm-up).

    python tools/plots/plot_schedule.py --flagfile=flags/tpu_v3_1024_bs32k.cfg --output=lr.png

Every training flag is accepted (commands.common defines them), so a recipe can be plotted with overrides.
"""

import os
import sys

from absl import app, flags
import numpy as np


from imagenet_tpu.commands import common
from imagenet_tpu import builders

common.define_flags()


def schedule_points(config, num_points: int = 500):
    """(steps, learning rates, alpha_sgd or None) sampled over the run."""
    steps = np.unique(np.linspace(0, config.train_steps, num_points).round().astype(np.int64))
    rate = builders.build_learning_rate(config)
    rates = np.array([float(rate(int(step))) for step in steps])
    alphas = None
    if config.optimizer == 'rmsprop_warmup':
        alpha = builders.build_alpha_sgd(config)
        alphas = np.array([float(alpha(int(step))) for step in steps])
    return steps, rates, alphas


def plot(config, output: str, title: str = '') -> str:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    steps, rates, alphas = schedule_points(config)
    epochs = steps * config.global_batch_size / config.num_train_images
    figure, axis = plt.subplots(figsize=(7, 3.6))
    axis.plot(epochs, rates, label='learning rate')
    axis.set_xlabel(f'epoch ({config.train_steps} steps of {config.global_batch_size} images)')
    axis.set_ylabel('learning rate')
    axis.grid(alpha=0.3)
    if alphas is not None:
        other = axis.twinx()
        other.plot(epochs, alphas, color='tab:orange', label='alpha_sgd')
        other.set_ylabel('alpha_sgd (0 = RMSprop, 1 = SGD)')
        other.set_ylim(0, 1.05)
        figure.legend(loc='center right', bbox_to_anchor=(0.85, 0.6))
    axis.set_title(title or f'{config.optimizer}, {config.lr_decay} decay, peak {config.peak_learning_rate:g}')
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    return output


def main(argv):
    del argv
    recipes = [os.path.basename(arg.split('=', 1)[1]) for arg in sys.argv if arg.startswith('--flagfile=')]
    try:
        config = common.config_from_flags()
    except ValueError as error:
        sys.exit(f'error: {error}')
    title = ', '.join(recipes)
    print(f'wrote {plot(config, flags.FLAGS.output, title)}')


if __name__ == '__main__':
    flags.DEFINE_string('output', 'learning_rate.png', 'PNG to write.')
    app.run(main)
