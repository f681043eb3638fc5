"""python -m imagenet_tpu.commands.data_service dispatcher|worker: a tf.data service dispatcher or worker
(imagenet_tpu.data.service), serving until killed (SIGTERM or Ctrl-C)."""

import argparse
import socket
import sys
import time

from imagenet_tpu.commands import common  # noqa: F401  first: a quiet TensorFlow start (common.py)
from imagenet_tpu.config import SERVICE_PROTOCOL as PROTOCOL
from imagenet_tpu.data.service import serve_dispatcher, serve_worker


def main(argv=None) -> int:
    """The dispatcher or a worker, serving until killed (SIGTERM or Ctrl-C)."""
    parser = argparse.ArgumentParser(prog='python -m imagenet_tpu.commands.data_service',
                                     description=__doc__.split('\n')[0])
    commands = parser.add_subparsers(dest='role', required=True)
    dispatcher = commands.add_parser('dispatcher', help='the tf.data service dispatcher')
    dispatcher.add_argument('--port', type=int, default=5050)
    dispatcher.add_argument('--worker_timeout_ms', type=int, default=0,
                            help="a worker silent this long is dropped (0: TensorFlow's default)")
    worker = commands.add_parser('worker', help='a tf.data service worker')
    worker.add_argument('--dispatcher', required=True, help='HOST:PORT of the dispatcher')
    worker.add_argument('--port', type=int, default=0, help='0: any free port')
    worker.add_argument('--host', default=socket.gethostname(),
                        help='the name trainers reach this machine by (default: its host name)')
    worker.add_argument('--heartbeat_interval_ms', type=int, default=1000,
                        help='how often the worker asks the dispatcher for new work')
    args = parser.parse_args(argv)

    try:
        if args.role == 'dispatcher':
            server = serve_dispatcher(args.port, args.worker_timeout_ms)
            print(f'dispatcher at {server.target}', flush=True)
        else:
            server = serve_worker(args.dispatcher.removeprefix(f'{PROTOCOL}://'), args.port, args.host,
                                  args.heartbeat_interval_ms)
            port = server._address.split(':')[-1]  # pylint: disable=protected-access  (no public accessor)
            print(f'worker at {args.host}:{port} for dispatcher {args.dispatcher}',
                  flush=True)
    except Exception as error:  # pylint: disable=broad-except  (a port in use, a bad address: one line)
        print(f'error: cannot start the {args.role}: {str(error).splitlines()[0]}', file=sys.stderr)
        return 2
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == '__main__':
    sys.exit(main())
