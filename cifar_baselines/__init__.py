"""CIFAR-10 / CIFAR-10-LT baselines on the lungcal calibration toolkit."""
