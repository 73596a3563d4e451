"""``python -m bench.serving EXPERIMENT ...``: the serving experiments' command line (cli.py)."""

import signal

from bench.serving.cli import exit_on_sigterm, main

if __name__ == "__main__":
    # A killed run (`timeout`, a job limit) unwinds like Ctrl-C: the point in progress is written
    # with what it measured (runner.run()), and the server it started is stopped (it runs in its
    # own session, so it would otherwise outlive this process and hold the GPU).
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    main()
