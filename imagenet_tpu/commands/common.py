"""What every command shares: a quiet TensorFlow start, one absl flag per Config field, --help by section, and
each failure as one ``error:`` line with its exit status (EXIT_STATUS). Import this module first in a command:
it settles the environment before TensorFlow starts."""

import dataclasses
import os
import stat
import sys
import textwrap
import typing
from typing import List, Sequence

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # keep TensorFlow's C++ start-up chatter out of the progress

from imagenet_tpu import runtime  # first: sets oneDNN before TensorFlow is imported (runtime.py)
from imagenet_tpu.distribute import cluster  # noqa: E402

cluster.bind_slurm_gpus()     # a Slurm task's GPUs, before TensorFlow lists the devices (cluster.py)
tf = runtime.import_tensorflow()
from absl import app, flags, logging  # noqa: E402

from imagenet_tpu import config as config_lib  # noqa: E402
from imagenet_tpu import errors  # noqa: E402
from imagenet_tpu.config import Config  # noqa: E402
from imagenet_tpu.training import preemption  # noqa: E402

# Exit status per kind of failure (errors.py); the first class the error is an instance of wins.
EXIT_STATUS = (
    (errors.Preempted, 143),     # 128 + SIGTERM, as if the signal had ended the process: run again to continue
    (errors.RunError, 2),        # a setting, the data, a checkpoint, divergence or the input's end: fix, rerun
)
HELP_FLAGS = ('-h', '--help', '-help', '--helpshort', '-?')


def _help_text(field: dataclasses.Field) -> str:
    meta = field.metadata
    text = meta['help']
    if meta['choices']:
        text += ' One of: ' + ', '.join(str(choice) for choice in meta['choices']) + '.'
    if meta['unit']:
        text += f' [{meta["unit"]}]'
    return text


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """One absl flag per Config field, of the field's name, type and default (a no-op if already defined)."""
    for field, kind in config_lib.settings():
        if field.name in flag_values:
            continue
        default, text = field.default, _help_text(field)
        if field.metadata['parse'] is not None:
            if typing.get_args(kind)[-1:] == (Ellipsis,):      # Tuple[X, ...]: a comma-separated list
                flags.DEFINE_list(field.name, [str(item) for item in default], text, flag_values=flag_values)
            else:                                              # text the field's parse function reads
                flags.DEFINE_string(field.name, None if default is None else str(default), text,
                                    flag_values=flag_values)
        elif kind is bool:
            flags.DEFINE_bool(field.name, default, text, flag_values=flag_values)
        elif kind is int:
            flags.DEFINE_integer(field.name, default, text, flag_values=flag_values)
        elif kind is float:
            flags.DEFINE_float(field.name, default, text, flag_values=flag_values)
        elif kind is str:
            flags.DEFINE_string(field.name, default, text, flag_values=flag_values)
        else:
            raise TypeError(f'no flag type for Config.{field.name}: {kind}')



def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Config:
    """The Config of the parsed flags: each field from its flag, through the field's parse function if any."""
    values = {}
    for field, _ in config_lib.settings():
        value = flag_values[field.name].value
        parse = field.metadata['parse']
        values[field.name] = parse(value) if parse is not None and value is not None else value
    return Config(**values)


def _flag_with_default(field: dataclasses.Field, kind) -> str:
    if kind is bool:
        default = 'automatic' if field.default is None else 'on' if field.default else 'off'
        return f'--[no]{field.name} (default: {default})'
    if field.default is None:
        return f'--{field.name} (not set by default)'
    default = field.default
    if isinstance(default, tuple):
        default = ','.join(f'{item:g}' for item in default)
    return f'--{field.name}={default}'


def usage(doc: str, command_flags: Sequence[str] = (), training_flags: bool = True,
          flag_values: flags.FlagValues = flags.FLAGS) -> str:
    """--help: what the command does (``doc``), the command's own flags (``command_flags``, by name) and, with
    ``training_flags``, every training flag, by section, with defaults."""
    lines = [doc.strip(), '', 'Flags (--helpfull adds absl\'s own):']
    if command_flags:
        lines += ['', 'This command:'] if training_flags else ['']
        for name in command_flags:
            flag = flag_values[name]
            if flag.boolean:
                lines.append(f'  --[no]{name} (default: {"on" if flag.default else "off"})')
            else:
                lines.append(f'  --{name}' + (' (not set by default)' if flag.default is None else f'={flag.default}'))
            lines += textwrap.wrap(flag.help, 100, initial_indent='      ', subsequent_indent='      ')
    if training_flags:
        lines += ['', '--recipe=NAME stands for --flagfile of a recipe that comes with the package (flags after it '
                  'override it; --recipe=list lists them): ' + ', '.join(recipes())]
    for section in config_lib.SECTIONS if training_flags else ():
        lines += ['', f'{section.capitalize()}:']
        for field, kind in config_lib.settings():
            if field.metadata['section'] != section:
                continue
            lines.append(f'  {_flag_with_default(field, kind)}')
            lines += textwrap.wrap(_help_text(field), 100, initial_indent='      ', subsequent_indent='      ')
    return '\n'.join(lines) + '\n'


def fail(message: str, status: int = 2) -> None:
    print(f'error: {message}', file=sys.stderr)
    sys.exit(status)


def exit_status(error: errors.RunError) -> int:
    if isinstance(error, errors.Preempted):
        return preemption.exit_status()      # 143 after SIGTERM, 130 after Ctrl-C
    return next(status for kind, status in EXIT_STATUS if isinstance(error, kind))


def quiet_logs() -> None:
    """absl and TensorFlow log warnings and errors only: the command's own lines are the progress."""
    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel('WARNING')


def flag_error_message(error: Exception) -> str:
    """One line for flags that cannot be parsed: an unknown flag or a bad value, on the command line or in a
    --flagfile, or a --flagfile that cannot be read."""
    if isinstance(error, UnicodeDecodeError):
        return f'a --flagfile is not UTF-8 text ({error.reason} at byte {error.start})'
    message = ' '.join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, flags.CantOpenFlagFileError):
        return 'cannot read --flagfile: ' + message.split('Unable to open flagfile: ', 1)[-1]
    return message


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> List[str]:
    """``flag_values`` parsed from ``argv`` (the program's name first); returns the arguments left. Flags that
    cannot be parsed end the process with one ``error:`` line and status 2 (absl's own parser says "FATAL" and
    exits with 1)."""
    try:
        return flag_values(list(argv))
    except (flags.Error, OSError, UnicodeDecodeError) as error:   # (absl reports an unreadable file as flags.Error)
        fail(flag_error_message(error))


def recipe_folder() -> str:
    """The folder of the recipes: imagenet_tpu/recipes, the files themselves in an installed package and a link to
    flags/ in a checkout."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'recipes')


def recipes() -> List[str]:
    """The names of the recipes that come with the package (flags/NAME.cfg), sorted."""
    folder = recipe_folder()
    return sorted(name[:-len('.cfg')] for name in os.listdir(folder) if name.endswith('.cfg')) \
        if os.path.isdir(folder) else []


def expand_recipes(argv: Sequence[str]) -> List[str]:
    """``argv`` with each --recipe=NAME (or --recipe NAME) replaced by --flagfile= of that recipe, at its place
    (so flags after it override it, as after a --flagfile). --recipe=list prints the names and exits."""
    expanded, arguments = [], list(argv)
    while arguments:
        argument = arguments.pop(0)
        if argument in ('--recipe', '-recipe') and arguments:
            argument = f'--recipe={arguments.pop(0)}'
        if not argument.startswith(('--recipe=', '-recipe=')):
            expanded.append(argument)
            continue
        name = argument.split('=', 1)[1]
        names = recipes()
        if name == 'list':
            print('\n'.join(names))
            sys.exit(0)
        if name not in names:
            fail(f'no recipe {name!r}; the recipes are {", ".join(names)} (or --flagfile=PATH of your own)')
        expanded.append(f'--flagfile={os.path.join(recipe_folder(), name + ".cfg")}')
    return expanded


def run_with_help(main, doc: str, argv=None, command_flags: Sequence[str] = (), training_flags: bool = True) -> None:
    """A console script: our --help (absl's shows only the flags of the script's own module; usage() says what
    ours lists), then absl's app.run with our flag parser (parse_flags: a bad flag or flagfile is one line).
    --recipe=NAME stands for the --flagfile of a recipe that comes with the package (expand_recipes)."""
    argv = list(sys.argv if argv is None else argv)
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        sys.stdout.write(usage(doc, command_flags, training_flags))
        sys.exit(0)
    argv = argv[:1] + expand_recipes(argv[1:]) if training_flags else argv
    check_flagfiles(argv[1:])
    app.run(main, argv, flags_parser=parse_flags)


FLAGFILE_MAX_BYTES = 1 << 20     # a recipe is a few KB; absl would read /dev/zero or a FIFO without end


def check_flagfiles(argv: Sequence[str]) -> None:
    """One error line for a --flagfile that is not a regular file of at most FLAGFILE_MAX_BYTES (absl reads the
    file line by line without a bound: --flagfile=/dev/zero read 6.6 GB in 16 s)."""
    arguments = list(argv)
    while arguments:
        argument = arguments.pop(0)
        if argument in ('--flagfile', '-flagfile') and arguments:
            argument = f'--flagfile={arguments.pop(0)}'
        if not argument.startswith(('--flagfile=', '-flagfile=')):
            continue
        path = argument.split('=', 1)[1]
        try:
            info = os.stat(path)
        except OSError:
            continue        # absl says it cannot read it (parse_flags)
        if not stat.S_ISREG(info.st_mode) or info.st_size > FLAGFILE_MAX_BYTES:
            fail(f'--flagfile={path} is not a flag file: a regular file of at most {FLAGFILE_MAX_BYTES >> 20} MiB '
                 'is expected')
