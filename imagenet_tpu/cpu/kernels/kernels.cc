// All our CPU kernels as one translation unit, which native.py compiles: TensorFlow's headers, most of the compile
// time (about 8 s each on a 2-core machine), are then parsed once rather than once per file.
#include "batch_norm.cc"
#include "winograd.cc"
