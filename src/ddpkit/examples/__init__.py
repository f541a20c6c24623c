"""Bundled examples on real data (layer 7): ``ddpkit demo`` and the digits data set."""
