"""Evaluation of a run's checkpoints: top-1, top-5, loss and per-class accuracy on every validation image once.

    imagenet-tpu-eval --model_dir=RUN                       # the latest checkpoint
    imagenet-tpu-eval --model_dir=RUN --checkpoint=all      # every checkpoint kept, and a plot over them
    imagenet-tpu-eval --model_dir=RUN --checkpoint=ckpt-500 --data_dir=/other/imagenet --strategy=mirrored

The run's settings come from RUN/config.json (written when it trained); any training flag given on the command
line overrides them, and --flagfile works as for training (for a run without config.json, the flags alone
describe it). The batch-norm statistics are the run's: moving
averages, the last batch's, or re-estimated from training batches ('reestimate', which then needs the training
shards). Results go to RUN/eval/: CKPT.json (top-1, top-5, loss, images), CKPT_per_class.csv (accuracy of each
class, named from labels.txt) and, for several checkpoints, accuracy.png and summary.json.
"""

import dataclasses
import os

if __name__ == '__main__':   # python -m: SIGTERM taken over before TensorFlow starts threads (preemption.py)
    from imagenet_tpu.training import preemption
    preemption.listen()

from imagenet_tpu.commands import common  # first: a quiet TensorFlow start (common.py)
from absl import flags
import tensorflow as tf

from imagenet_tpu import evaluate
from imagenet_tpu.config import Config
from imagenet_tpu.errors import ConfigError, RunError
from imagenet_tpu.training import run_folder

common.define_flags()
_CHECKPOINT = flags.DEFINE_string('checkpoint', 'latest', "Which checkpoint of --model_dir: 'latest', 'all' or a "
                                  "name such as ckpt-500.")


def main(argv):
    common.quiet_logs()
    if len(argv) > 1:
        common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
    try:
        evaluate.evaluate_run(run_settings(), checkpoint_flag(), print_fn=lambda line: print(line, flush=True))
    except RunError as error:
        common.fail(str(error), common.exit_status(error))


def checkpoint_flag() -> str:
    return _CHECKPOINT.value


def run_settings() -> Config:
    """The Config of --model_dir's run (its config.json) with the training flags given on the command line or in
    a flagfile applied; for a run without config.json, the flags alone. ConfigError without --model_dir."""
    model_dir = flags.FLAGS.model_dir
    if not model_dir:
        raise ConfigError('--model_dir is not set (the folder of a training run)')
    if tf.io.gfile.exists(os.path.join(model_dir, run_folder.CONFIG_FILE)):
        return evaluate.run_config(model_dir, {field.name: value for field, value in zip(*_given_settings())})
    return common.config_from_flags()   # a run from before config.json: its flags (e.g. its --flagfile)


def _given_settings():
    """(fields, values) of the training settings given on the command line or in a flagfile."""
    given = [(field, value) for field, value in zip(dataclasses.fields(Config),
                                                    dataclasses.astuple(common.config_from_flags()))
             if flags.FLAGS[field.name].present and field.name != 'model_dir']
    return [field for field, _ in given], [value for _, value in given]


def run(argv=None):
    """The console script imagenet-tpu-eval."""
    common.run_with_help(main, __doc__, argv, command_flags=('checkpoint',))


if __name__ == '__main__':
    run()
