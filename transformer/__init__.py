"""AIStore ETL transformer for WebDataset shards.

Layout (data flows one way): ``config``/``options`` (settings, etl_args) -> ``spec`` (torchvision v2
pipelines) -> ``samples`` (decode, transform, .npy) -> ``shards`` (streaming tar) -> ``engine`` (ordered
parallel map, error policy) -> ``server`` (the AIS ETL contract over HTTP/WebSocket). ``client`` is the
training side and imports none of the server's dependencies.
"""

__version__ = "0.1.0"
