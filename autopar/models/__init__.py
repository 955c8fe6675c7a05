"""Reference models used by the demo, the benchmarks and the tests.

Every model is built from a config with random weights (no hub downloads). Each module offers
``make_*`` helpers that return ``(train_step, state, batch)`` either concrete (small configs, for
numerics) or abstract (``jax.ShapeDtypeStruct`` leaves, for planning large configs for free).
"""
