"""The test bed shared by the tests and the benchmarks: ports, the service under test, AIS clusters, fakes, shards.

It imports neither ``tests`` nor ``bench``; both import it. It is not part of the wheel or the image.
"""
