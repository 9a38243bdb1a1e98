"""The oracle of planc run --check: the model in one process, unsharded, and the comparison
of a distributed run against it."""
