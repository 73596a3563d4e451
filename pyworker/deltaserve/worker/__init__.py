"""The worker process: runs the model for one router and never decides policy.

Layout (data flow, in order):

- ``config``    ``WorkerConfig``: every flag of ``python -m deltaserve.worker``, validated
- ``loop``      ``WorkerLoop``: Hello, then StepPlan -> StepOutput over the shared-memory rings
- ``executor``  ``Executor``: per-request state, StepPlan -> ForwardBatch -> forward -> sample
- ``sampler``   ``Sampler``: batched greedy / temperature / top-k / top-p, seeded draws, logprobs
- ``__main__``  the command line entry point
"""
