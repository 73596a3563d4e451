"""The benchmarks, a package: run each script from the repository root as a module,
``python -m bench.<script> ...`` (``python -m bench.serving slora-s1``, ``python -m
bench.decode_step``); bench/README.md lists them with their latest results.

Shared modules (imported by the scripts, never the other way round)::

    common.py        model shapes, random model / adapter / delta directories, copy bandwidth,
                     timers, result files (bench/results/<experiment>-<device>-<date>.json)
    script_env.py    prepare(): what a script calls before importing triton or deltaserve
                     (--smoke: kernels in the CPU interpreter; pyworker/ importable)
    launch.py        starting a server process and waiting for /ready; ServerSpec, Endpoint;
                     the daemon's launcher
    workload.py      seeded request traces (S-LoRA, Punica, DeltaZip shapes)
    replay.py        open-loop replay of a trace over SSE / WebSocket, TTFT / TPOT / SLO metrics
    http_sse.py      the small HTTP/SSE server the fake server and the baselines share
    serving/         the serving experiments (a package: experiments, variants, servers, runner,
                     report, cli)

Programs run as their own process by the above: ``baselines.py`` (the peft / swap baseline
servers, started by serving/servers.py) and ``fake_server.py``. One-off A/B scripts and the
results they wrote are kept under ``archive/`` (bench/archive/README.md).

Import direction: scripts → serving → launch, replay → workload, common. baselines.py imports
only http_sse and common. tests/bench/test_bench_imports.py checks that every module imports in a fresh
interpreter and that there is no cycle.
"""
