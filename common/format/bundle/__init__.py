"""The bundle format: HDF5 layout, the msgpack index and its validators, the version gate and migrations."""
