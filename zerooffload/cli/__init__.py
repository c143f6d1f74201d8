"""The faces: the ``zerooffload`` command, training, benchmarks, doctor, estimate."""
