"""Inter-operator (pipeline) parallelism: schedules as data, their costs, and a pipelined step.

``schedules``: which microbatch each stage runs at each tick (GPipe, 1F1B, interleaved/circular),
priced into a timeline (bubble, per-stage busy time) with its buffers (microbatches in flight).
"""
