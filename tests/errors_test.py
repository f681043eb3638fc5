"""errors.py: the failure types, and the line of a TensorFlow runtime error that says what went wrong."""

import os
import tempfile

import tensorflow as tf

from imagenet_tpu import errors


def _runtime_error(function, *args) -> str:
    """The message of the error ``function`` (a tf.function of a real kernel) raises on ``args``."""
    try:
        function(*args)
    except tf.errors.OpError as error:
        return error.message
    raise AssertionError('no error raised')


class ErrorsTest(tf.test.TestCase):

    def test_every_failure_is_a_run_error_and_configuration_is_also_a_value_error(self):
        for kind in (errors.ConfigError, errors.DataError, errors.CheckpointError, errors.TrainingDiverged,
                     errors.InputEnded, errors.Preempted):
            self.assertTrue(issubclass(kind, errors.RunError), kind)
        self.assertTrue(issubclass(errors.ConfigError, ValueError))
        self.assertFalse(issubclass(errors.DataError, errors.ConfigError))

    def test_summary_of_a_jpeg_that_does_not_decode(self):
        decode = tf.function(lambda data: tf.io.decode_jpeg(data, channels=3))
        message = _runtime_error(decode, tf.constant(b'\xff\xd8 not a jpeg at all'))
        summary = errors.summarize_graph_error(message)
        self.assertNotIn('\n', summary)
        self.assertIn(summary, message)
        self.assertRegex(summary, '(?i)jpeg|image')

    def test_summary_of_a_failed_assertion_is_its_text(self):
        @tf.function
        def check(label):
            tf.debugging.assert_less(label, 4, message='label out of range')
            return label

        message = _runtime_error(check, tf.constant(9))
        self.assertIn('Graph execution error', message)
        self.assertIn('label out of range', errors.summarize_graph_error(message))

    def test_summary_of_a_cut_tfrecord_file(self):
        path = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), 'cut.tfrecord')
        with tf.io.TFRecordWriter(path) as writer:
            writer.write(b'x' * 100)
        with open(path, 'rb') as f:
            content = f.read()
        with open(path, 'wb') as f:
            f.write(content[:60])
        message = _runtime_error(lambda: list(tf.data.TFRecordDataset(path)))
        self.assertRegex(errors.summarize_graph_error(message), r'^(truncated|corrupted) record at \d+$')


if __name__ == '__main__':
    tf.test.main()
