"""Rehearses a recipe on this machine before a pod runs it: its own settings, only the sizes shrunk, on simulated
hosts, preempted at a random step, resumed to the uninterrupted run's weights, evaluated, exported to every format
and planned (imagenet_tpu/rehearse.py says what is kept and what is shrunk).

    imagenet-tpu-rehearse --recipe=tpu_v3_1024_bs32k
    imagenet-tpu-rehearse --flagfile=my_recipe.cfg --json
    imagenet-tpu-rehearse --recipe=all          # every recipe that comes with the package, one after another

Besides every training flag (the recipe's; --data_dir and --model_dir are the rehearsal's own):
  --json            print the report as one JSON object
  --folder=PATH     where the rehearsal writes (default: a new temporary folder)
Exit status 0 when every phase passed, 1 when one failed (the report names it), 2 for bad input.
"""

import json
import os
import sys
import tempfile

if __name__ == '__main__':   # python -m: SIGTERM taken over before TensorFlow starts threads (preemption.py)
    from imagenet_tpu.training import preemption
    preemption.listen()

from imagenet_tpu.commands import common  # first: a quiet TensorFlow start (common.py)
from absl import flags

from imagenet_tpu import rehearse
from imagenet_tpu.errors import RunError

common.define_flags()
_JSON = flags.DEFINE_bool('json', False, 'Print the report as one JSON object.')
_FOLDER = flags.DEFINE_string('folder', None, 'Where the rehearsal writes its data and runs (default: a new '
                              'temporary folder).')


def recipe_name(argv) -> str:
    for argument in argv:
        if argument.startswith('--flagfile='):
            return os.path.splitext(os.path.basename(argument.split('=', 1)[1]))[0]
    return ''


def main(argv):
    common.quiet_logs()
    if len(argv) > 1:
        common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
    try:
        config = common.config_from_flags()
        report = rehearse.rehearse(config, _NAME, _FOLDER.value, print_fn=lambda line: print(line, flush=True))
    except RunError as error:
        common.fail(str(error), common.exit_status(error))
    print(json.dumps(report, indent=2) if _JSON.value else rehearse.describe(report), flush=True)
    sys.exit(1 if 'failed' in report else 0)


def run(argv=None):
    """The console script imagenet-tpu-rehearse; --recipe=all rehearses every recipe, each in a process of its own."""
    global _NAME  # pylint: disable=global-statement
    argv = list(sys.argv if argv is None else argv)
    if any(argument in ('--recipe=all', '-recipe=all') for argument in argv[1:]):
        sys.exit(_rehearse_all(argv))
    _NAME = recipe_name(common.expand_recipes(argv[1:]))
    common.run_with_help(main, __doc__, argv)


_NAME = ''


def _rehearse_all(argv) -> int:
    import subprocess  # pylint: disable=import-outside-toplevel
    others = [argument for argument in argv[1:] if argument not in ('--recipe=all', '-recipe=all')]
    failed = []
    for name in common.recipes():
        folder = tempfile.mkdtemp(prefix=f'rehearsal-{name}-')
        print(f'== {name}', flush=True)
        status = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.rehearse', f'--recipe={name}',
                                 f'--folder={folder}', *others]).returncode
        if status:
            failed.append(name)
    print(f'rehearsed {len(common.recipes())} recipes; failed: {", ".join(failed) or "none"}', flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    run()
