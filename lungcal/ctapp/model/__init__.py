"""The MIL network inside MONAI engines: batch and step pieces, LR schedule, handlers, checkpoints, predict, heads."""
