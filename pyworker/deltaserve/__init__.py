"""deltaserve: serve many fine-tuned variants of one base LLM in one batch (base + delta).

Python side of the system. Layout (the data flow, in order):

- ``wire``       generated mirror of the Rust ``ipc`` crate's schema (never edit by hand)
- ``_native``    private Rust extension: the shared-memory ring the worker talks through
- ``worker``     the worker process: IPC loop, executor (StepPlan -> forward -> StepOutput)
- ``model``      one generic decoder for the Llama family, its loader and the paged KV cache
- ``demo_model`` converts the bundled SmolLM2-135M-Instruct GGUF into an HF directory, once
"""

__version__ = "0.1.0"
