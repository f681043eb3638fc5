import sys, numpy as np, tensorflow as tf
def w(p):
    r = tf.train.load_checkpoint(p)
    return {n: r.get_tensor(n) for n in r.get_variable_to_shape_map() if 'CHECKPOINTABLE' not in n}
a, b = w(sys.argv[1]), w(sys.argv[2])
d = sorted(((float(np.max(np.abs(a[n].astype(np.float64) - b[n]))), n) for n in a), reverse=True)
print(d[:3], sum(x > 0 for x, _ in d))
