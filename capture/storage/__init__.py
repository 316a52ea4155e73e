"""Writing bundles: the atomic HDF5 writer and the background streaming of tensor bytes."""
