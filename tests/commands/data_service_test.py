"""The tf.data service's dispatcher and worker command: where each says it serves, and the warning it prints because
TensorFlow's servers listen on every interface, whatever --host names, and authenticate no one (the command's
docstring cites TensorFlow's source). The servers run in this process; training through them is
tests/multiprocess/data_service_test.py."""

import contextlib
import io
import socket

import tensorflow as tf

import helpers
from imagenet_tpu.commands import data_service as command

helpers.use_eight_cpus()

OTHER_LOOPBACK = '127.0.0.2'    # on Linux all of 127.0.0.0/8 is this machine, but a socket bound to 127.0.0.1 is not


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def started(*argv):
    """(server, stdout lines, stderr lines) of command.start on ``argv``."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        server = command.start(command.parse_args(list(argv)))
    return server, stdout.getvalue().splitlines(), stderr.getvalue().splitlines()


class DataServiceCommandTest(tf.test.TestCase):

    def test_each_server_says_where_it_serves_and_that_it_listens_on_every_interface(self):
        dispatcher, out, err = started('dispatcher', '--port=0', '--host=localhost')
        self.addCleanup(dispatcher._stop)  # pylint: disable=protected-access  (no public stop that returns)
        port = int(dispatcher.target.rsplit(':', 1)[1])
        self.assertEqual(out, [f'dispatcher at grpc://localhost:{port}'])
        self.assertEqual(err, [f'warning: the tf.data dispatcher listens on port {port} of every interface of this '
                               'machine, not only localhost, without authentication: keep the port behind a firewall '
                               '(see BUILD.md)'])
        worker, out, err = started('worker', f'--dispatcher=grpc://localhost:{port}', '--host=localhost', '--port=0')
        self.addCleanup(worker._stop)  # pylint: disable=protected-access
        worker_port = int(worker._address.rsplit(':', 1)[1])  # pylint: disable=protected-access
        self.assertEqual(out, [f'worker at localhost:{worker_port} for dispatcher grpc://localhost:{port}'])
        self.assertLen(err, 1)
        self.assertStartsWith(err[0], f'warning: the tf.data worker listens on port {worker_port} of every interface')

        # What the warning says: --host=localhost does not confine TensorFlow's servers (server_lib.cc binds
        # 0.0.0.0). If this starts to fail, TensorFlow binds the named host now: --host could then be enforced.
        probe = socket.socket()
        try:
            probe.bind((OTHER_LOOPBACK, 0))
        except OSError:
            self.skipTest(f'{OTHER_LOOPBACK} is not an address of this machine')
        finally:
            probe.close()
        for name, server_port in (('dispatcher', port), ('worker', worker_port)):
            self.assertTrue(connects('127.0.0.1', server_port), name)
            self.assertTrue(connects(OTHER_LOOPBACK, server_port), f'the {name} no longer listens on every interface')

    def test_a_port_in_use_is_one_line(self):
        with socket.socket() as taken:
            taken.bind(('', 0))
            taken.listen()
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                status = command.main(['dispatcher', f'--port={taken.getsockname()[1]}', '--host=localhost'])
        self.assertEqual(status, 2)
        self.assertLen(stderr.getvalue().splitlines(), 1, stderr.getvalue())
        self.assertStartsWith(stderr.getvalue(), 'error: cannot start the dispatcher: ')


if __name__ == '__main__':
    tf.test.main()
