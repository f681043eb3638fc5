"""Command line: flags -> Config -> train.train_and_evaluate, with each error as one line and an exit status.

    imagenet-tpu-train --flagfile=flags/demo.cfg
    imagenet-tpu-train --flagfile=flags/tpu_v3_8.cfg --data_dir=gs://... --model_dir=gs://...

Every flag is a Config field of the same name (config.py holds its default, help, choices and unit), so the
command line and ``train.train_and_evaluate(Config(...))`` run the same way. Bad input (missing data, settings
that cannot work) ends with one line ``error: ...`` on stderr and exit status 2; SIGTERM during training saves a
checkpoint and exits with status 143 (run the same command to continue).
"""

import functools
import sys

if __name__ == '__main__':   # python -m: SIGTERM taken over before TensorFlow starts threads (preemption.py)
    from imagenet_tpu.training import preemption
    preemption.listen()

from imagenet_tpu.commands import common  # first: a quiet TensorFlow start (common.py)
from imagenet_tpu import errors, runtime, train
from imagenet_tpu.training import preemption

common.define_flags()


def main(argv):
    common.quiet_logs()
    if len(argv) > 1:
        common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
    runtime.limit_malloc_arenas()
    preemption.set_grace(0, 'before training started; nothing to save')
    try:
        # Flushed lines: progress reaches a log file or pipe as it happens, and survives a kill.
        train.train_and_evaluate(common.config_from_flags(), print_fn=functools.partial(print, flush=True))
    except errors.Preempted as error:
        print(str(error), file=sys.stderr)
        sys.exit(common.exit_status(error))
    except errors.RunError as error:
        common.fail(str(error), common.exit_status(error))


def run(argv=None):
    """The console script imagenet-tpu-train."""
    common.run_with_help(main, __doc__, argv)


if __name__ == '__main__':
    run()
