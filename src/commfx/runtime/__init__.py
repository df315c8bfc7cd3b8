"""The runtime wing: executes compiled graphs on each rank.

The comm scheduler and its priority lanes (the only code that calls torch.distributed),
the graph executor, gradient sync, the per-rank module `distribute` returns, traces, and the
time-bounded launcher and worker. It never compiles and never imports the compiler or the
passes: graphs and the function that lowers them are handed in. Import the modules directly.
"""
