"""Step time of a ResNet with LARS (and RMSprop warm-up) against momentum SGD, measured in one run; also our
momentum SGD (one kernel per variable, imagenet_tpu/optim/sgd.py) against tf_keras's (`sgd_tf_keras`).

Same network, batch, image size and synthetic batch for every optimizer; the optimizers are timed in alternating
rounds so that machine noise hits all of them alike. Prints each median step time and the ratios to SGD; the
last line is one JSON object with all figures.

    python tools/benchmarks/benchmark_optimizer.py --depth=50 --image_size=64 --batch_size=32
    python tools/benchmarks/benchmark_optimizer.py --optimizers=sgd,sgd_tf_keras --image_size=128 --rounds=8
"""

import dataclasses
import json

from absl import app, flags

import step_timing  # pylint: disable=wrong-import-position  (beside this file: on sys.path when run as a script)


def define_flags():
    flags.DEFINE_integer('depth', 50, 'ResNet depth.')
    flags.DEFINE_integer('image_size', 64, 'Image side, in pixels (224 on an accelerator).')
    flags.DEFINE_integer('batch_size', 32, 'Images per step.')
    flags.DEFINE_integer('steps', 5, 'Timed steps per round.')
    flags.DEFINE_integer('rounds', 5, 'Alternating rounds.')
    flags.DEFINE_list('optimizers', ['sgd', 'lars', 'rmsprop_warmup'], "Optimizers to time (--optimizer's "
                      "values, or 'sgd_tf_keras': tf_keras's momentum SGD); the first is the base.")


def time_optimizers(depth, image_size, batch_size, steps, rounds, optimizers, print_fn=print):
    """{optimizer: [seconds per step of each round]}, same network, weights and synthetic batch for each."""
    import tf_keras as keras
    from imagenet_tpu.data import input_pipeline
    from imagenet_tpu import builders
    from imagenet_tpu.config import Config
    keras.utils.set_random_seed(0)
    base = Config(depth=depth, image_size=image_size, global_batch_size=batch_size, num_classes=1000,
                  strategy='default', warmup_epochs=0)
    data = input_pipeline.synthetic_dataset(base)  # one fixed batch, repeated: no input cost
    initial = builders.build_network(base).get_weights()
    runners = {}
    for name in optimizers:
        classifier = builders.build_classifier(dataclasses.replace(base, optimizer=name.replace('_tf_keras', '')))
        if name == 'sgd_tf_keras':   # the same step and schedule with tf_keras's SGD, an op per term of its update
            classifier.compile(optimizer=keras.optimizers.SGD(classifier.optimizer.learning_rate,
                                                              momentum=base.momentum), weighted_metrics=[])
            classifier.optimizer.build(classifier.network.trainable_variables)
        classifier.network.set_weights(initial)
        iterator = iter(data)
        step_timing.warm_up(classifier, iterator)
        runners[name] = (classifier, iterator)
    return step_timing.time_rounds(runners, steps, rounds, print_fn)


def main(argv):
    del argv
    step_timing.environment()
    f = flags.FLAGS
    times = time_optimizers(f.depth, f.image_size, f.batch_size, f.steps, f.rounds, f.optimizers)
    result = {'depth': f.depth, 'image_size': f.image_size, 'batch_size': f.batch_size,
              **step_timing.summarize(times, f.optimizers[0], f.batch_size)}
    print(json.dumps(result))


if __name__ == '__main__':
    define_flags()
    app.run(main)
