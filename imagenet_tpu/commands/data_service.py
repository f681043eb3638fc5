"""python -m imagenet_tpu.commands.data_service dispatcher|worker: a tf.data service dispatcher or worker
(imagenet_tpu.data.data_service), serving until killed (SIGTERM or Ctrl-C).

    python -m imagenet_tpu.commands.data_service dispatcher --port=5050 [--host=NAME]
    python -m imagenet_tpu.commands.data_service worker --dispatcher=HOST:5050 [--port=5051] [--host=NAME]

--host is the name the others reach this machine by (default: its host name): the dispatcher prints it in its
address, a worker gives it to the dispatcher, which hands it to the trainers. It does not limit where the server
listens: TensorFlow's tf.data servers listen on every interface of the machine, IPv4 and IPv6, whatever --host
says (tensorflow/core/data/service/server_lib.cc, GrpcDataServerBase::Start in TensorFlow 2.20:
AddListeningPort("0.0.0.0:" + port); no field of DispatcherConfig or WorkerConfig sets the address), and they
ask for no authentication ('grpc', the only protocol, uses gRPC's insecure credentials:
tensorflow/core/data/service/credentials_factory.cc, InsecureCredentialsFactory). Whoever reaches the port can
join workers to the dispatcher and have the workers run dataset graphs of their own, with the files the
workers' user can read and write. Run the service on a private network, or behind a firewall that admits only
the trainers and the service's own machines; on one machine, firewall its ports against other hosts (BUILD.md,
"The tf.data service on a network").
"""

import argparse
import socket
import sys
import time

if __name__ == '__main__':   # python -m: SIGTERM taken over before TensorFlow starts threads (preemption.py)
    from imagenet_tpu.training import preemption
    preemption.listen()

from imagenet_tpu.commands import common  # noqa: F401  first: a quiet TensorFlow start (common.py)
from imagenet_tpu.config import SERVICE_PROTOCOL as PROTOCOL
from imagenet_tpu.data.data_service import serve_dispatcher, serve_worker


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog='python -m imagenet_tpu.commands.data_service',
                                     description=__doc__.split('\n')[0])
    commands = parser.add_subparsers(dest='role', required=True)
    host_help = ('the name the others reach this machine by (default: its host name); the server listens on '
                 'every interface all the same')
    dispatcher = commands.add_parser('dispatcher', help='the tf.data service dispatcher')
    dispatcher.add_argument('--port', type=int, default=5050)
    dispatcher.add_argument('--host', default=socket.gethostname(), help=host_help)
    dispatcher.add_argument('--worker_timeout_ms', type=int, default=0,
                            help="a worker silent this long is dropped (0: TensorFlow's default)")
    worker = commands.add_parser('worker', help='a tf.data service worker')
    worker.add_argument('--dispatcher', required=True, help='HOST:PORT of the dispatcher')
    worker.add_argument('--port', type=int, default=0, help='0: any free port')
    worker.add_argument('--host', default=socket.gethostname(), help=host_help)
    worker.add_argument('--heartbeat_interval_ms', type=int, default=1000,
                        help='how often the worker asks the dispatcher for new work')
    return parser.parse_args(argv)


def exposure_warning(role: str, host: str, port: int) -> str:
    """The line each server prints at start: where it really listens, and that nothing authenticates callers."""
    return (f'warning: the tf.data {role} listens on port {port} of every interface of this machine, not only '
            f'{host}, without authentication: keep the port behind a firewall (see BUILD.md)')


def start(args: argparse.Namespace):
    """Starts the server ``args`` describe (parse_args) and prints where it serves; returns the server."""
    if args.role == 'dispatcher':
        server = serve_dispatcher(args.port, args.worker_timeout_ms)
        port = int(server.target.rsplit(':', 1)[1])
        print(f'dispatcher at {PROTOCOL}://{args.host}:{port}', flush=True)
    else:
        server = serve_worker(args.dispatcher.removeprefix(f'{PROTOCOL}://'), args.port, args.host,
                              args.heartbeat_interval_ms)
        port = int(server._address.rsplit(':', 1)[1])  # pylint: disable=protected-access  (no public accessor)
        print(f'worker at {args.host}:{port} for dispatcher {args.dispatcher}', flush=True)
    print(exposure_warning(args.role, args.host, port), file=sys.stderr, flush=True)
    return server


def main(argv=None) -> int:
    """The dispatcher or a worker, serving until killed (SIGTERM or Ctrl-C)."""
    args = parse_args(argv)
    try:
        server = start(args)  # noqa: F841  (kept referenced: the server stops when collected)
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
