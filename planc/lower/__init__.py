"""The lowering: the communication graph to one rank program per pipeline stage, with
the bindings, the model table and the group and route tables a build writes."""
