"""The worker process: runs the model for one router and never decides policy.

Layout (data flow, in order):

- ``config``    the router's ``wire.WorkerConfig`` (the link's first frame), validated; ``--ipc-dir``
- ``loop``      ``WorkerLoop``: Hello, then StepPlan -> StepOutput over the shared-memory rings
- ``executor``  ``Executor``: per-request state, StepPlan -> ForwardBatch -> forward -> sample
- ``sampler``   ``Sampler``: batched greedy / temperature / top-k / top-p, seeded draws, logprobs
- ``logit_adjust`` the sampler's logit_bias, min_tokens bans and presence / frequency / repetition penalties
- ``guidance``  structured output: one llguidance matcher per constrained request, the rows' token masks
- ``prompt_logprobs`` the prompt tokens' logprobs of requests that ask (``echo``), from extra logits rows
- ``profiling`` cProfile around the whole process (``WorkerConfig.profile_path``)
- ``__main__``  the command line entry point
"""
