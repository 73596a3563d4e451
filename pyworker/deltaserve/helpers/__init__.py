"""CPU LoRA helpers: processes that compute a cold adapter's LoRA during its prefill (CaraServe).

A worker started with ``--cpu-lora-helpers N`` keeps N helper processes, each pinned to one CPU and
mapping the host tier's adapter copies read-only. When a new request's adapter is in host memory
but not yet in the pool, its prefill starts at once: per adapted module the worker hands the rows'
LoRA input to the helpers through shared memory and adds their ``scale * x A^T B^T`` to the base
output, while the adapter's pages load; from the next step on the normal path runs it.

The package, in the order data flows::

    shm.py       memfd shared segments (the arena, the control words, the data rows)
    protocol.py  pipe frames, control words, data layout, adapter entries (no pickle)
    compute.py   the LoRA math of one job, in numpy (what the helpers and the fallback run)
    main.py      the helper process (python -m deltaserve.helpers.main)
    pool.py      HelperPool: start lazily, pin, submit / wait with deadlines, kill and restart
    model.py     the profile, T_max, helpers per prefill, the adaptive rule, decision counts
    assist.py    CpuAssist: the worker side (decision, deferred placement, the LoraLinear hooks)
    signalled.py the sync-free invocation (the default on CUDA): j frames, SEQ written by the
                 device after its copy of x, the stream waiting on DONE, a watcher thread that
                 answers for a helper that fails or stalls
    signal_op.py the CUDA op of that invocation (csrc/cpu_lora_signal.cu) and its host fallback

The helpers import numpy only (never torch), so they start in a fraction of a second.
"""
