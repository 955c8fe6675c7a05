"""Inter-operator (pipeline) parallelism: schedules as data, their costs, and a pipelined step.

``schedules``: which microbatch each stage runs at each tick (GPipe, 1F1B, eager 1F1B,
interleaved/circular, ZB-H1), priced into a timeline (bubble, per-stage busy time) with its
buffers (microbatches in flight).
``model``: the ``StagedModel`` a step declares; ``unrolled``: an unrolled model's numbered
layers found and stacked (the layout the pipelined step runs on); ``derive``: a
``StagedModel`` cut from a loss function's traced program; ``hf``: HF's Flax GPT-2 by hand.
``runtime``: the pipelined step as one ``jax.jit``; ``mpmd``: as many programs, one per stage
and action, issued asynchronously (one process or one per stage group under
``jax.distributed``); ``split``: a layer's backward cut into its input and weight halves for
zero-bubble schedules. ``planning``: stage costs, a choice priced, ``pipeline=`` searched.
``dp``: the layer-range dynamic program (Alpa's inter-op pass). ``search``: stage counts x
submeshes for clusters planned abstractly. ``record``: ``PipelinePlan`` and its JSON.
``measured``: a compiled step's per-stage busy time and bubble from a ``jax.profiler`` trace.
"""
