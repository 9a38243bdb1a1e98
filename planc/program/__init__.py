"""The rank program format: the torch-free contract between the compiler and the runtime
(programs, operands, the model, group and route tables, the rank table, shared names)."""
