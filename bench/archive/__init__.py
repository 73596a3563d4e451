"""One-off comparisons kept for the record, and the results and README sections they and the
superseded runs produced (bench/archive/README.md). Scripts here run from the repository root as
``python3 -m bench.archive.<script>``; their results still go to bench/results/ (``common.write_result``)."""
