"""Plots of simulated (and, later, real) runs: PNG files via matplotlib's Agg backend."""
