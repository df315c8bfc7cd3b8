"""Schedule passes: they run on the lowered (aot_autograd) forward and backward graphs and
change when things run, never what is computed."""
