"""The ``omni`` command line: thin click wrappers over the library."""
