"""Draws a run's curves from its TensorBoard logs to one PNG: loss, top-1, learning rate and images/s per epoch.

    python tools/plots/plot_metrics.py --model_dir runs/demo            # writes runs/demo/metrics.png
"""

import collections
import glob
import os
import sys

from absl import app, flags


def define_flags():
    """Called only when run as a program, so that importing plot() beside imagenet_tpu.commands.train defines no flags."""
    flags.DEFINE_string('model_dir', None, 'The run directory (holds logs/train and logs/validation).')
    flags.DEFINE_string('output', None, 'PNG path; default MODEL_DIR/metrics.png.')

PANELS = (('loss', 'loss'), ('top_1', 'top-1 accuracy'), ('learning_rate', 'learning rate'),
          ('images_per_second', 'training images/s'))


def read_scalars(log_dir: str) -> dict:
    """{tag: [(step, value), ...]} from every event file under ``log_dir``, sorted by step."""
    import tensorflow as tf
    scalars = collections.defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(log_dir, 'events.out.tfevents.*'))):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                number = (float(tf.make_ndarray(value.tensor)) if value.HasField('tensor')
                          else float(value.simple_value))
                scalars[value.tag][event.step] = number  # a resumed run rewrites the steps it repeats
    return {tag: sorted(points.items()) for tag, points in scalars.items()}


def plot(model_dir: str, output: str) -> str:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    runs = {split: read_scalars(os.path.join(model_dir, 'logs', split)) for split in ('train', 'validation')}
    if not runs['train']:
        raise FileNotFoundError(f'no TensorBoard scalars under {os.path.join(model_dir, "logs", "train")}')
    figure, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for axis, (name, title) in zip(axes, PANELS):
        for split, style in (('train', '-'), ('validation', 'o-')):
            points = runs[split].get(f'epoch_{name}')
            if points:
                epochs, values = zip(*points)
                axis.plot([e + 1 for e in epochs], values, style, label='held-out' if split == 'validation'
                          else 'training', markersize=4)
        axis.set_title(title)
        axis.set_xlabel('epoch')
        axis.grid(alpha=0.3)
        if name == 'top_1':
            axis.legend()
    figure.suptitle(os.path.basename(os.path.normpath(model_dir)))
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    return output


def main(argv):
    del argv
    model_dir, output = flags.FLAGS.model_dir, flags.FLAGS.output
    if not model_dir:
        sys.exit('error: --model_dir is required')
    try:
        path = plot(model_dir, output or os.path.join(model_dir, 'metrics.png'))
    except FileNotFoundError as error:
        sys.exit(f'error: {error}')
    print(f'wrote {path}')


if __name__ == '__main__':
    from imagenet_tpu import runtime  # before TensorFlow: the package's oneDNN setting
    runtime.import_tensorflow()     # a quiet start (no CUDA-probe line without a GPU)
    define_flags()
    app.run(main)
