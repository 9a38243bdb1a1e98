"""planc run's launcher process: starts every rank of a run on this machine, where they
meet, and what they tell it."""
