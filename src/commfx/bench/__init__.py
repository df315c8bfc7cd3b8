"""The measuring wing: `commfx bench`'s harness, the emulated multi-node cluster (network
namespaces joined by rate-limited veth links) and the calibration of links and compute.

Nothing below the doors imports this package. Import the modules directly.
"""
