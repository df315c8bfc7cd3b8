"""Cost models: predicted times and bytes that passes choose by (k chunks, packing degree,
embedding strategy), kept apart from the passes so a planner can ask them too."""
