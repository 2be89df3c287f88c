"""Benchmark suite: this service against the conventional AIS ETL and client-side decoding (``python -m bench.run``);
bench/experiments/ holds the one-off experiments that settled design choices, bench/results/ the kept runs."""
