"""The fit loop: the model.fit calls a run makes (one per fit segment, so a resumed run finishes its interrupted epoch
first), the final evaluation, and the Keras behaviours it works around (an input that ends quietly, validation
logs that are the final evaluation, input errors that surface as step errors).
"""

import contextlib
from typing import Callable, List, NamedTuple

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.config import Config
from imagenet_tpu.data import eval_input, record_io
from imagenet_tpu.distribute import strategy as strategy_lib
from imagenet_tpu.errors import DataError, HostLost, InputEnded, Preempted, StepError, summarize_graph_error
from imagenet_tpu.training import callbacks as callbacks_lib
from imagenet_tpu.training import preemption, sigterm_saves


class FitSegment(NamedTuple):
    initial_epoch: int
    epochs: int
    steps_per_epoch: int


def fit_segments(start_step: int, total_steps: int, steps_per_epoch: int) -> List[FitSegment]:
    """model.fit calls that run steps start_step..total_steps with epochs aligned to steps_per_epoch.

    A resumed run first finishes the interrupted epoch (a short epoch), then runs whole epochs; a final partial
    epoch (fractional train_epochs) is its own call.
    """
    segments = []
    step = start_step
    while step < total_steps:
        epoch, done = divmod(step, steps_per_epoch)
        if done or total_steps - step < steps_per_epoch:
            steps = min(steps_per_epoch - done, total_steps - step)
            segments.append(FitSegment(epoch, epoch + 1, steps))
        else:
            whole = (total_steps - step) // steps_per_epoch
            segments.append(FitSegment(epoch, epoch + whole, steps_per_epoch))
            steps = whole * steps_per_epoch
        step += steps
    return segments


def validates_last_epoch(config: Config, segment: FitSegment) -> bool:
    """Whether Keras validates after the last epoch of the fit call ``segment`` (validation_freq: after epoch e
    with (e + 1) % eval_every_epochs == 0): then that validation, of the final weights, is the run's final
    evaluation, and none follows it."""
    return segment.epochs % config.eval_every_epochs == 0


def planned_evaluations(config: Config) -> int:
    """Evaluations a fresh run does: those of its model.fit calls (fit_segments, Keras validating
    after every epoch e with (e + 1) % eval_every_epochs == 0) and a final one, unless the last epoch's validation
    was of the final weights already; none on synthetic data."""
    if config.synthetic_data:
        return 0
    segments = fit_segments(0, config.train_steps, config.steps_per_epoch)
    during = sum((epoch + 1) % config.eval_every_epochs == 0
                 for segment in segments for epoch in range(segment.initial_epoch, segment.epochs))
    return during + (0 if segments and validates_last_epoch(config, segments[-1]) else 1)


# Marks of an error raised inside the input pipeline (the iterator's ops, the record reader, the decoders).
_INPUT_ERROR_MARKS = ('IteratorGetNext', 'MultiDeviceIterator', 'record at', 'JPEG', 'jpeg', 'image file format',
                      'Feature:', 'image too large', 'to_model_label', 'label', record_io.NO_USABLE_RECORD)


def is_input_error(error: tf.errors.OpError) -> bool:
    """Whether a runtime error of fit or evaluate came from the input pipeline rather than from the step."""
    return isinstance(error, tf.errors.DataLossError) or any(mark in error.message for mark in _INPUT_ERROR_MARKS)


@contextlib.contextmanager
def input_errors():
    """A bad record met inside the input pipeline under bad_records='fatal' (a JPEG that does not decode, a label
    outside the range, a missing feature, a file cut mid-record) surfaces from fit or evaluate as a TensorFlow
    runtime error; inside this block it becomes a DataError naming what was wrong, and an input in which every
    record fails a DataError saying so. Any other runtime error of the step is a StepError (not a bad record), and
    a host that stopped answering a HostLost."""
    try:
        yield
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
        summary = summarize_graph_error(error.message)
        if record_io.NO_USABLE_RECORD in error.message:
            found = error.message[error.message.index(record_io.NO_USABLE_RECORD):]
            raise DataError(found.splitlines()[0].split(' [Condition')[0].rstrip('] ')) from None
        if is_input_error(error):
            raise DataError(f'bad input record: {summary}') from None
        raise StepError(f'the step failed: {summary}') from None
    except (tf.errors.UnavailableError, tf.errors.AbortedError) as error:
        # How TensorFlow's collectives and the TPU runtime report a host that is gone (gRPC UNAVAILABLE, or an
        # aborted collective / coordination service); a lost host cannot be recovered within the run.
        raise HostLost(f'a host of the run stopped answering ({type(error).__name__}: '
                       f'{summarize_graph_error(error.message)}); run the same command again once every host is '
                       'back: it resumes from the last checkpoint') from None


def current_step(classifier: keras.Model) -> int:
    return int(classifier.optimizer.iterations.numpy())


def fit(config: Config, classifier: keras.Model, strategy: tf.distribute.Strategy, train_data_from: Callable,
        eval_data, callbacks: list) -> dict:
    """Trains from the classifier's step to config.train_steps, one model.fit call per fit segment, evaluating
    every eval_every_epochs epochs; returns the steps reached, the last epoch's train_loss and images_per_second,
    and, when the last epoch was validated, that validation's figures as 'final_validation' (the final weights'
    evaluation). ``train_data_from(step)``: the distributed training stream from that step on (each model.fit call
    iterates its dataset from the beginning, so a call that starts at step N needs the stream built for N).
    Raises Preempted after a SIGTERM save, InputEnded when a fit call's input ran out."""
    start_step = current_step(classifier)
    eval_steps = eval_input.eval_steps(config, strategy_lib.num_input_pipelines(strategy))
    validate = eval_data is not None and config.eval_every_epochs
    sigterm = next((c for c in callbacks if isinstance(c, sigterm_saves.SaveOnSigterm)), None)
    train_loss, images_per_second, evaluations, noise, final_validation = float('nan'), 0.0, 0, None, None
    for segment in fit_segments(start_step, config.train_steps, config.steps_per_epoch):
        step = current_step(classifier)
        train_data = train_data_from(step)
        planned = step + (segment.epochs - segment.initial_epoch) * segment.steps_per_epoch
        with callbacks_lib.watch_input_end() as input_end:
            try:
                history = classifier.fit(
                    train_data, initial_epoch=segment.initial_epoch, epochs=segment.epochs,
                    steps_per_epoch=segment.steps_per_epoch, callbacks=callbacks, verbose=0,
                    validation_data=eval_data if validate else None, validation_steps=eval_steps,
                    validation_freq=config.eval_every_epochs if validate else 1)
            except ValueError as error:   # Keras, when the input ends before the first step: "(Empty logs)"
                if 'Empty logs' not in str(error):
                    raise
                history = None
        if sigterm and sigterm.saved_step is not None:
            raise Preempted(f'stopped by {preemption.signal_name()} at step {sigterm.saved_step} after saving it; '
                            'run the same command again to continue')
        reached = current_step(classifier)
        if reached < planned or input_end.seen:
            # Keras stops a fit call quietly ("Your input ran out of data") when its input ends; ours never
            # should. Seen once in ~10 runs: a bad record under --bad_records=fatal, reported by the distributed
            # iterator as the end of the data instead of as the error.
            raise InputEnded(f'the training input ended early (this fit call was to reach step {planned}; the '
                             f'step counter is at {reached}); the stream is endless, so an input error ended it. '
                             'With --bad_records=fatal that can be a bad record: --bad_records=skip skips and '
                             'counts them')
        if history and history.history.get('loss'):
            train_loss = history.history['loss'][-1]
            images_per_second = history.history['images_per_second'][-1]
            if 'noise_scale' in history.history:
                noise = float(history.history['noise_scale'][-1])
        if history:
            evaluations += len(history.history.get('val_loss', []))
        final_validation = None
        if (history and validate and reached == config.train_steps and validates_last_epoch(config, segment)
                and history.history.get('val_loss')):
            # Keras's validation logs are evaluate()'s results, each name prefixed with 'val_'.
            final_validation = {name[len('val_'):]: float(values[-1]) for name, values in history.history.items()
                                if name.startswith('val_')}
    return {'steps': current_step(classifier), 'train_loss': float(train_loss),
            'images_per_second': float(images_per_second), 'evaluations': evaluations,
            **({'noise_scale': noise} if noise is not None else {}),
            **({'final_validation': final_validation} if final_validation else {})}


def evaluate(config: Config, classifier: keras.Model, strategy: tf.distribute.Strategy,
             eval_data, callbacks: list, print_fn=print) -> dict:
    """Held-out loss, top_1 and top_5 over every validation image once, and eval_images (the count)."""
    eval_steps = eval_input.eval_steps(config, strategy_lib.num_input_pipelines(strategy))
    kept = (callbacks_lib.InputWatchdog, callbacks_lib.AverageMovingStatistics, callbacks_lib.ReestimateBatchNorm,
            sigterm_saves.SaveOnSigterm)
    evaluated = classifier.evaluate(eval_data, steps=eval_steps, verbose=0, return_dict=True,
                                    callbacks=[c for c in callbacks if isinstance(c, kept)])
    return report_evaluation(config, classifier, evaluated, print_fn)


def report_evaluation(config: Config, classifier: keras.Model, evaluated: dict,
                      print_fn=print) -> dict:
    """An evaluation's results (Keras's figures, and eval_images from the metrics it has just updated),
    printed as the held-out line."""
    results = {name: float(value) for name, value in evaluated.items()}
    results['eval_images'] = int(classifier.top_1.count.numpy())
    print_fn(f'held-out top-1 {100 * results["top_1"]:.2f}% top-5 {100 * results["top_5"]:.2f}% '
             f'loss {results["loss"]:.4f} on {results["eval_images"]} images')
    if results['eval_images'] != config.num_eval_images:
        print_fn(f'warning: evaluated {results["eval_images"]} images but --num_eval_images='
                 f'{config.num_eval_images}; set it to the size of the validation set (or see the skipped '
                 'bad records above)')
    return results
