"""Registers the subcommands that live outside `sim.cli` (training, decode, export, demo)."""
