"""Data: the TFRecord schema, listing and reading shards, record counts, preprocessing, the input pipeline, the
tf.data service and class names."""
