"""The validated plan and what it fixes: the mesh's axes and groups, the layout of ranks
over devices, the learning-rate schedule, and reading a plan back from plan.json."""
