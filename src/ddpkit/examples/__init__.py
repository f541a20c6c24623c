"""Bundled examples on real data: ``ddpkit demo`` and the digits data set."""
