"""The compiler wing: model -> FX graph (capture), the Program IR the passes rewrite,
lowering to aot_autograd forward/backward graphs, and the one renderer for dumps and goldens.

`pipeline.compile_program` runs capture -> passes; `lower.compile_training` turns a rewritten
graph into what the runtime executes. Import the modules directly: this file imports
nothing, so that passes can use `compiler.program` without pulling in the pipeline.
"""
