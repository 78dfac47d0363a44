"""The training workflows of the CT bundles: stage 1 (+ post-hoc calibrators), the deep ensemble, LAS."""
