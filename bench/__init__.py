"""Benchmark suite: this service against the conventional AIS ETL and client-side decoding (``python -m bench.run``)."""
