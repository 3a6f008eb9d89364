"""The checkpoint store: async, atomic, checksummed h5py checkpoints."""
